"""gRPC KV sender: the control plane that streams one transfer's chunks to a decode worker's ``KvTransfer.PushKv``.

Lifecycle of a send: plan the chunks (:func:`~kvtransfer.send_stream.plan_job`), re-block
for the destination, open the data plane for the endpoint, stream the ``"kv"`` chunks
(each leaves once its layers are computed, with a ``progress``) and the ``"done"`` chunk,
then check the receiver's ack. Where each chunk's tensor travels is the data plane's
business (:class:`~kvtransfer.send_stream.SendDataPlane`): inside the message by default
(:class:`InlineData`, the ``"grpc"`` transport), or what another transport supplies
(``"torch_dist"``: :mod:`kvtransfer.dist_transport`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import torch

from kvtransfer.config import DEFAULT_MAX_CHUNK_BYTES
from kvtransfer.errors import KvDataPlaneError, KvTransferError
from kvtransfer.frames import frame_bytes, push_kv
from kvtransfer.memory import keep_freed_memory
from kvtransfer.progress import LayerProgress
from kvtransfer.registry import ChannelFactory, plaintext_channel
from kvtransfer.send_stream import (
    OutboundData,
    SendDataPlane,
    SendJob,
    StreamControl,
    check_destination,
    chunk_stream,
    plan_job,
)
from kvtransfer.states import TransferState, TransferStateTable
from kvtransfer.transport import KvDestinationLike, KvSender, SendResult
from kvtransfer.wire import encode_kv_chunk
from pdcluster.v1 import kv_pb2

log = logging.getLogger(__name__)

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (("grpc.max_send_message_length", -1),)
"""gRPC channel options of every KV sender's channel (``channel_options`` add to them)."""


class InlineData:
    """The ``"grpc"`` data plane: each chunk's tensor travels inside its message (stateless)."""

    @contextlib.contextmanager
    def open(self, job: SendJob, endpoint: str) -> Iterator[OutboundData]:
        """See :meth:`SendDataPlane.open`; never fails."""
        yield _InlineStream()

    def close(self) -> None:
        """Nothing to release."""


class _InlineStream:
    """One transfer's chunks framed with their tensor: gathered straight into the message, checksummed
    on the way (:mod:`kvtransfer.onepass`); where that cannot run, gathered into one buffer reused for
    every chunk (its pages stay mapped) and copied from it into the message."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def encode(self, job: SendJob, i: int) -> tuple[bytes, int]:
        """See :meth:`OutboundData.encode`: the chunk's wire bytes (:func:`kvtransfer.frames.frame_bytes`),
        in one pass from the cache where the fused kernel runs (:mod:`kvtransfer.onepass`)."""
        framed = job.frame(i)
        if framed is not None:
            return framed
        if self._buffer is None:
            self._buffer = torch.empty(job.max_chunk_numel(), dtype=job.kv_cache.dtype, device=job.kv_cache.device)
        tensor = job.gather(i, out=self._buffer)
        return frame_bytes(encode_kv_chunk(job.meta(i), tensor)), tensor.numel() * tensor.element_size()

    def after_yield(self, job: SendJob, ctl: StreamControl) -> None:
        """Nothing to do: the tensor left with its message."""


class GrpcKvSender(KvSender):
    """:class:`KvSender` over gRPC client streaming, one cached channel per endpoint.

    State of a transfer: ``BOOTSTRAPPING`` (call opening) -> ``TRANSFERRING``
    (a chunk handed to gRPC) -> ``SUCCESS``, or ``FAILED`` from any of them;
    with a ``progress``, ``WAITING_FOR_INPUT`` whenever the next chunk's layers
    are not computed yet.

    Args:
        timeout_s: deadline of one whole ``PushKv`` call (seconds).
        max_chunk_bytes: payload bytes per chunk at most; the receiving server
            must accept messages this large plus header (see
            :func:`kvtransfer.grpc_transport.kv_server_options`).
        data_plane: where chunk tensors travel; :class:`InlineData` (inside the
            messages) by default. The sender owns it: :meth:`close` closes it.
        channel_options: extra gRPC channel options, ``(key, value)`` pairs.
        state_history: finished transfers kept for :meth:`poll`.
        connect: opens the channel to an endpoint (the worker's credentials and call
            metadata, :class:`kvtransfer.registry.ChannelFactory`); plaintext by default.

    Raises:
        ValueError: non-positive ``timeout_s``, ``max_chunk_bytes`` or ``state_history``.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        data_plane: SendDataPlane | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        state_history: int = 4096,
        connect: ChannelFactory = plaintext_channel,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
        keep_freed_memory()
        self._timeout_s = timeout_s
        self._max_chunk_bytes = max_chunk_bytes
        self._channel_options = [*CHANNEL_OPTIONS, *channel_options]
        self._connect = connect
        self._states = TransferStateTable(state_history)
        self._data = data_plane if data_plane is not None else InlineData()
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, grpc.StreamUnaryMultiCallable]] = {}
        self._in_flight: dict[str, str] = {}  # transfer id -> request id (named in failure lines)
        self._closed = False

    def send(
        self,
        request_id: str,
        transfer_id: str,
        dest: KvDestinationLike,
        kv_cache: torch.Tensor,
        src_block_ids: Sequence[int],
        first_token_id: int | None,
        first_token_logprobs: dict[Any, Any] | None = None,
        layers_per_chunk: int = 1,
        *,
        progress: LayerProgress | None = None,
    ) -> SendResult:
        """See :meth:`KvSender.send`; the deadline is ``timeout_s`` from the constructor."""
        t0 = time.perf_counter()
        job = plan_job(request_id, transfer_id, dest, kv_cache, src_block_ids, first_token_id,
                       first_token_logprobs, layers_per_chunk, self._max_chunk_bytes, progress, self._timeout_s)
        self._start(transfer_id, request_id)
        started_at = time.monotonic()
        try:
            try:
                job = check_destination(job, dest)
            except ValueError as exc:
                raise self._failure(transfer_id, str(exc)) from None
            ctl = self._push(job, dest.kv_endpoint)
            self._states.set(transfer_id, TransferState.SUCCESS)
            return SendResult(
                bytes_sent=ctl.bytes_sent,
                seconds=time.perf_counter() - t0,
                num_chunks=ctl.num_chunks,
                bytes_acknowledged=ctl.bytes_sent,
                started_at=started_at,
                first_chunk_at=ctl.first_chunk_at,
                last_chunk_at=ctl.last_chunk_at,
                acked_at=time.monotonic(),
                input_finished_at=progress.finished_at if progress is not None else None,
                bytes_before_finish=ctl.bytes_before_finish,
            )
        except KvTransferError:
            raise
        except BaseException:
            self._states.set(transfer_id, TransferState.FAILED)
            raise
        finally:
            with self._lock:
                self._in_flight.pop(transfer_id, None)

    def poll(self, transfer_id: str) -> TransferState:
        """See :meth:`KvSender.poll`."""
        return self._states.get(transfer_id)

    def close(self) -> None:
        """Close every cached channel and the data plane; later :meth:`send` calls raise :class:`KvTransferError`."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel, _ in channels:
            channel.close()
        self._data.close()

    def _start(self, transfer_id: str, request_id: str) -> None:
        with self._lock:
            if transfer_id in self._in_flight:
                raise ValueError(f"transfer {transfer_id!r} is already being sent")
            self._in_flight[transfer_id] = request_id
        self._states.set(transfer_id, TransferState.BOOTSTRAPPING)

    def _failure(self, transfer_id: str, reason: str) -> KvTransferError:
        self._states.set(transfer_id, TransferState.FAILED)
        request_id = self._in_flight.get(transfer_id, "")  # no lock: _stub calls this holding it
        log.warning("KV transfer %s failed: %s", transfer_id, reason, extra={"request_id": request_id})
        return KvTransferError(transfer_id, reason)

    def _stub(self, transfer_id: str, endpoint: str) -> grpc.StreamUnaryMultiCallable:
        with self._lock:
            if self._closed:
                raise self._failure(transfer_id, "sender is closed")
            entry = self._channels.get(endpoint)
            if entry is None:
                channel = self._connect(endpoint, self._channel_options)
                entry = self._channels[endpoint] = (channel, push_kv(channel))
            return entry[1]

    def _push(self, job: SendJob, endpoint: str) -> StreamControl:
        push = self._stub(job.transfer_id, endpoint)
        ctl = StreamControl()
        try:
            with self._data.open(job, endpoint) as data:
                try:
                    chunks = chunk_stream(job, ctl, data, self._states)
                    ack: kv_pb2.KvAck = push(chunks, timeout=self._timeout_s)
                except grpc.RpcError as exc:
                    ctl.stop()  # before FAILED is recorded, so no later TRANSFERRING overwrites it
                    code = exc.code() if isinstance(exc, grpc.Call) else None
                    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                    reason = ctl.error or f"{endpoint}: {getattr(code, 'name', code)}: {details}"
                    raise self._failure(job.transfer_id, reason) from None
                finally:
                    ctl.stop()
                if ctl.type_error is not None:
                    self._states.set(job.transfer_id, TransferState.FAILED)
                    raise ctl.type_error
                # The root cause first: a receiver's rejection ends the data plane too, while a
                # local error (producer failed, data plane down) is what made a stream incomplete.
                if not ack.ok and (ctl.error is None or not ack.error.startswith("incomplete:")):
                    raise self._failure(job.transfer_id, f"receiver rejected: {ack.error}")
                if ctl.error is not None:
                    raise self._failure(job.transfer_id, f"local error while sending: {ctl.error}")
                if not ack.ok:
                    raise self._failure(job.transfer_id, f"receiver rejected: {ack.error}")
                if ack.bytes_received != ctl.bytes_sent:
                    raise self._failure(
                        job.transfer_id,
                        f"receiver acknowledged {ack.bytes_received} bytes, {ctl.bytes_sent} sent",
                    )
        except KvDataPlaneError as exc:  # the data plane could not even start
            raise self._failure(job.transfer_id, str(exc)) from None
        return ctl

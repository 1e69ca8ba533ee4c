"""gRPC KV sender: streams one transfer's chunks to a decode worker's ``KvTransfer.PushKv``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from kvtransfer.blocks import check_kv_cache, gather_blocks
from kvtransfer.chunking import ChunkSpec, plan_chunks
from kvtransfer.errors import KvTransferError
from kvtransfer.states import TransferState, TransferStateTable
from kvtransfer.transport import KvDestinationLike, KvSender, SendResult
from kvtransfer.wire import KvChunkMeta, encode_done_chunk, encode_kv_chunk
from pdcluster.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024
"""Payload bytes per chunk by default: fits gRPC's default 4 MiB receive limit with header room."""


class _StreamControl:
    """Shared between :meth:`GrpcKvSender.send` and gRPC's request-consuming thread.

    Chunks are produced under ``lock`` and only while not ``stopped``; ``send``
    calls :meth:`stop` before it returns, so no gather touches ``kv_cache``
    (whose blocks the caller may then free) and no state is set afterwards.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped = False
        self.bytes_sent = 0
        self.num_chunks = 0
        self.error: str | None = None

    def stop(self) -> None:
        with self.lock:
            self.stopped = True


@dataclass(frozen=True)
class _Job:
    request_id: str
    transfer_id: str
    generation: int
    kv_cache: torch.Tensor
    src: list[int]
    dst: list[int]
    plan: list[ChunkSpec]
    done: kv_pb2.KvChunk


class GrpcKvSender(KvSender):
    """:class:`KvSender` over gRPC client streaming, one cached channel per endpoint.

    State of a transfer: ``BOOTSTRAPPING`` (call opening) -> ``TRANSFERRING``
    (first chunk handed to gRPC) -> ``SUCCESS``, or ``FAILED`` from any of them.

    Args:
        timeout_s: deadline of one whole ``PushKv`` call (seconds).
        max_chunk_bytes: payload bytes per chunk at most; the receiving server
            must accept messages this large plus header (see
            :func:`kvtransfer.grpc_transport.kv_server_options`).
        channel_options: extra gRPC channel options, ``(key, value)`` pairs.
        state_history: finished transfers kept for :meth:`poll`.
        corrupt_chunk_index: test hook; flip one payload byte of this ``"kv"``
            chunk (0-based) after its checksum was computed.

    Raises:
        ValueError: non-positive ``timeout_s``, ``max_chunk_bytes`` or ``state_history``.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
        state_history: int = 4096,
        corrupt_chunk_index: int | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
        self._timeout_s = timeout_s
        self._max_chunk_bytes = max_chunk_bytes
        self._channel_options = [("grpc.max_send_message_length", -1), *channel_options]
        self._states = TransferStateTable(state_history)
        self._corrupt_chunk_index = corrupt_chunk_index
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, kv_pb2_grpc.KvTransferStub]] = {}
        self._in_flight: set[str] = set()
        self._closed = False

    def send(
        self,
        request_id: str,
        transfer_id: str,
        dest: KvDestinationLike,
        kv_cache: torch.Tensor,
        src_block_ids: Sequence[int],
        first_token_id: int,
        first_token_logprobs: dict[Any, Any] | None = None,
        layers_per_chunk: int = 1,
    ) -> SendResult:
        """See :meth:`KvSender.send`; the deadline is ``timeout_s`` from the constructor."""
        check_kv_cache(kv_cache)
        num_layers, _, num_blocks, block_size, heads, head_dim = kv_cache.shape
        src = [int(b) for b in src_block_ids]
        if not src or min(src) < 0 or max(src) >= num_blocks:
            raise ValueError(f"src_block_ids must be non-empty ids in [0, {num_blocks}), got {src}")
        plan = plan_chunks(
            num_layers,
            len(src),
            2 * block_size * heads * head_dim * kv_cache.element_size(),
            layers_per_chunk,
            self._max_chunk_bytes,
        )
        done = encode_done_chunk(  # before starting: a non-msgpack-able logprobs raises TypeError here
            request_id,
            transfer_id,
            int(dest.generation),
            num_chunks=len(plan),
            num_layers=num_layers,
            first_token_id=int(first_token_id),
            first_token_logprobs=first_token_logprobs,
        )
        self._start(transfer_id)
        t0 = time.perf_counter()
        try:
            dst = [int(b) for b in dest.block_ids]
            if int(dest.block_size) != block_size:
                raise self._failure(
                    transfer_id,
                    f"destination block_size {dest.block_size} != source {block_size} (re-blocking unsupported)",
                )
            if len(dst) != len(src):
                raise self._failure(
                    transfer_id, f"destination has {len(dst)} blocks, source {len(src)}"
                )
            job = _Job(
                request_id=request_id,
                transfer_id=transfer_id,
                generation=int(dest.generation),
                kv_cache=kv_cache,
                src=src,
                dst=dst,
                plan=plan,
                done=done,
            )
            ctl = self._push(job, dest.kv_endpoint)
            self._states.set(transfer_id, TransferState.SUCCESS)
            return SendResult(
                bytes_sent=ctl.bytes_sent,
                seconds=time.perf_counter() - t0,
                num_chunks=ctl.num_chunks,
                bytes_acknowledged=ctl.bytes_sent,
            )
        except KvTransferError:
            raise
        except BaseException:
            self._states.set(transfer_id, TransferState.FAILED)
            raise
        finally:
            with self._lock:
                self._in_flight.discard(transfer_id)

    def poll(self, transfer_id: str) -> TransferState:
        """See :meth:`KvSender.poll`."""
        return self._states.get(transfer_id)

    def close(self) -> None:
        """Close every cached channel; later :meth:`send` calls raise :class:`KvTransferError`."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel, _ in channels:
            channel.close()

    def _start(self, transfer_id: str) -> None:
        with self._lock:
            if transfer_id in self._in_flight:
                raise ValueError(f"transfer {transfer_id!r} is already being sent")
            self._in_flight.add(transfer_id)
        self._states.set(transfer_id, TransferState.BOOTSTRAPPING)

    def _failure(self, transfer_id: str, reason: str) -> KvTransferError:
        self._states.set(transfer_id, TransferState.FAILED)
        log.warning("KV transfer %s failed: %s", transfer_id, reason)
        return KvTransferError(transfer_id, reason)

    def _stub(self, transfer_id: str, endpoint: str) -> kv_pb2_grpc.KvTransferStub:
        with self._lock:
            if self._closed:
                raise self._failure(transfer_id, "sender is closed")
            entry = self._channels.get(endpoint)
            if entry is None:
                channel = grpc.insecure_channel(endpoint, options=self._channel_options)
                entry = self._channels[endpoint] = (channel, kv_pb2_grpc.KvTransferStub(channel))
            return entry[1]

    def _push(self, job: _Job, endpoint: str) -> _StreamControl:
        stub = self._stub(job.transfer_id, endpoint)
        ctl = _StreamControl()
        try:
            ack: kv_pb2.KvAck = stub.PushKv(self._chunks(job, ctl), timeout=self._timeout_s)
        except grpc.RpcError as exc:
            ctl.stop()  # before FAILED is recorded, so no later TRANSFERRING overwrites it
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            reason = ctl.error or f"{endpoint}: {getattr(code, 'name', code)}: {details}"
            raise self._failure(job.transfer_id, reason) from None
        finally:
            ctl.stop()
        if ctl.error is not None:
            raise self._failure(job.transfer_id, f"local error while sending: {ctl.error}")
        if not ack.ok:
            raise self._failure(job.transfer_id, f"receiver rejected: {ack.error}")
        if ack.bytes_received != ctl.bytes_sent:
            raise self._failure(
                job.transfer_id,
                f"receiver acknowledged {ack.bytes_received} bytes, {ctl.bytes_sent} sent",
            )
        return ctl

    def _chunks(self, job: _Job, ctl: _StreamControl) -> Iterator[kv_pb2.KvChunk]:
        """Yield the kv chunks then the done chunk; a local error ends the stream early.

        Runs on gRPC's request-consuming thread; an error is recorded in
        ``ctl.error`` instead of raised, so the receiver sees a stream without
        a done chunk and fails the transfer.
        """
        try:
            for i, spec in enumerate(job.plan):
                with ctl.lock:
                    if ctl.stopped:
                        return
                    chunk = self._kv_chunk(job, spec, corrupt=i == self._corrupt_chunk_index)
                    ctl.bytes_sent += len(chunk.payload)
                    ctl.num_chunks += 1
                    if i == 0:
                        self._states.set(job.transfer_id, TransferState.TRANSFERRING)
                yield chunk
            with ctl.lock:
                if ctl.stopped:
                    return
            yield job.done
        except Exception as exc:  # reported through ctl, see docstring
            log.exception("KV transfer %s: error while producing chunks", job.transfer_id)
            ctl.error = f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _kv_chunk(job: _Job, spec: ChunkSpec, corrupt: bool) -> kv_pb2.KvChunk:
        blocks = gather_blocks(
            job.kv_cache, spec.layer_start, spec.layer_end, job.src[spec.block_start : spec.block_end]
        )
        meta = KvChunkMeta(
            request_id=job.request_id,
            transfer_id=job.transfer_id,
            generation=job.generation,
            layer_start=spec.layer_start,
            layer_end=spec.layer_end,
            block_ids=job.dst[spec.block_start : spec.block_end],
            block_size=blocks.shape[3],
        )
        chunk = encode_kv_chunk(meta, blocks)
        if corrupt:
            chunk.payload = _flip_one_byte(chunk.payload)
        return chunk


def _flip_one_byte(payload: bytes) -> bytes:
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 2] ^= 0xFF
    return bytes(corrupted)

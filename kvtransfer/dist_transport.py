"""The ``"torch_dist"`` KV transport: gRPC control plane, torch.distributed data plane.

Control plane: the ``KvTransfer.PushKv`` stream of :mod:`kvtransfer.grpc_sender` and
:mod:`kvtransfer.grpc_receiver` (headers, ``"done"`` chunk, ack), so states,
generations, stale checks, CRC32C and coverage are the same code; this module only
supplies their data planes. Each ``"kv"`` chunk is sent as a header-only message
marked ``"data": "dist"`` (:mod:`kvtransfer.wire`) and its tensor goes point to point
over a 2-rank pair group (:mod:`kvtransfer.dist_pairs`): gloo for CPU caches, NCCL
for CUDA caches. The sender is rank 0 and hosts the group's TCPStore; the receiver
joins as rank 1 on first contact. Its receiver also takes chunks with the tensor
inside the message (a ``"grpc"`` sender).

Registered (:mod:`kvtransfer.registry`) when :mod:`kvtransfer` is imported; option
``max_pairs_per_endpoint`` (sender; default 4): concurrent pair groups per receiver
endpoint. Workers reach it through the registry only::

    sender = create_sender(KvTransferConfig(transport="torch_dist"))
    result = sender.send(request_id, transfer_id, destination, kv_cache, block_ids, None, progress=progress)

Failure handling: every wait (group formation, send, receive) is bounded by the
sender's ``timeout_s``; a failed transfer drops its pair group on both sides and
the next transfer builds a new one.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import torch

from kvtransfer.dist_pairs import PostedRecv, ReceiverPairs, SenderPair, SenderPairs, backend_for
from kvtransfer.frames import KvFrame
from kvtransfer.errors import KvDataPlaneError
from kvtransfer.grpc_receiver import InboundData, KvTransferServicer, add_kv_transfer_servicer
from kvtransfer.grpc_sender import GrpcKvSender
from kvtransfer.registry import ChannelFactory, check_options, register_transport
from kvtransfer.send_stream import OutboundData, SendJob, StreamControl
from kvtransfer.transport import KvReceiverSink
from kvtransfer.wire import DATA_DIST, encode_dist_kv_chunk

NAME = "torch_dist"
_OPTIONS = ("max_pairs_per_endpoint",)


SENDS_IN_FLIGHT = 2
"""Tensors of one transfer a sender has on the wire at once: the next header goes out while earlier
tensors are still moving, so the receiver posts their receives early (with one, sender and receiver
went in lockstep: each chunk's header waited for the previous tensor to arrive)."""


class _PairData:
    """Data plane of one transfer over one pair group: header out, then the tensor, with up to
    :data:`SENDS_IN_FLIGHT` tensors moving at once."""

    def __init__(self, pair: SenderPair) -> None:
        self._pair = pair
        self._pending: collections.deque[tuple[torch.Tensor, int]] = collections.deque()
        self._in_flight: collections.deque[tuple[torch.Tensor, int, Any]] = collections.deque()

    def encode(self, job: SendJob, i: int) -> tuple[KvFrame, int]:
        tensor, crc = job.gather_checked(i)  # its own tensor: it leaves after its header while the next is gathered
        tag = self._pair.next_tag()
        chunk = encode_dist_kv_chunk(job.meta(i), tensor, self._pair.header_fields(tag), checksum=crc)
        self._pending.append((tensor, tag))
        return chunk, tensor.numel() * tensor.element_size()

    def after_yield(self, job: SendJob, ctl: StreamControl) -> None:
        if self._pending:
            tensor, tag = self._pending.popleft()
            self._in_flight.append((tensor, tag, self._pair.start_send(tensor, tag, job.deadline, ctl.is_stopped)))
        self._wait_until(SENDS_IN_FLIGHT - 1, job.deadline)  # returns with the newest send still moving

    def flush(self, deadline: float) -> None:
        """Wait for the sends still moving (the stream ended: acknowledged, they have left)."""
        self._wait_until(0, deadline)

    def _wait_until(self, moving: int, deadline: float) -> None:
        """Wait for the oldest sends until at most ``moving`` are still on the wire."""
        while len(self._in_flight) > moving:
            _, tag, work = self._in_flight.popleft()
            self._pair.wait_sent(work, tag, deadline)


class PairSendPlane:
    """A sender's data plane: pair groups to each receiver endpoint, each carrying one transfer at a time.

    At most ``max_pairs_per_endpoint`` transfers to one endpoint run at once; more
    wait for a free group within their deadline.

    Args:
        timeout_s: the pair groups' timeout (seconds): the sender's transfer deadline,
            so no wait outlives it by much.
        max_pairs_per_endpoint: concurrent pair groups per receiver endpoint (>= 1).

    Raises:
        ValueError: ``max_pairs_per_endpoint`` < 1.
    """

    def __init__(self, timeout_s: float, max_pairs_per_endpoint: int = 4) -> None:
        self._timeout_s = timeout_s
        self._pairs = SenderPairs(max_pairs_per_endpoint)

    @contextlib.contextmanager
    def open(self, job: SendJob, endpoint: str) -> Iterator[OutboundData]:
        """A pair group to ``endpoint`` for one transfer, kept for reuse when it ends without an exception.

        Raises:
            KvDataPlaneError: closed, every pair to ``endpoint`` stayed busy until the deadline,
                or the TCPStore could not start.
        """
        pair = self._pairs.acquire(endpoint, backend_for(job.kv_cache.device), self._timeout_s, job.deadline)
        ok = False
        try:
            data = _PairData(pair)
            yield data
            data.flush(job.deadline)
            ok = True
        finally:
            self._pairs.release(pair, endpoint, ok)

    def close(self) -> None:
        """Drop the idle pair groups; later transfers fail."""
        self._pairs.close()


class _PairStream:
    """Receiving data plane of one stream: posts each chunk's receive as soon as its header arrives
    (so the sender's send of it completes while earlier chunks are still being written), and
    remembers the pair its headers name, to drop it on failure."""

    def __init__(self, pairs: ReceiverPairs) -> None:
        self._pairs = pairs
        self._pair: str | None = None
        self._lock = threading.Lock()
        self._posted: dict[int, PostedRecv | KvDataPlaneError] = {}  # by tag; prepare's thread adds

    def note(self, header: dict[str, Any]) -> None:
        if header.get("data") == DATA_DIST and isinstance(header.get("dist"), dict):
            pair = header["dist"].get("pair")
            if isinstance(pair, str):
                self._pair = pair

    def prepare(self, header: dict[str, Any]) -> None:
        if header.get("data") != DATA_DIST:
            return
        try:
            posted: PostedRecv | KvDataPlaneError = self._pairs.post(header)
        except KvDataPlaneError as exc:  # raised by tensor() for this chunk
            posted = exc
        with self._lock:
            self._posted[header["dist"]["tag"]] = posted

    def tensor(self, header: dict[str, Any]) -> torch.Tensor:
        with self._lock:
            posted = self._posted.pop(header["dist"]["tag"], None)
        if isinstance(posted, KvDataPlaneError):
            raise posted
        return self._pairs.receive(header, posted)

    def drop(self) -> None:
        with self._lock:
            self._posted.clear()
        if self._pair is not None:
            self._pairs.drop(self._pair)


class PairReceivePlane:
    """A receiver's data plane: joins the senders' pair groups (rank 1) when their chunks name them."""

    def __init__(self) -> None:
        self._pairs = ReceiverPairs()

    def open_stream(self) -> InboundData:
        """See :meth:`kvtransfer.grpc_receiver.ReceiveDataPlane.open_stream`."""
        return _PairStream(self._pairs)


def _sender(*, timeout_s: float, max_chunk_bytes: int, options: Mapping[str, str],
            connect: ChannelFactory) -> GrpcKvSender:
    check_options(NAME, options, _OPTIONS)
    try:
        max_pairs = int(options.get("max_pairs_per_endpoint", "4"))
    except ValueError:
        raise ValueError(f"max_pairs_per_endpoint must be an integer, got {options['max_pairs_per_endpoint']!r}") from None
    return GrpcKvSender(timeout_s=timeout_s, max_chunk_bytes=max_chunk_bytes,
                        data_plane=PairSendPlane(timeout_s, max_pairs), connect=connect)


def _receiver(server: grpc.Server, sink: KvReceiverSink, *, options: Mapping[str, str]) -> KvTransferServicer:
    check_options(NAME, options, _OPTIONS)
    return add_kv_transfer_servicer(server, sink, PairReceivePlane())


register_transport(NAME, sender_factory=_sender, receiver_factory=_receiver)

"""The transport-independent half of a KV send: the job, its chunk stream and its bookkeeping.

A :class:`SendJob` is planned once per :meth:`KvSender.send` (source blocks in
chunks, each chunk's destination block ids from re-blocking). :func:`chunk_stream`
yields the job's messages in order (each chunk's framed ``bytes``, then the ``"done"``
:class:`~kvtransfer.frames.KvFrame`), waiting for each chunk's layers when a
:class:`~kvtransfer.progress.LayerProgress` is given; a producer thread prepares the
next chunk (gather, CRC32C, framing) while gRPC sends the current one. A
:class:`SendDataPlane` decides where each chunk's tensor travels (inside the
message for ``"grpc"``, over a pair group for ``"torch_dist"``); the gRPC sender
(:mod:`kvtransfer.grpc_sender`) is the control plane around both.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtransfer.blocks import check_kv_cache, gather_blocks
from kvtransfer.chunking import ChunkSpec, plan_chunks
from kvtransfer.errors import KvTransferError
from kvtransfer.frames import KvFrame
from kvtransfer.onepass import frame_kv_chunk, gather_checked
from kvtransfer.progress import LayerProgress
from kvtransfer.reblock import check_same_tokens, dest_block_range
from kvtransfer.states import TransferState, TransferStateTable
from kvtransfer.wire import KvChunkMeta, encode_done_chunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendJob:
    """One planned transfer.

    Attributes:
        dst_ids: per chunk of ``plan``, the destination block ids its tokens touch.
        done: the ``"done"`` chunk when the first token is known up front
            (``progress`` is ``None``), else ``None`` (built after ``progress.wait_finished``).
        deadline: ``time.monotonic()`` seconds by which the whole send must end.
    """

    request_id: str
    transfer_id: str
    generation: int
    kv_cache: torch.Tensor
    src: list[int]
    plan: list[ChunkSpec]
    dst_ids: list[list[int]]
    progress: LayerProgress | None
    done: KvFrame | None
    deadline: float

    def remaining(self) -> float:
        """Seconds left until :attr:`deadline` (may be negative)."""
        return self.deadline - time.monotonic()

    def meta(self, i: int) -> KvChunkMeta:
        """Header addressing of chunk ``i``."""
        spec = self.plan[i]
        block_size = self.kv_cache.shape[3]
        return KvChunkMeta(self.request_id, self.transfer_id, self.generation, spec.layer_start, spec.layer_end,
                           self.dst_ids[i], block_size, spec.block_start * block_size)

    def gather(self, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk ``i``'s source blocks ``[layers, 2, n, block_size, H, D]``: a new tensor, or a view of
        ``out`` (see :func:`~kvtransfer.blocks.gather_blocks`)."""
        spec = self.plan[i]
        return gather_blocks(self.kv_cache, spec.layer_start, spec.layer_end, self._src(spec), out=out)

    def frame(self, i: int) -> tuple[bytes, int] | None:
        """Chunk ``i``'s wire bytes gathered, checksummed and framed in one pass, and its payload
        bytes; ``None`` where that cannot run (see :func:`~kvtransfer.onepass.frame_kv_chunk`)."""
        spec = self.plan[i]
        framed = frame_kv_chunk(self.meta(i), self.kv_cache, self._src(spec))
        return None if framed is None else (framed, self._numel(spec) * self.kv_cache.element_size())

    def gather_checked(self, i: int) -> tuple[torch.Tensor, int | None]:
        """Chunk ``i``'s source blocks as a new tensor (:meth:`gather`) and their CRC32C, taken in the same
        pass where the fused kernel runs (:func:`~kvtransfer.onepass.gather_checked`), else ``None``."""
        spec = self.plan[i]
        got = gather_checked(self.kv_cache, spec.layer_start, spec.layer_end, self._src(spec))
        return (self.gather(i), None) if got is None else got

    def max_chunk_numel(self) -> int:
        """Elements of the largest chunk's tensor (to size a reusable gather buffer)."""
        return max(self._numel(c) for c in self.plan)

    def _src(self, c: ChunkSpec) -> list[int]:
        """The source block ids of chunk ``c``, in payload order."""
        return self.src[c.block_start:c.block_end]

    def _numel(self, c: ChunkSpec) -> int:
        shape = self.kv_cache.shape  # [L, 2, num_blocks, block_size, H, D] (a tensor or its HeadShards)
        return (c.layer_end - c.layer_start) * (c.block_end - c.block_start) * 2 * shape[3] * shape[4] * shape[5]


def plan_job(
    request_id: str,
    transfer_id: str,
    dest: Any,
    kv_cache: torch.Tensor,
    src_block_ids: Sequence[int],
    first_token_id: int | None,
    first_token_logprobs: dict[Any, Any] | None,
    layers_per_chunk: int,
    max_chunk_bytes: int,
    progress: LayerProgress | None,
    timeout_s: float,
) -> SendJob:
    """Validate local arguments and plan the chunks (no destination checks; see :func:`check_destination`).

    Raises:
        ValueError: bad cache layout, block ids, ``layers_per_chunk``, a
            ``progress`` of another layer count, or no ``first_token_id``
            without ``progress``.
        TypeError: ``first_token_logprobs`` is not msgpack-able (no ``progress``).
    """
    check_kv_cache(kv_cache)
    num_layers, _, num_blocks, block_size, heads, head_dim = kv_cache.shape
    src = [int(b) for b in src_block_ids]
    if not src or min(src) < 0 or max(src) >= num_blocks:
        raise ValueError(f"src_block_ids must be non-empty ids in [0, {num_blocks}), got {src}")
    if progress is not None and progress.num_layers != num_layers:
        raise ValueError(f"progress has {progress.num_layers} layers, kv_cache {num_layers}")
    if progress is None and first_token_id is None:
        raise ValueError("first_token_id is required without progress")
    plan = plan_chunks(num_layers, len(src), 2 * block_size * heads * head_dim * kv_cache.element_size(),
                       layers_per_chunk, max_chunk_bytes)
    done = None
    if progress is None:  # before starting: a non-msgpack-able logprobs raises TypeError here
        done = encode_done_chunk(request_id, transfer_id, int(dest.generation), len(plan), num_layers,
                                 int(first_token_id), first_token_logprobs)
    return SendJob(request_id, transfer_id, int(dest.generation), kv_cache, src, plan, [], progress, done,
                   time.monotonic() + timeout_s)


def check_destination(job: SendJob, dest: Any) -> SendJob:
    """Re-block: the job with each chunk's destination block ids.

    Raises:
        ValueError: the destination's block size is not positive, or source and
            destination cannot hold the same tokens (:func:`check_same_tokens`).
    """
    dst = [int(b) for b in dest.block_ids]
    src_bs, dst_bs = job.kv_cache.shape[3], int(dest.block_size)
    check_same_tokens(len(job.src), src_bs, len(dst), dst_bs)
    dst_ids = []
    for spec in job.plan:
        first, last = dest_block_range(len(dst), dst_bs, spec.block_start * src_bs, spec.block_end * src_bs)
        dst_ids.append(dst[first:last])
    return SendJob(**{**job.__dict__, "dst_ids": dst_ids})


class StreamControl:
    """Shared between ``send``, the thread consuming :func:`chunk_stream` and its producer thread.

    Chunks are produced under ``lock`` and only while not ``stopped``; ``send``
    calls :meth:`stop` before it returns, so no gather touches ``kv_cache``
    (whose blocks the caller may then free) and no state is set afterwards.
    Times are ``time.monotonic()`` seconds.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped = False
        self.bytes_sent = 0
        self.num_chunks = 0
        self.error: str | None = None
        self.type_error: TypeError | None = None
        self.first_chunk_at: float | None = None
        self.last_chunk_at: float | None = None
        self.bytes_before_finish = 0

    def stop(self) -> None:
        with self.lock:
            self.stopped = True

    def is_stopped(self) -> bool:
        with self.lock:
            return self.stopped


class OutboundData(Protocol):
    """The data plane of one transfer: where each chunk's tensor travels.

    ``encode`` runs under the stream lock on the producer thread, up to
    :data:`PREFETCH` chunks ahead of gRPC; ``after_yield`` on gRPC's thread, once per
    encoded chunk in order, after that chunk's message left.
    """

    def encode(self, job: SendJob, i: int) -> tuple[bytes | KvFrame, int]:
        """Chunk ``i``'s message (its blocks gathered with :meth:`SendJob.gather`, their CRC32C
        in the header) and its payload byte count."""

    def after_yield(self, job: SendJob, ctl: StreamControl) -> None:
        """Called once the message of the oldest encoded chunk not yet passed here was handed to gRPC.

        Raises:
            KvDataPlaneError: moving the tensor failed (recorded in ``ctl.error``).
        """


class SendDataPlane(Protocol):
    """A sender's data plane (:class:`~kvtransfer.grpc_sender.GrpcKvSender` takes one).

    Inline (the tensor inside the message) for ``"grpc"``; torch.distributed pair
    groups for ``"torch_dist"`` (:mod:`kvtransfer.dist_transport`).
    """

    def open(self, job: SendJob, endpoint: str) -> AbstractContextManager[OutboundData]:
        """The data plane of one transfer to ``endpoint``; its exit learns of a failure through the exception.

        Raises:
            KvDataPlaneError: it cannot start (the send then fails with this reason).
        """

    def close(self) -> None:
        """Release what the data plane holds; later :meth:`open` calls may raise :class:`KvDataPlaneError`."""


PREFETCH = 1
"""Chunks the producer thread may have ready beyond the one gRPC is sending."""
_END = object()


def chunk_stream(job: SendJob, ctl: StreamControl, data: OutboundData,
                 states: TransferStateTable) -> Iterator[bytes | KvFrame]:
    """Yield the kv chunks then the done chunk; a local error ends the stream early.

    Runs on gRPC's request-consuming thread; a producer thread waits for each chunk's
    layers, gathers and encodes it (:meth:`OutboundData.encode`) up to :data:`PREFETCH`
    chunks ahead. An error is recorded in ``ctl.error`` (a ``TypeError`` from encoding
    the producer's logprobs in ``ctl.type_error``) instead of raised, so the receiver
    sees a stream without a done chunk and fails the transfer.
    """
    ready: queue.Queue = queue.Queue(maxsize=PREFETCH)
    quit_ = threading.Event()
    producer = threading.Thread(target=_produce, args=(job, ctl, data, states, ready, quit_), daemon=True,
                                name=f"kv-send-{job.transfer_id}")
    producer.start()
    try:
        while (item := _take(ready, ctl, producer)) is not _END:
            message, is_kv = item
            yield message
            if is_kv:
                data.after_yield(job, ctl)
    except Exception as exc:  # the data plane failed to move a tensor: reported through ctl
        log.exception("KV transfer %s: error while sending chunks", job.transfer_id)
        ctl.error = f"{type(exc).__name__}: {exc}"
    finally:
        quit_.set()


def _take(ready: queue.Queue, ctl: StreamControl, producer: threading.Thread) -> object:
    """The producer's next item, or ``_END`` once the send stopped or the producer ended."""
    while True:
        try:
            return ready.get(timeout=0.05)
        except queue.Empty:
            if ctl.is_stopped() or not producer.is_alive() and ready.empty():
                return _END


def _put(ready: queue.Queue, item: object, ctl: StreamControl, quit_: threading.Event) -> bool:
    while not (quit_.is_set() or ctl.is_stopped()):
        try:
            ready.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(job: SendJob, ctl: StreamControl, data: OutboundData, states: TransferStateTable,
             ready: queue.Queue, quit_: threading.Event) -> None:
    """The producer thread of :func:`chunk_stream`: ``(message, is_kv)`` items, then ``_END``."""
    try:
        for i, spec in enumerate(job.plan):
            if job.progress is not None and not _wait_layers(job, ctl, states, spec.layer_end):
                return
            with ctl.lock:
                if ctl.stopped or quit_.is_set():
                    return
                message, nbytes = data.encode(job, i)
                ctl.bytes_sent += nbytes
                ctl.num_chunks += 1
                now = time.monotonic()
                ctl.first_chunk_at = ctl.first_chunk_at or now
                ctl.last_chunk_at = now
                if job.progress is not None and job.progress.finished_at is None:
                    ctl.bytes_before_finish += nbytes
                states.set(job.transfer_id, TransferState.TRANSFERRING)
            if not _put(ready, (message, True), ctl, quit_):
                return
        done = job.done if job.done is not None else _done_after_finish(job, ctl)
        if done is not None:
            _put(ready, (done, False), ctl, quit_)
    except KvTransferError as exc:  # the producer failed or was too slow
        ctl.error = exc.reason
    except Exception as exc:  # reported through ctl, see chunk_stream
        log.exception("KV transfer %s: error while producing chunks", job.transfer_id)
        ctl.error = f"{type(exc).__name__}: {exc}"
    finally:
        _put(ready, _END, ctl, quit_)


def _wait_layers(job: SendJob, ctl: StreamControl, states: TransferStateTable, layer_end: int) -> bool:
    assert job.progress is not None
    if job.progress.layers_ready < layer_end:
        with ctl.lock:
            if ctl.stopped:
                return False
            states.set(job.transfer_id, TransferState.WAITING_FOR_INPUT)
    job.progress.wait_layers(layer_end, job.remaining())  # KvTransferError -> ctl.error
    return True


def _done_after_finish(job: SendJob, ctl: StreamControl) -> KvFrame | None:
    assert job.progress is not None
    first_token_id, logprobs = job.progress.wait_finished(job.remaining())
    try:
        return encode_done_chunk(job.request_id, job.transfer_id, job.generation, len(job.plan),
                                 job.kv_cache.shape[0], first_token_id, logprobs)
    except TypeError as exc:
        ctl.type_error = exc
        ctl.error = f"first_token_logprobs is not msgpack-able: {exc}"
        return None

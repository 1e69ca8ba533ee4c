"""The ``"torch_dist"`` KV transport: gRPC control plane, torch.distributed data plane.

Control plane: the ``KvTransfer.PushKv`` stream of the ``"grpc"`` transport
(headers, ``"done"`` chunk, ack), so states, generations, stale checks, CRC32
and coverage are the same code. Data plane: each ``"kv"`` chunk is sent as a
header-only message marked ``"data": "dist"`` (:mod:`kvtransfer.wire`) and its
tensor goes point to point over a 2-rank pair group
(:mod:`kvtransfer.dist_pairs`): gloo for CPU caches, NCCL for CUDA caches.
The sender is rank 0 and hosts the group's TCPStore; the receiving servicer
joins as rank 1 on first contact, so a decode worker's KV gRPC endpoint
(:func:`add_kv_transfer_servicer`) serves both transports with no configuration.

Sending side::

    sender = DistKvSender(timeout_s=30.0)
    result = sender.send(request_id, transfer_id, destination, kv_cache, block_ids, None, progress=progress)

Failure handling: every wait (group formation, send, receive) is bounded by
the sender's ``timeout_s``; a failed transfer drops its pair group on both
sides and the next transfer builds a new one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtransfer.dist_pairs import SenderPair, SenderPairs, backend_for
from kvtransfer.grpc_receiver import add_kv_transfer_servicer
from kvtransfer.grpc_sender import DEFAULT_MAX_CHUNK_BYTES, GrpcKvSender
from kvtransfer.send_stream import DataPlane, SendJob, StreamControl
from kvtransfer.transport import register_transport
from kvtransfer.wire import encode_dist_kv_chunk
from pdcluster.v1 import kv_pb2

__all__ = ["DistKvSender"]


class _PairData:
    """Data plane of one transfer over one pair group: header out, then the tensor."""

    def __init__(self, pair: SenderPair) -> None:
        self._pair = pair
        self._pending: tuple[torch.Tensor, int] | None = None

    def encode(self, job: SendJob, i: int, tensor: torch.Tensor, corrupt: bool) -> tuple[kv_pb2.KvChunk, int]:
        tag = self._pair.next_tag()
        chunk = encode_dist_kv_chunk(job.meta(i), tensor, self._pair.header_fields(tag))
        if corrupt:  # after the checksum went into the header; the gathered tensor is our own copy
            flat = tensor.reshape(-1).view(torch.uint8)
            flat[flat.numel() // 2] ^= 0xFF
        self._pending = (tensor, tag)
        return chunk, tensor.numel() * tensor.element_size()

    def after_yield(self, job: SendJob, ctl: StreamControl) -> None:
        if self._pending is None:
            return
        tensor, tag = self._pending
        self._pending = None
        self._pair.send(tensor, tag, job.deadline, ctl.is_stopped)


class DistKvSender(GrpcKvSender):
    """:class:`KvSender` whose KV tensors travel over torch.distributed pair groups.

    Same contract, states, re-blocking and layer-wise streaming (``progress``)
    as :class:`GrpcKvSender`; a chunk's tensor follows its header over the
    pair group to the destination endpoint. At most ``max_pairs_per_endpoint``
    transfers to one endpoint run at once (one per pair group); more wait for
    a free group within their deadline.

    Args:
        timeout_s: deadline of one whole transfer (seconds); also the pair
            groups' timeout, so no wait outlives it by much.
        max_chunk_bytes: tensor bytes per chunk at most.
        corrupt_chunk_index: test hook; flip one tensor byte of this chunk
            (0-based) after its checksum was computed.
        chunk_delay_s: test hook; sleep this long before each chunk (seconds).
        max_pairs_per_endpoint: concurrent pair groups per receiver endpoint (>= 1).
        channel_options: extra gRPC channel options of the control plane.
        state_history: finished transfers kept for :meth:`poll`.

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        corrupt_chunk_index: int | None = None,
        chunk_delay_s: float = 0.0,
        max_pairs_per_endpoint: int = 4,
        channel_options: Sequence[tuple[str, Any]] = (),
        state_history: int = 4096,
    ) -> None:
        super().__init__(timeout_s=timeout_s, max_chunk_bytes=max_chunk_bytes, channel_options=channel_options,
                         state_history=state_history, corrupt_chunk_index=corrupt_chunk_index,
                         chunk_delay_s=chunk_delay_s)
        self._pairs = SenderPairs(max_pairs_per_endpoint)

    def close(self) -> None:
        """Close the control channels and drop idle pair groups; later sends raise :class:`KvTransferError`."""
        super().close()
        self._pairs.close()

    @contextlib.contextmanager
    def _data_plane(self, job: SendJob, endpoint: str) -> Iterator[DataPlane]:
        pair = self._pairs.acquire(endpoint, backend_for(job.kv_cache.device), self._timeout_s, job.deadline)
        ok = False
        try:
            yield _PairData(pair)
            ok = True
        finally:
            self._pairs.release(pair, endpoint, ok)


register_transport("torch_dist", sender_factory=DistKvSender, receiver_factory=add_kv_transfer_servicer)

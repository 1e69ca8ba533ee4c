"""The interfaces of a KV transport: what moves one request's KV, seen from each side.

The prefill worker holds a :class:`KvSender`; the decode worker implements a
:class:`KvReceiverSink` (its block pool and reservation table) and attaches it
to a transport's receiver, which exposes :class:`KvReceiver`. Both come from
the transport's factories in :mod:`kvtransfer.registry`, the only way in:
``"grpc"`` (:mod:`kvtransfer.grpc_transport`) and ``"torch_dist"``
(:mod:`kvtransfer.dist_transport`, torch.distributed pair groups as data plane
under the same gRPC control plane) are built in.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtransfer.progress import LayerProgress
from kvtransfer.states import TransferState


class KvDestinationLike(Protocol):
    """Where the KV of one transfer goes (``pdcluster.v1.worker_pb2.KvDestination`` fits).

    Attributes:
        worker_id: decode worker id.
        kv_endpoint: ``host:port`` of its KV receiver.
        block_ids: pre-allocated destination block ids, in token order.
        block_size: tokens per destination block.
        generation: reservation stamp every chunk must carry.
        dtype: destination cache dtype name (informational; the receiver casts).
    """

    worker_id: str
    kv_endpoint: str
    block_ids: Sequence[int]
    block_size: int
    generation: int
    dtype: str


@dataclass(frozen=True)
class SendResult:
    """Outcome of a successful :meth:`KvSender.send`.

    Times are ``time.monotonic()`` seconds (``None`` where not recorded), to
    compare with :attr:`LayerProgress.ready_times` / ``finished_at``.

    Attributes:
        bytes_sent: KV payload bytes sent (headers excluded).
        seconds: wall time of the whole send, gather and encode included
            (with a ``progress``: waiting for layers included).
        num_chunks: ``"kv"`` chunks sent (the ``"done"`` chunk not counted).
        bytes_acknowledged: payload bytes the receiver reported (== ``bytes_sent``).
        started_at: the send began (after local argument checks).
        first_chunk_at: the first ``"kv"`` chunk was gathered and handed to the transport.
        last_chunk_at: the last ``"kv"`` chunk was handed to the transport.
        acked_at: the receiver's acknowledgement arrived.
        input_finished_at: the producer's ``progress.finish`` (``None``
            without a progress: the input was complete before the send).
        bytes_before_finish: payload bytes of the chunks handed to the
            transport before ``progress.finish`` (0 without a progress).
    """

    bytes_sent: int
    seconds: float
    num_chunks: int
    bytes_acknowledged: int
    started_at: float | None = None
    first_chunk_at: float | None = None
    last_chunk_at: float | None = None
    acked_at: float | None = None
    input_finished_at: float | None = None
    bytes_before_finish: int = 0

    @property
    def hidden_fraction(self) -> float:
        """Share of the payload handed to the transport before the producer finished (0..1).

        The part of the transfer overlapped with (hidden behind) compute; 0
        without a progress or without payload.
        """
        return self.bytes_before_finish / self.bytes_sent if self.bytes_sent else 0.0

    @property
    def seconds_after_finish(self) -> float | None:
        """Seconds from ``progress.finish`` to the acknowledgement: the transfer time left exposed."""
        if self.input_finished_at is None or self.acked_at is None:
            return None
        return max(0.0, self.acked_at - self.input_finished_at)


class KvSender(abc.ABC):
    """Pushes one request's KV blocks to a decode worker. Thread-safe."""

    @abc.abstractmethod
    def send(self, request_id: str, transfer_id: str, dest: KvDestinationLike, kv_cache: torch.Tensor,
             src_block_ids: Sequence[int], first_token_id: int | None,
             first_token_logprobs: dict[Any, Any] | None = None, layers_per_chunk: int = 1, *,
             progress: LayerProgress | None = None) -> SendResult:
        """Send the tokens of blocks ``src_block_ids`` of every layer to ``dest`` and wait for the ack.

        Blocking; run on the prefill worker's sender thread. The blocks must
        not be freed or overwritten until it returns.

        The destination may use another block size: the receiver re-blocks
        (:mod:`kvtransfer.reblock`); source and destination must be able to
        hold the same token count (each side's last block partly filled).

        Layer-wise streaming: with ``progress`` the send may start before the
        KV is computed; each chunk leaves once ``progress`` reports its layers
        (state ``WAITING_FOR_INPUT`` meanwhile) and the ``"done"`` chunk once
        ``progress.finish`` gave the first token. ``progress.fail`` ends the
        send with :class:`KvTransferError`; the receiver then sees an
        incomplete stream and frees its reservation.

        Args:
            request_id: request the KV belongs to.
            transfer_id: id minted by the router for this transfer.
            dest: destination: its blocks (``dest.block_size`` tokens each) in token order.
            kv_cache: ``[L, 2, num_blocks, block_size, H, D]`` local cache, float dtype.
            src_block_ids: local block ids in token order (need not be contiguous).
            first_token_id: token sampled from the prompt's last position;
                ignored (pass ``None``) with ``progress``.
            first_token_logprobs: msgpack-able logprob data or ``None``;
                ignored with ``progress``.
            layers_per_chunk: at most this many layers per chunk (>= 1).
            progress: the producer's :class:`LayerProgress`, or ``None`` when
                the KV and first token are complete already.

        Returns:
            :class:`SendResult`.

        Raises:
            KvTransferError: unreachable destination, timeout (the whole send,
                waiting for layers included, is bounded by the sender's
                timeout), receiver rejection (corrupt, stale, incomplete),
                mismatching ack, ``progress.fail``, or a destination that
                cannot hold the source's tokens. ``poll(transfer_id)`` is then
                ``FAILED``.
            ValueError: malformed local arguments (cache layout, block ids,
                ``layers_per_chunk``, a ``progress`` with another layer count,
                ``first_token_id`` None without ``progress``) or
                ``transfer_id`` already in flight.
            TypeError: the logprobs are not msgpack-able: raised before
                anything is sent for ``first_token_logprobs``; with
                ``progress``, raised after the stream was cut short (the
                receiver fails the transfer; ``poll`` is ``FAILED``) when
                ``progress.finish`` supplied them.
        """

    @abc.abstractmethod
    def poll(self, transfer_id: str) -> TransferState:
        """Non-blocking state of a transfer this sender started.

        Raises:
            KeyError: unknown (or long finished and evicted) ``transfer_id``.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; in-flight sends fail with :class:`KvTransferError`."""


class KvReceiverSink(abc.ABC):
    """The decode worker's side of a transfer: reservation checks and cache writes.

    Implementations must be thread-safe: the transport calls them from its
    server threads, concurrently for different transfers. ``write`` must do
    its reservation check and its cache write under one lock shared with the
    code that reclaims reservations, so a reclaimed transfer can never write
    into blocks already handed to another request.
    """

    @abc.abstractmethod
    def begin(self, transfer_id: str, generation: int, request_id: str) -> bool:
        """First chunk of a transfer arrived: is it still reserved with this generation (for this request)?

        Returns:
            ``False`` for an unknown, reclaimed or other-generation transfer (or one
            reserved for another request); its chunks are then dropped.
        """

    @abc.abstractmethod
    def write(
        self,
        transfer_id: str,
        generation: int,
        layer_start: int,
        layer_end: int,
        block_ids: Sequence[int],
        tensor: torch.Tensor,
        *,
        token_start: int,
    ) -> None:
        """Write verified KV tokens into reserved blocks.

        Args:
            block_ids: the reserved blocks the chunk's tokens map to: exactly
                ``reservation[token_start // dst_bs : ceil(min(token_end,
                capacity) / dst_bs)]`` for the sink's block size ``dst_bs``.
            tensor: ``[layer_end - layer_start, 2, n, src_block_size, H, D]``
                sender blocks in the sender's dtype (cast on write), on CPU
                (or on the receiving GPU for a torch_dist NCCL pair). Read-only:
                for ``"grpc"`` it is a view of the received message (copy it to
                keep or change it).
            token_start: position in the transfer of ``tensor``'s first token;
                token ``t`` goes to block ``reservation[t // dst_bs]``, slot
                ``t % dst_bs``; tokens past the reservation's capacity are
                dropped (see :func:`kvtransfer.reblock.scatter_tokens`).

        Raises:
            StaleTransferError: reclaimed transfer, other generation, or
                ``block_ids`` not exactly the reserved blocks the token range
                maps to; nothing was written.
        """

    @abc.abstractmethod
    def complete(
        self,
        transfer_id: str,
        generation: int,
        first_token_id: int,
        first_token_logprobs: dict[Any, Any] | None,
    ) -> None:
        """Every chunk arrived, verified and was written; the request may run.

        The transport guarantees that layers ``[0, num_layers)`` were each
        written exactly once for one and the same token range ``[0, T)``.

        Raises:
            StaleTransferError: the transfer was reclaimed meanwhile.
        """

    @abc.abstractmethod
    def fail(self, transfer_id: str, generation: int, reason: str) -> None:
        """The transfer failed (corrupt, incomplete, sender gone).

        Must be a no-op for unknown or other-generation transfers. Must not raise.
        """


class KvReceiver(abc.ABC):
    """A transport's receiving endpoint, bound to one :class:`KvReceiverSink`."""

    @abc.abstractmethod
    def poll(self, transfer_id: str) -> TransferState:
        """Non-blocking state of a transfer this receiver accepted.

        Raises:
            KeyError: no accepted stream for ``transfer_id`` (yet, or evicted).
        """

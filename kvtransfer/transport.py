"""Transport interface for moving one request's KV, and a registry of transports.

The prefill worker holds a :class:`KvSender`; the decode worker implements a
:class:`KvReceiverSink` (its block pool and reservation table) and attaches it
to a transport's receiver, which exposes :class:`KvReceiver`. gRPC is the
first transport (``"grpc"``, :mod:`kvtransfer.grpc_transport`); a
torch.distributed one can be registered later under its own name.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

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

    Attributes:
        bytes_sent: KV payload bytes sent (headers excluded).
        seconds: wall time of the whole send, gather and encode included.
        num_chunks: ``"kv"`` chunks sent (the ``"done"`` chunk not counted).
        bytes_acknowledged: payload bytes the receiver reported (== ``bytes_sent``).
    """

    bytes_sent: int
    seconds: float
    num_chunks: int
    bytes_acknowledged: int


class KvSender(abc.ABC):
    """Pushes one request's KV blocks to a decode worker. Thread-safe."""

    @abc.abstractmethod
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
        """Send whole blocks ``src_block_ids`` of every layer to ``dest`` and wait for the ack.

        Blocking; run on the prefill worker's sender thread. The blocks must
        not be freed or overwritten until it returns.

        Args:
            request_id: request the KV belongs to.
            transfer_id: id minted by the router for this transfer.
            dest: destination; ``len(dest.block_ids) == len(src_block_ids)``.
            kv_cache: ``[L, 2, num_blocks, block_size, H, D]`` local cache, float dtype.
            src_block_ids: local block ids in token order (need not be contiguous).
            first_token_id: token sampled from the prompt's last position.
            first_token_logprobs: msgpack-able logprob data or ``None``.
            layers_per_chunk: at most this many layers per chunk (>= 1).

        Returns:
            :class:`SendResult`.

        Raises:
            KvTransferError: unreachable destination, timeout, receiver
                rejection (corrupt, stale, incomplete), mismatching ack, or a
                destination this sender cannot serve (other block size or
                block count). ``poll(transfer_id)`` is then ``FAILED``.
            ValueError: malformed local arguments (cache layout, block ids,
                ``layers_per_chunk``) or ``transfer_id`` already in flight.
            TypeError: ``first_token_logprobs`` is not msgpack-able.
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
        """First chunk of a transfer arrived: is it still reserved with this generation?

        Returns:
            ``False`` for an unknown, reclaimed or other-generation transfer;
            its chunks are then dropped.
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
    ) -> None:
        """Write verified KV into reserved blocks.

        Args:
            block_ids: destination block ids (a subset of the reservation's),
                one per ``tensor`` dim 2.
            tensor: ``[layer_end - layer_start, 2, len(block_ids), block_size,
                H, D]`` CPU tensor in the sender's dtype (cast on write).

        Raises:
            StaleTransferError: reclaimed transfer, other generation, or block
                ids not reserved for it; nothing was written.
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
        written exactly once for one and the same set of blocks (a sink that
        wants to can compare that set with its reservation in ``write``).

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


class Transport(NamedTuple):
    """Factories of one registered transport (keyword arguments are transport-specific)."""

    name: str
    sender_factory: Callable[..., KvSender]
    receiver_factory: Callable[..., KvReceiver]


_REGISTRY: dict[str, Transport] = {}
_REGISTRY_LOCK = threading.Lock()


def register_transport(
    name: str,
    sender_factory: Callable[..., KvSender],
    receiver_factory: Callable[..., KvReceiver],
) -> None:
    """Register a transport under ``name``.

    Raises:
        ValueError: ``name`` is empty or already registered.
    """
    if not name:
        raise ValueError("transport name must not be empty")
    with _REGISTRY_LOCK:
        if name in _REGISTRY:
            raise ValueError(f"KV transport {name!r} is already registered")
        _REGISTRY[name] = Transport(name, sender_factory, receiver_factory)


def get_transport(name: str) -> Transport:
    """Factories registered under ``name``.

    Raises:
        KeyError: no such transport (the message lists the registered ones).
    """
    with _REGISTRY_LOCK:
        try:
            return _REGISTRY[name]
        except KeyError:
            raise KeyError(f"unknown KV transport {name!r}; registered: {sorted(_REGISTRY)}") from None

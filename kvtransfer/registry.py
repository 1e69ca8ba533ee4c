"""The KV transport registry: the only way a worker gets a sender or attaches a receiver.

Lifecycle:

1. A transport registers a sender factory and a receiver factory under its name
   (:func:`register_transport`) when its module is imported: the built-in ``"grpc"``
   (:mod:`kvtransfer.grpc_transport`) and ``"torch_dist"`` (:mod:`kvtransfer.dist_transport`)
   at the registry's first lookup (:data:`BUILTIN_MODULES`); any other from the module that
   :attr:`~kvtransfer.config.KvTransferConfig.transport_module` names.
2. A worker calls :func:`create_sender` (prefill, colocated) and :func:`attach_receiver`
   (decode, colocated) with the cluster's :class:`~kvtransfer.config.KvTransferConfig`;
   both go through :func:`load_transport`, which imports ``transport_module`` first.
3. The factories get the same small arguments for every transport (:class:`SenderFactory`,
   :class:`ReceiverFactory`), ``options`` being ``cfg.transport_options`` and a sender's
   ``connect`` the worker's :class:`ChannelFactory` (how a gRPC channel to a receiver is
   opened: credentials, call metadata; kvtransfer only calls it); a wrapper
   transport (e.g. a fault-injecting one in the tests) looks the transport it wraps up with
   :func:`get_transport` and calls its factories.

Example::

    sender = create_sender(cfg.kv, connect)                          # prefill worker
    WorkerHost(..., add_kv_servicers=lambda server: attach_receiver(cfg.kv, server, sink))  # decode
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvtransfer.config import KvTransferConfig
from kvtransfer.transport import KvReceiver, KvReceiverSink, KvSender


class ChannelFactory(Protocol):
    """Opens the gRPC channel a sender reaches a receiver's ``target`` (``host:port``) through.

    The worker chooses it (:func:`serving.security.internal_channel`: the cluster secret on
    every call); kvtransfer only calls it with the channel ``options`` it needs.
    """

    def __call__(self, target: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel: ...


def plaintext_channel(target: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """The :class:`ChannelFactory` of a process without credentials: a plaintext channel, no metadata."""
    return grpc.insecure_channel(target, options=list(options))


class SenderFactory(Protocol):
    """Builds a transport's sender.

    Args:
        timeout_s: deadline of one whole transfer (seconds).
        max_chunk_bytes: payload bytes per chunk at most.
        options: the transport's ``KEY -> VALUE`` options (``KvTransferConfig.transport_options``).
        connect: how to open a gRPC channel to a receiver (a transport without gRPC ignores it).

    Raises:
        ValueError: an option the transport does not take, or a value out of range.
    """

    def __call__(self, *, timeout_s: float, max_chunk_bytes: int, options: Mapping[str, str],
                 connect: ChannelFactory) -> KvSender: ...


class ReceiverFactory(Protocol):
    """Attaches a transport's receiver for ``sink`` to ``server``, before the server starts.

    Args:
        server: the gRPC server the worker gives its KV receiver (a port and thread
            pool of its own, :class:`serving.worker_host.WorkerHost`); the factory
            registers its control-plane servicer(s) there.
        sink: the decode worker's reservations and cache writes.
        options: as for :class:`SenderFactory`.

    Returns:
        The receiver, whose ``poll`` shows receiver-side transfer states.

    Raises:
        ValueError: as for :class:`SenderFactory`.
    """

    def __call__(self, server: grpc.Server, sink: KvReceiverSink, *, options: Mapping[str, str]) -> KvReceiver: ...


@dataclass(frozen=True)
class Transport:
    """Factories of one registered transport."""

    name: str
    sender_factory: SenderFactory
    receiver_factory: ReceiverFactory


_REGISTRY: dict[str, Transport] = {}
_REGISTRY_LOCK = threading.Lock()
# the built-in transports' modules, imported (so registered) at the first lookup: a process
# that only reads the KV configuration never loads them (nor torch)
BUILTIN_MODULES = ("kvtransfer.grpc_transport", "kvtransfer.dist_transport")


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)  # once per process: later calls find it in sys.modules


def register_transport(name: str, sender_factory: SenderFactory, receiver_factory: ReceiverFactory) -> None:
    """Register a transport under ``name`` (at import of the module that defines it).

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
    """Factories registered under ``name`` (no module but the built-ins' is imported; see
    :func:`load_transport`).

    Raises:
        KeyError: no such transport (the message lists the registered ones).
    """
    _load_builtins()
    with _REGISTRY_LOCK:
        try:
            return _REGISTRY[name]
        except KeyError:
            raise KeyError(f"unknown KV transport {name!r}; registered: {sorted(_REGISTRY)}") from None


def load_transport(cfg: KvTransferConfig) -> Transport:
    """Import ``cfg.transport_module`` (when set; once per process), then look ``cfg.transport`` up.

    Raises:
        ImportError: ``cfg.transport_module`` cannot be imported.
        KeyError: ``cfg.transport`` is not registered, even after the import.
    """
    if cfg.transport_module is not None:
        importlib.import_module(cfg.transport_module)
    return get_transport(cfg.transport)


def create_sender(cfg: KvTransferConfig, connect: ChannelFactory = plaintext_channel) -> KvSender:
    """A new sender of the transport ``cfg`` names, with its timeout, chunk size and options,
    opening its channels to receivers with ``connect``.

    Raises:
        ImportError / KeyError: as :func:`load_transport`.
        ValueError: the transport refuses ``cfg.transport_options``.
    """
    factory = load_transport(cfg).sender_factory
    return factory(timeout_s=cfg.timeout_s, max_chunk_bytes=cfg.max_chunk_bytes, options=cfg.transport_options,
                   connect=connect)


def attach_receiver(cfg: KvTransferConfig, server: grpc.Server, sink: KvReceiverSink) -> KvReceiver:
    """Attach the receiver of the transport ``cfg`` names for ``sink`` to ``server`` (before it starts).

    Raises:
        ImportError / KeyError: as :func:`load_transport`.
        ValueError: the transport refuses ``cfg.transport_options``.
    """
    return load_transport(cfg).receiver_factory(server, sink, options=cfg.transport_options)


def check_options(transport: str, options: Mapping[str, str], accepted: tuple[str, ...] = ()) -> None:
    """For factories: refuse options other than ``accepted``.

    Raises:
        ValueError: a key not in ``accepted`` (the message names the transport and the keys it takes).
    """
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"KV transport {transport!r} takes no option {unknown}; it takes {list(accepted)}")

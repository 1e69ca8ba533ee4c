"""The ``"grpc"`` KV transport: tensors inside the ``KvTransfer.PushKv`` messages.

Registered (:mod:`kvtransfer.registry`) when :mod:`kvtransfer` is imported:

* sender: a :class:`~kvtransfer.grpc_sender.GrpcKvSender` with the inline data plane;
* receiver: a :class:`~kvtransfer.grpc_receiver.KvTransferServicer` on the server the
  worker gives it, with the inline data plane (it refuses chunks whose tensor travels
  elsewhere).

It takes no ``transport_options``. Workers reach it through the registry only::

    sender = create_sender(KvTransferConfig(transport="grpc"))
    receiver = attach_receiver(KvTransferConfig(transport="grpc"), server, sink)
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from kvtransfer.config import DEFAULT_MAX_CHUNK_BYTES
from kvtransfer.grpc_receiver import KvTransferServicer, add_kv_transfer_servicer
from kvtransfer.grpc_sender import GrpcKvSender
from kvtransfer.registry import ChannelFactory, check_options, register_transport
from kvtransfer.transport import KvReceiverSink

NAME = "grpc"
_HEADER_ROOM_BYTES = 64 * 1024


def kv_server_options(max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> list[tuple[str, int]]:
    """gRPC server options for a server hosting the KV servicer.

    Args:
        max_chunk_bytes: the senders' ``max_chunk_bytes`` (payload bytes per chunk).

    Returns:
        Options raising the receive limit to ``max_chunk_bytes`` plus 64 KiB of
        header room, never below gRPC's default 4 MiB.
    """
    return [("grpc.max_receive_message_length", max(4 * 1024 * 1024, max_chunk_bytes + _HEADER_ROOM_BYTES)),
            ("grpc.http2.lookahead_bytes", 2 * max_chunk_bytes)]


def _sender(*, timeout_s: float, max_chunk_bytes: int, options: Mapping[str, str],
            connect: ChannelFactory) -> GrpcKvSender:
    check_options(NAME, options)
    return GrpcKvSender(timeout_s=timeout_s, max_chunk_bytes=max_chunk_bytes, connect=connect)


def _receiver(server: grpc.Server, sink: KvReceiverSink, *, options: Mapping[str, str]) -> KvTransferServicer:
    check_options(NAME, options)
    return add_kv_transfer_servicer(server, sink)


register_transport(NAME, sender_factory=_sender, receiver_factory=_receiver)

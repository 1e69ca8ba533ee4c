"""The ``"grpc"`` KV transport: sender, receiver servicer, server options and registration.

Receiving side (decode worker)::

    server = grpc.server(ThreadPoolExecutor(8), options=kv_server_options())
    receiver = add_kv_transfer_servicer(server, sink)

Sending side (prefill worker)::

    sender = GrpcKvSender(timeout_s=30.0)
    result = sender.send(request_id, transfer_id, destination, kv_cache, block_ids, first_token_id)
"""

from __future__ import annotations

from kvtransfer.grpc_receiver import KvTransferServicer, add_kv_transfer_servicer
from kvtransfer.grpc_sender import DEFAULT_MAX_CHUNK_BYTES, GrpcKvSender
from kvtransfer.transport import register_transport

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "GrpcKvSender",
    "KvTransferServicer",
    "add_kv_transfer_servicer",
    "kv_server_options",
]

_HEADER_ROOM_BYTES = 64 * 1024


def kv_server_options(max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> list[tuple[str, int]]:
    """gRPC server options for a server hosting the KV servicer.

    Args:
        max_chunk_bytes: the senders' ``max_chunk_bytes`` (payload bytes per chunk).

    Returns:
        Options raising the receive limit to ``max_chunk_bytes`` plus 64 KiB of
        header room, never below gRPC's default 4 MiB.
    """
    return [("grpc.max_receive_message_length", max(4 * 1024 * 1024, max_chunk_bytes + _HEADER_ROOM_BYTES))]


register_transport("grpc", sender_factory=GrpcKvSender, receiver_factory=add_kv_transfer_servicer)

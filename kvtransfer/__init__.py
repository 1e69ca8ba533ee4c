"""KV cache transfer between prefill and decode workers.

Layout of a worker's cache: one tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (K = 0, V = 1).
A transfer moves whole blocks of one request, all layers, in chunks
(:mod:`kvtransfer.wire`) through a registered transport
(:mod:`kvtransfer.transport`; ``"grpc"`` is built in).
"""

from kvtransfer.blocks import check_kv_cache, gather_blocks, scatter_blocks
from kvtransfer.errors import KvIntegrityError, KvTransferError, StaleTransferError
from kvtransfer.grpc_transport import (
    DEFAULT_MAX_CHUNK_BYTES,
    GrpcKvSender,
    KvTransferServicer,
    add_kv_transfer_servicer,
    kv_server_options,
)
from kvtransfer.states import TransferState, TransferStateTable
from kvtransfer.transport import (
    KvDestinationLike,
    KvReceiver,
    KvReceiverSink,
    KvSender,
    SendResult,
    Transport,
    get_transport,
    register_transport,
)
from kvtransfer.wire import KvChunkMeta, decode_chunk, encode_done_chunk, encode_kv_chunk

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "GrpcKvSender",
    "KvChunkMeta",
    "KvDestinationLike",
    "KvIntegrityError",
    "KvReceiver",
    "KvReceiverSink",
    "KvSender",
    "KvTransferError",
    "KvTransferServicer",
    "SendResult",
    "StaleTransferError",
    "TransferState",
    "TransferStateTable",
    "Transport",
    "add_kv_transfer_servicer",
    "check_kv_cache",
    "decode_chunk",
    "encode_done_chunk",
    "encode_kv_chunk",
    "gather_blocks",
    "get_transport",
    "kv_server_options",
    "register_transport",
    "scatter_blocks",
]

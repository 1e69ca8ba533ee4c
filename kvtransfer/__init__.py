"""KV cache transfer between prefill and decode workers.

Layout of a worker's cache: one tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (K = 0, V = 1).
A transfer moves the tokens of one request, all layers, in chunks of the
sender's blocks (:mod:`kvtransfer.wire`); the receiver re-blocks when its block
size differs (:mod:`kvtransfer.reblock`). Senders can stream layer by layer
while the KV is computed (:class:`LayerProgress`). Transports are registered
by name (:mod:`kvtransfer.transport`): ``"grpc"`` and ``"torch_dist"``.
"""

from kvtransfer.blocks import check_kv_cache, gather_blocks, scatter_blocks
from kvtransfer.dist_transport import DistKvSender
from kvtransfer.errors import KvIntegrityError, KvTransferError, StaleTransferError
from kvtransfer.grpc_transport import (
    DEFAULT_MAX_CHUNK_BYTES,
    GrpcKvSender,
    KvTransferServicer,
    add_kv_transfer_servicer,
    kv_server_options,
)
from kvtransfer.progress import LayerProgress
from kvtransfer.reblock import check_same_tokens, dest_block_range, scatter_tokens
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
from kvtransfer.wire import (
    KvChunkMeta,
    decode_chunk,
    encode_done_chunk,
    encode_kv_chunk,
)

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "DistKvSender",
    "GrpcKvSender",
    "KvChunkMeta",
    "KvDestinationLike",
    "KvIntegrityError",
    "KvReceiver",
    "KvReceiverSink",
    "KvSender",
    "KvTransferError",
    "KvTransferServicer",
    "LayerProgress",
    "SendResult",
    "StaleTransferError",
    "TransferState",
    "TransferStateTable",
    "Transport",
    "add_kv_transfer_servicer",
    "check_kv_cache",
    "check_same_tokens",
    "decode_chunk",
    "dest_block_range",
    "encode_done_chunk",
    "encode_kv_chunk",
    "gather_blocks",
    "get_transport",
    "kv_server_options",
    "register_transport",
    "scatter_blocks",
    "scatter_tokens",
]

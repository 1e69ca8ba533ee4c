"""KV cache transfer between prefill and decode workers.

Layout of a worker's cache: one tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (K = 0, V = 1).
A transfer moves the tokens of one request, all layers, in chunks of the
sender's blocks (:mod:`kvtransfer.wire`, wire version 2: CRC32C from
:mod:`kvtransfer.checksum`; on gRPC as hand-framed messages, :mod:`kvtransfer.frames`);
the receiver re-blocks when its block size differs (:mod:`kvtransfer.reblock`).
Senders can stream layer by layer while the KV is computed (:class:`LayerProgress`).
Processes that move KV over gRPC keep freed message buffers mapped (:mod:`kvtransfer.memory`).

Transports are registered by name and reached only through :mod:`kvtransfer.registry`
(:func:`create_sender`, :func:`attach_receiver`): importing this package registers
``"grpc"`` (:mod:`kvtransfer.grpc_transport`) and ``"torch_dist"``
(:mod:`kvtransfer.dist_transport`); others register from the module
:attr:`KvTransferConfig.transport_module` names.
"""

from kvtransfer import dist_transport, grpc_transport  # noqa: F401 - importing them registers the built-ins
from kvtransfer.blocks import HeadShards, check_kv_cache, gather_blocks, scatter_blocks
from kvtransfer.config import DEFAULT_MAX_CHUNK_BYTES, KvConfigError, KvTransferConfig
from kvtransfer.errors import KvDataPlaneError, KvIntegrityError, KvTransferError, StaleTransferError
from kvtransfer.grpc_receiver import KvTransferServicer
from kvtransfer.grpc_sender import GrpcKvSender
from kvtransfer.grpc_transport import kv_server_options
from kvtransfer.progress import LayerProgress
from kvtransfer.reblock import check_same_tokens, dest_block_range, scatter_tokens
from kvtransfer.registry import (
    Transport,
    attach_receiver,
    create_sender,
    get_transport,
    load_transport,
    register_transport,
)
from kvtransfer.states import TransferState, TransferStateTable
from kvtransfer.transport import (
    KvDestinationLike,
    KvReceiver,
    KvReceiverSink,
    KvSender,
    SendResult,
)
from kvtransfer.wire import (
    KvChunkMeta,
    decode_chunk,
    encode_done_chunk,
    encode_kv_chunk,
)

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "GrpcKvSender",
    "KvChunkMeta",
    "KvConfigError",
    "KvDataPlaneError",
    "KvDestinationLike",
    "KvIntegrityError",
    "KvReceiver",
    "KvReceiverSink",
    "KvSender",
    "KvTransferConfig",
    "KvTransferError",
    "KvTransferServicer",
    "LayerProgress",
    "SendResult",
    "StaleTransferError",
    "TransferState",
    "TransferStateTable",
    "Transport",
    "attach_receiver",
    "HeadShards",
    "check_kv_cache",
    "check_same_tokens",
    "create_sender",
    "decode_chunk",
    "dest_block_range",
    "encode_done_chunk",
    "encode_kv_chunk",
    "gather_blocks",
    "get_transport",
    "kv_server_options",
    "load_transport",
    "register_transport",
    "scatter_blocks",
    "scatter_tokens",
]

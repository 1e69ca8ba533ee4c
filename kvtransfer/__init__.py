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
(:func:`create_sender`, :func:`attach_receiver`): the registry loads the built-in ``"grpc"``
(:mod:`kvtransfer.grpc_transport`) and ``"torch_dist"`` (:mod:`kvtransfer.dist_transport`)
at its first lookup; others register from the module :attr:`KvTransferConfig.transport_module`
names.

The names below are loaded on first use (PEP 562), so a process that needs only the
configuration (:mod:`kvtransfer.config`: the router, the controller, the CLI) loads no torch.
"""

from __future__ import annotations

import importlib

# name -> the module defining it
_EXPORTS = {
    "attach_receiver": "kvtransfer.registry",
    "check_kv_cache": "kvtransfer.blocks",
    "check_same_tokens": "kvtransfer.reblock",
    "create_sender": "kvtransfer.registry",
    "decode_chunk": "kvtransfer.wire",
    "DEFAULT_MAX_CHUNK_BYTES": "kvtransfer.config",
    "dest_block_range": "kvtransfer.reblock",
    "encode_done_chunk": "kvtransfer.wire",
    "encode_kv_chunk": "kvtransfer.wire",
    "gather_blocks": "kvtransfer.blocks",
    "get_transport": "kvtransfer.registry",
    "GrpcKvSender": "kvtransfer.grpc_sender",
    "HeadShards": "kvtransfer.blocks",
    "kv_server_options": "kvtransfer.grpc_transport",
    "KvChunkMeta": "kvtransfer.wire",
    "KvConfigError": "kvtransfer.config",
    "KvDataPlaneError": "kvtransfer.errors",
    "KvDestinationLike": "kvtransfer.transport",
    "KvIntegrityError": "kvtransfer.errors",
    "KvReceiver": "kvtransfer.transport",
    "KvReceiverSink": "kvtransfer.transport",
    "KvSender": "kvtransfer.transport",
    "KvTransferConfig": "kvtransfer.config",
    "KvTransferError": "kvtransfer.errors",
    "KvTransferServicer": "kvtransfer.grpc_receiver",
    "LayerProgress": "kvtransfer.progress",
    "load_transport": "kvtransfer.registry",
    "register_transport": "kvtransfer.registry",
    "scatter_blocks": "kvtransfer.blocks",
    "scatter_tokens": "kvtransfer.reblock",
    "SendResult": "kvtransfer.transport",
    "StaleTransferError": "kvtransfer.errors",
    "TransferState": "kvtransfer.states",
    "TransferStateTable": "kvtransfer.states",
    "Transport": "kvtransfer.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Load ``name`` from its module at first use (PEP 562).

    Raises:
        AttributeError: ``name`` is not one of the package's names.
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

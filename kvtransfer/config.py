"""Configuration of a worker's KV transfer: which registered transport, and how it sends.

One :class:`KvTransferConfig` serves every worker of a cluster (``pdcluster up`` builds it in
:func:`deploy.spec.spec_from_args`): prefill and colocated workers get their sender from it,
decode and colocated workers their receiver (:mod:`kvtransfer.registry`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024
"""Payload bytes per chunk by default: fits gRPC's default 4 MiB receive limit with header room."""

_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class KvConfigError(ValueError):
    """A KV transfer setting is out of its allowed range."""


@dataclass(frozen=True)
class KvTransferConfig:
    """How workers move KV blocks from prefill to decode workers.

    Attributes:
        transport: registered transport name: ``"grpc"``, ``"torch_dist"``, or one
            that ``transport_module`` registers; see :func:`kvtransfer.registry.load_transport`.
        transport_module: dotted name of a Python module every worker imports before
            it looks ``transport`` up, so a transport outside this package registers
            itself (like vLLM's ``kv_connector_module_path``); ``None``: built-ins only.
        transport_options: ``KEY -> VALUE`` strings passed to the transport's factories;
            each transport documents and checks its own keys (the built-in ``"grpc"``
            takes none, ``"torch_dist"`` takes ``max_pairs_per_endpoint``).
        layers_per_chunk: at most this many layers per chunk (>= 1); with
            ``layerwise`` a chunk leaves as soon as its layers are computed.
        layerwise: stream the KV of a request's final prefill step layer by layer
            while the next layers compute (False: send after the step). ``pdcluster
            up`` sets it for GPU workers and clears it for CPU ones, where the sender
            competes with the prefill for the same cores (bench/results/layerwise.md).
        timeout_s: deadline of one whole transfer on the sender (seconds).
        max_chunk_bytes: payload bytes per chunk at most.

    Raises:
        KvConfigError: a value out of range, a malformed module name, or an option
            whose key or value is not a string (or an empty key).
    """

    transport: str = "grpc"
    transport_module: str | None = None
    transport_options: dict[str, str] = field(default_factory=dict)
    layers_per_chunk: int = 2
    layerwise: bool = True
    timeout_s: float = 30.0
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES

    def __post_init__(self) -> None:
        if not self.transport:
            raise KvConfigError("transport must be a registered KV transport name")
        if self.transport_module is not None and not _MODULE_NAME.fullmatch(self.transport_module):
            raise KvConfigError(f"transport_module must be a dotted module name, got {self.transport_module!r}")
        options = dict(self.transport_options)
        for key, value in options.items():
            if not (isinstance(key, str) and key and isinstance(value, str)):
                raise KvConfigError(f"transport_options must map non-empty strings to strings, got {key!r}: {value!r}")
        object.__setattr__(self, "transport_options", options)  # a copy the caller cannot change
        if self.layers_per_chunk < 1:
            raise KvConfigError(f"layers_per_chunk must be >= 1, got {self.layers_per_chunk}")
        if self.timeout_s <= 0:
            raise KvConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_chunk_bytes < 1:
            raise KvConfigError(f"max_chunk_bytes must be >= 1, got {self.max_chunk_bytes}")

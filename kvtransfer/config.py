"""Configuration of a prefill worker's KV sending side."""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.grpc_sender import DEFAULT_MAX_CHUNK_BYTES


class KvConfigError(ValueError):
    """A KV transfer setting is out of its allowed range."""


@dataclass(frozen=True)
class KvTransferConfig:
    """How a prefill worker ships KV blocks to decode workers.

    Attributes:
        transport: registered transport name (``"grpc"``, ``"torch_dist"``); see
            :func:`kvtransfer.transport.get_transport`.
        layers_per_chunk: at most this many layers per chunk (>= 1); with
            ``layerwise`` a chunk leaves as soon as its layers are computed.
        layerwise: stream the KV of a request's final prefill step layer by layer
            while the next layers compute (False: send after the step). ``pdcluster
            up`` sets it for GPU workers and clears it for CPU ones, where the sender
            competes with the prefill for the same cores (bench/results/layerwise.md).
        timeout_s: deadline of one whole transfer on the sender (seconds).
        max_chunk_bytes: payload bytes per chunk at most.
        test_corrupt_chunk_index: test hook: flip one payload byte of this chunk
            (0-based) after its checksum was computed. ``None`` in production.
        test_chunk_delay_s: test hook: sleep this long before each chunk
            (seconds), to hold a transfer open. 0 in production.

    Raises:
        KvConfigError: a value out of range.
    """

    transport: str = "grpc"
    layers_per_chunk: int = 2
    layerwise: bool = True
    timeout_s: float = 30.0
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    test_corrupt_chunk_index: int | None = None
    test_chunk_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.transport:
            raise KvConfigError("transport must be a registered KV transport name")
        if self.layers_per_chunk < 1:
            raise KvConfigError(f"layers_per_chunk must be >= 1, got {self.layers_per_chunk}")
        if self.timeout_s <= 0:
            raise KvConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_chunk_bytes < 1:
            raise KvConfigError(f"max_chunk_bytes must be >= 1, got {self.max_chunk_bytes}")
        if self.test_corrupt_chunk_index is not None and self.test_corrupt_chunk_index < 0:
            raise KvConfigError(f"test_corrupt_chunk_index must be >= 0, got {self.test_corrupt_chunk_index}")
        if self.test_chunk_delay_s < 0:
            raise KvConfigError(f"test_chunk_delay_s must be >= 0, got {self.test_chunk_delay_s}")

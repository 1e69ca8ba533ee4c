"""Per-area configuration dataclasses of the engine, validated at construction.

Each worker builds its configs once at start-up (from CLI flags, passed through
Ray actor arguments); nothing below reads environment variables. The model's
architecture is :class:`common.model_config.ModelConfig`; a worker's whole
configuration is :class:`serving.worker_config.WorkerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.model_config import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes the engine computes and keeps its KV cache in (a worker's ``dtype`` may also be ``"auto"``)."""


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (each holds ``block_size`` tokens of K and V
            for every layer).
        dtype: KV cache dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        enable_prefix_caching: reuse the KV of full prompt blocks already in the pool
            (prefill workers).
    """

    block_size: int = 16
    num_blocks: int = 1024
    dtype: str = "float32"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported KV dtype {self.dtype!r}")


KV_FAILURE_POLICIES = ("error", "recompute")


@dataclass(frozen=True)
class SchedulerConfig:
    """Step limits of one worker's scheduler.

    Attributes:
        max_num_seqs: requests in one step (decode batch size / prefill batch).
        max_num_batched_tokens: tokens in one prefill step (the token budget).
        max_model_len: prompt + generated tokens of one request.
        lease_s: seconds a decode-side reservation may wait for its KV before its
            blocks are reclaimed (seconds); every chunk that arrives renews it.
        watermark: share of the KV pool kept free when admitting or resuming a
            request (vLLM's ``watermark``), so running requests can grow before
            anything has to be preempted.
        kv_failure_policy: what a decode worker does when a request's KV transfer
            fails (corrupt or incomplete stream, lease expiry, prefill worker lost):
            ``"error"`` ends the request with UNAVAILABLE, ``"recompute"`` rebuilds
            the prompt's KV on the decode worker and goes on.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    lease_s: float = 120.0
    watermark: float = 0.01
    kv_failure_policy: str = "error"

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")
        if self.lease_s <= 0:
            raise ConfigError(f"lease_s must be positive, got {self.lease_s}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ConfigError(f"kv_failure_policy must be one of {KV_FAILURE_POLICIES}, got {self.kv_failure_policy!r}")


QUANTIZATIONS = ("none", "int8", "q4")
"""``--quantization`` choices: ``none`` serves the float weights (the default, token-exact vs HF);
``int8`` quantizes the decoder projections and the LM head (one scale per 64 weights); ``q4`` serves the
projections as llama.cpp Q4_1 blocks (a GGUF's own where it stores them so). Implemented by
:data:`engine.model.quant.QUANT_BACKENDS`."""


def check_quantization(value: str, field: str = "quantization") -> str:
    """``value`` when it is one of :data:`QUANTIZATIONS`.

    Raises:
        ConfigError: naming ``field`` and the choices.
    """
    if value not in QUANTIZATIONS:
        raise ConfigError(f"{field} must be one of {QUANTIZATIONS}, got {value!r}")
    return value


ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "batch-invariant", "triton")
"""``--attention-backend`` choices: ``auto`` picks :func:`engine.model.default_attention_backend` for
the device, quantization and dtype (``batch-invariant`` for int8/q4 in float32 on CPU, else ``torch`` on CPU,
``triton`` on CUDA); the others name a backend of :mod:`engine.attention.registry` (a test keeps the
two lists equal). ``batch-invariant``, ``torch`` and ``sdpa`` run on CPU, ``triton`` on CUDA."""

CPU_ATTENTION_BACKENDS = ("torch", "sdpa", "batch-invariant")


def check_attention_backend(value: str, device: str = "auto", field: str = "attention_backend",
                            dtype: str = "auto") -> str:
    """``value`` when it is one of :data:`ATTENTION_BACKENDS`, runs on ``device`` (``"cpu"``,
    ``"cuda"``; ``"auto"``: not checked against a device) and takes ``dtype`` (``batch-invariant``:
    float32 only, its kernel's; ``"auto"`` is float32 on CPU).

    Raises:
        ConfigError: naming ``field`` and the choices, the device the backend needs, or the dtype.
    """
    if value not in ATTENTION_BACKENDS:
        raise ConfigError(f"{field} must be one of {ATTENTION_BACKENDS}, got {value!r}")
    if device == "cpu" and value == "triton":
        raise ConfigError(f"{field} 'triton' runs on CUDA only; on CPU use one of {CPU_ATTENTION_BACKENDS}")
    if device == "cuda" and value in CPU_ATTENTION_BACKENDS:
        raise ConfigError(f"{field} {value!r} runs on CPU only; on CUDA use 'triton' or 'auto'")
    if value == "batch-invariant" and dtype not in ("auto", "float32"):
        raise ConfigError(f"{field} 'batch-invariant' needs float32 (its kernel computes in float32 only), "
                          f"got dtype {dtype!r}")
    return value

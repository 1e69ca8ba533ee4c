"""Per-area configuration dataclasses, validated at construction.

Each worker builds its configs once at start-up (from CLI flags, passed through
Ray actor arguments); nothing below reads environment variables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtransfer.config import KvTransferConfig


class ConfigError(ValueError):
    """A configuration value is out of its allowed range."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2).

    Read from an HF ``config.json`` with :meth:`from_hf_folder`.
    """

    name: str
    path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")

    @classmethod
    def from_hf_folder(cls, path: str | Path, name: str | None = None) -> "ModelConfig":
        """Build from ``path/config.json`` (+ ``generation_config.json`` for EOS ids).

        Raises:
            ConfigError: unsupported ``model_type`` or missing fields.
        """
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        model_type = cfg.get("model_type")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ConfigError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2)")
        eos: list[int] = []
        for src in (cfg, _read_json(path / "generation_config.json")):
            e = src.get("eos_token_id")
            for x in (e if isinstance(e, list) else [e]):
                if x is not None and int(x) not in eos:
                    eos.append(int(x))
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope_params.get("rope_type", "default")
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope_type != "default":
            scaling = dict(rope_params)
        heads = cfg["num_attention_heads"]
        return cls(
            name=name or cfg.get("_name_or_path") or path.name,
            path=str(path),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id"),
            rope_scaling=scaling,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K+V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}


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
        if self.dtype not in ("float32", "bfloat16", "float16"):
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


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one prefill or decode worker needs to start.

    Attributes:
        role: ``"prefill"``, ``"decode"`` or ``"colocated"`` (both on one engine).
        worker_id: unique id registered in Redis.
        model: a model spec accepted by :func:`engine.model_loader.resolve_model`.
        host: interface the worker's gRPC servers bind to.
        redis_url: registry location.
        cluster: registry namespace (several clusters may share one Redis).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        dtype: weights/activations dtype, ``"auto"`` = float32 on CPU, bfloat16 on CUDA.
        num_threads: torch intra-op threads (CPU share of this worker).
        heartbeat_s: registry heartbeat period (seconds): liveness expires 1.5x this after
            the last beat (a dead worker is dropped within 2 periods); beats go out twice per period.
        cache: KV cache geometry.
        scheduler: step limits.
        kv: how a prefill (or colocated) worker ships KV to decode workers.
        prefill_cache: cache geometry of prefill workers when it differs from
            ``cache`` (e.g. another block size); applied by :meth:`for_role`.
    """

    role: str
    worker_id: str
    model: str
    redis_url: str
    cluster: str = "default"
    host: str = "127.0.0.1"
    device: str = "auto"
    dtype: str = "auto"
    num_threads: int = 1
    heartbeat_s: float = 1.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model_cache_dir: str | None = None
    kv: KvTransferConfig = field(default_factory=KvTransferConfig)
    prefill_cache: CacheConfig | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ConfigError(f"role must be 'prefill', 'decode' or 'colocated', got {self.role!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto/cpu/cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"unsupported dtype {self.dtype!r}")
        if self.num_threads <= 0 or self.heartbeat_s <= 0:
            raise ConfigError("num_threads and heartbeat_s must be positive")

    def for_role(self, role: str, worker_id: str, **changes) -> "WorkerConfig":
        """This template as the config of one worker: ``role`` and ``worker_id`` set,
        ``prefill_cache`` applied to a prefill worker, other fields from ``changes``.

        Raises:
            ConfigError: invalid role or changed values.
        """
        cache = self.prefill_cache if role == "prefill" and self.prefill_cache is not None else self.cache
        return replace(self, role=role, worker_id=worker_id, cache=cache, prefill_cache=None, **changes)

    @classmethod
    def from_dict(cls, d: dict) -> "WorkerConfig":
        """Inverse of :func:`dataclasses.asdict` on a worker config.

        Raises:
            TypeError / ConfigError: the dict does not describe a valid config.
        """
        pc = d.get("prefill_cache")
        return cls(**{**d, "cache": CacheConfig(**d["cache"]), "scheduler": SchedulerConfig(**d["scheduler"]),
                      "kv": KvTransferConfig(**d.get("kv", {})),
                      "prefill_cache": CacheConfig(**pc) if pc else None})

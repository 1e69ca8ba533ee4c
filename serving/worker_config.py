"""Everything one worker process needs to start, built in one place from ``pdcluster up``'s
flags (:func:`deploy.flags.cluster_spec`) and handed to each worker through its Ray actor."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from common.model_arch import DecoderArch
from common.model_config import ConfigError
from engine.config import (ATTENTION_BACKENDS, DTYPES, QUANTIZATIONS, CacheConfig, SchedulerConfig,
                           check_attention_backend, check_quantization)
from kvtransfer.config import KvTransferConfig
from serving.logs import LogConfig
from serving.priority import DEFAULT_WORKER_NICE
from serving.rpc import DEFAULT_MAX_QUEUED_REQUESTS
from serving.security import SecurityConfig


MAX_TP = 64
"""Largest tensor-parallel size a worker accepts."""


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
        quantization: how the decoder's projection weights are served, one of
            :data:`engine.config.QUANTIZATIONS` (``pdcluster up --quantization``): ``"none"`` (float,
            token-exact vs HF), ``"int8"`` or ``"q4"`` (:mod:`engine.model.quant`); not with ``tp > 1``.
        attention_backend: one of :data:`engine.config.ATTENTION_BACKENDS` (``pdcluster up
            --attention-backend``); ``"auto"`` picks by device and quantization; not with ``tp > 1``.
        num_threads: torch intra-op threads (CPU share of this worker).
        heartbeat_s: registry heartbeat period (seconds): liveness expires 1.5x this after
            the last beat (a dead worker is dropped within 2 periods); beats go out twice per period.
        cache: KV cache geometry.
        scheduler: step limits.
        kv: how a prefill (or colocated) worker ships KV to decode workers.
        prefill_cache: cache geometry of prefill workers when it differs from
            ``cache`` (e.g. another block size); applied by :meth:`for_role`.
        prefill_scheduler: step limits of prefill workers when they differ from ``scheduler``
            (``pdcluster up --prefill-max-num-batched-tokens``); applied by :meth:`for_role`.
        log: log format and level of the worker process.
        tp: tensor-parallel ranks of this worker (processes on its node; rank 0 is this
            worker); ``prefill_tp`` / ``decode_tp`` are the per-role values :meth:`for_role` applies.
        security: the internal plane's credential (the cluster secret): required by the
            worker's RPC and KV ports, sent by its KV sender (:mod:`serving.security`).
        cpu_nice: how many nice steps below the router, Redis and the controller the worker
            process runs (``pdcluster up --worker-nice``; 0-19; :mod:`serving.priority`): on
            cores it shares with them, they get the CPU first.
        max_queued_requests: ``Reserve`` calls a decode (or colocated) worker holds beyond
            ``scheduler.max_num_seqs``; one more is refused at once with RESOURCE_EXHAUSTED
            (``pdcluster up --max-queued-requests``). The worker's RPC thread pool is sized from
            both (:func:`serving.rpc.pool_size`).
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
    prefill_scheduler: SchedulerConfig | None = None
    log: LogConfig = field(default_factory=LogConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    cpu_nice: int = DEFAULT_WORKER_NICE
    tp: int = 1
    prefill_tp: int | None = None
    decode_tp: int | None = None
    quantization: str = "none"
    attention_backend: str = "auto"
    arch: DecoderArch | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ConfigError(f"role must be 'prefill', 'decode' or 'colocated', got {self.role!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto/cpu/cuda, got {self.device!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"unsupported dtype {self.dtype!r}")
        if self.num_threads <= 0 or self.heartbeat_s <= 0:
            raise ConfigError("num_threads and heartbeat_s must be positive")
        if self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 <= self.cpu_nice <= 19:
            raise ConfigError(f"cpu_nice (--worker-nice) must be in [0, 19], got {self.cpu_nice}")
        for name in ("tp", "prefill_tp", "decode_tp"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 1 <= v <= MAX_TP):
                raise ConfigError(f"{name} must be an integer in [1, {MAX_TP}], got {v!r}")
        check_quantization(self.quantization)
        check_attention_backend(self.attention_backend, self.device, dtype=self.dtype)
        tps = {n: getattr(self, n) for n in ("tp", "prefill_tp", "decode_tp") if (getattr(self, n) or 1) > 1}
        if self.quantization != QUANTIZATIONS[0] and tps:
            raise ConfigError(f"quantization {self.quantization!r} needs tensor parallelism off, got {tps}")
        if self.attention_backend != ATTENTION_BACKENDS[0] and tps:
            raise ConfigError(f"attention_backend {self.attention_backend!r} needs tensor parallelism off, got {tps}")

    def runner_options(self) -> dict:
        """The keyword arguments of :func:`engine.builder.build_runner` (after ``model`` and
        ``cache``) this worker's model is loaded with: where, in what dtype and quantization, on
        how many threads and tensor-parallel ranks."""
        return {"device": self.device, "dtype": self.dtype, "num_threads": self.num_threads,
                "model_cache_dir": self.model_cache_dir, "tp": self.tp, "quantization": self.quantization,
                "attention_backend": self.attention_backend, "arch": self.arch}

    def for_role(self, role: str, worker_id: str, **changes) -> "WorkerConfig":
        """This template as the config of one worker: ``role`` and ``worker_id`` set,
        ``prefill_cache`` and ``prefill_scheduler`` applied to a prefill worker, other fields
        from ``changes``.

        Raises:
            ConfigError: invalid role or changed values.
        """
        prefill = role == "prefill"
        cache = self.prefill_cache if prefill and self.prefill_cache is not None else self.cache
        sched = self.prefill_scheduler if prefill and self.prefill_scheduler is not None else self.scheduler
        tp = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role) or self.tp
        return replace(self, role=role, worker_id=worker_id, cache=cache, prefill_cache=None, scheduler=sched,
                       prefill_scheduler=None, tp=tp, prefill_tp=None, decode_tp=None, **changes)

    @classmethod
    def from_dict(cls, d: dict) -> "WorkerConfig":
        """Inverse of :func:`dataclasses.asdict` on a worker config.

        Raises:
            TypeError / ConfigError: the dict does not describe a valid config.
        """
        pc, ps, arch = d.get("prefill_cache"), d.get("prefill_scheduler"), d.get("arch")
        return cls(**{**d, "cache": CacheConfig(**d["cache"]), "scheduler": SchedulerConfig(**d["scheduler"]),
                      "kv": KvTransferConfig(**d.get("kv", {})),
                      "prefill_cache": CacheConfig(**pc) if pc else None,
                      "prefill_scheduler": SchedulerConfig(**ps) if ps else None,
                      "log": LogConfig(**d.get("log", {})), "security": SecurityConfig(**d.get("security", {})),
                      "arch": DecoderArch.from_dict(arch) if arch else None})

"""The cluster that ``pdcluster up``'s flags describe: the one place the worker, router and
placement configs are built from command-line flags."""

from __future__ import annotations

import ipaddress
from dataclasses import replace

from common.model_arch import DecoderArch
from common.model_config import ConfigError, FieldError, ModelConfig
from deploy.cluster import ClusterSpec
from deploy.placement import PlacementConfig
from engine.config import CacheConfig, SchedulerConfig, check_attention_backend
from engine.model.families import load_arch
from engine.model_loader import resolve_model
from engine.tp import TpLayout
from kvtransfer.config import KvTransferConfig
from kvtransfer.registry import load_transport
from pdcluster.client import API_KEY_ENV
from router.admission import AdmissionConfig
from router.breaker import BreakerConfig
from router.config import RouterConfig
from serving.certs import KeyPair
from serving.logs import LogConfig
from serving.security import SecurityConfig, check_credential
from serving.worker_config import MAX_TP, WorkerConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_MAX_MODEL_LEN = 2048


def num_kv_blocks(model: ModelConfig, block_size: int, dtype: str, kv_cache_gb: float) -> int:
    """Blocks that fit in ``kv_cache_gb`` GiB of KV cache."""
    per_block = block_size * model.kv_bytes_per_token(_DTYPE_BYTES[dtype])
    return max(2, int(kv_cache_gb * (1 << 30) // per_block))


def fitted_max_model_len(flag: int | None, num_blocks: int, block_size: int, context_len: int | None = None) -> int:
    """The cluster's ``max_model_len`` (tokens): ``--max-model-len`` when one worker's KV pool holds
    a request that long and the model's context does too, else a :class:`ConfigError`; unset,
    :data:`DEFAULT_MAX_MODEL_LEN` lowered to what the pool and the context hold. As vLLM refuses to
    start with a ``max_model_len`` above the model's context or one its KV cache cannot hold:
    every request the router admits can then finish on one worker (preempted at worst), and a chat
    without ``max_tokens`` (the rest of the context) is never refused by the decode worker's pool.

    Args:
        flag: ``--max-model-len`` (tokens), ``None`` when not given.
        num_blocks: KV blocks of one worker's pool (the null block among them, never allocated).
        block_size: tokens per block.
        context_len: the model's context (``max_position_embeddings``; ``None``: unbounded).

    Raises:
        ConfigError: ``flag`` above the model's context, or above the ``(num_blocks - 1) * block_size``
            tokens the pool holds.
    """
    room = (num_blocks - 1) * block_size
    if flag is None:
        return min(DEFAULT_MAX_MODEL_LEN, room, context_len or room)
    if context_len is not None and flag > context_len:
        raise ConfigError(f"--max-model-len {flag} exceeds the model's context of {context_len} tokens "
                          "(max_position_embeddings in its config.json)")
    if flag > room:
        raise ConfigError(f"--max-model-len {flag} does not fit one worker's KV pool: {num_blocks - 1} usable blocks "
                          f"of {block_size} tokens hold {room} tokens (raise --num-kv-blocks or --kv-cache-gb, or "
                          f"lower --max-model-len)")
    return flag


def kv_config_from_args(args, use_cuda: bool) -> KvTransferConfig:
    """The KV transfer config of ``up``'s ``--kv-*`` flags, its transport checked here (the module
    imported, the name registered) so a typo fails ``up`` instead of every worker.

    Raises:
        ConfigError: a ``--kv-transport-option`` key given twice, a ``--kv-transport-module``
            that cannot be imported, or a ``--kv-transport`` that is not registered.
        kvtransfer.config.KvConfigError: a value out of range.
    """
    options: dict[str, str] = {}
    for key, value in args.kv_transport_options:
        if key in options:
            raise ConfigError(f"--kv-transport-option {key} given twice")
        options[key] = value
    kv = KvTransferConfig(transport=args.kv_transport, transport_module=args.kv_transport_module,
                          transport_options=options, layers_per_chunk=args.kv_layers_per_chunk,
                          layerwise=use_cuda if args.kv_layerwise is None else args.kv_layerwise,
                          timeout_s=args.kv_timeout_s)
    try:
        load_transport(kv)
    except (ImportError, KeyError) as exc:
        raise ConfigError(f"KV transport {kv.transport!r}: {exc.args[0] if exc.args else exc}") from exc
    return kv


def api_keys_from_args(args) -> tuple[str, ...]:
    """The router's API keys: every ``--api-key`` and every key line of ``--api-key-file`` (blank
    lines and ``#`` comments skipped); when neither flag is given, ``$PDCLUSTER_API_KEY`` as the
    CLI read it (``args.env_api_key``); none of them: no keys (open).

    Raises:
        ConfigError: ``--api-key-file`` cannot be read or holds no key.
        ValueError: a key that is not printable ASCII without spaces.
    """
    keys = list(args.api_keys)
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {args.api_key_file}: {exc.strerror or exc}") from None
        in_file = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not in_file:
            raise ConfigError(f"--api-key-file {args.api_key_file} holds no key")
        keys += in_file
    elif not keys and args.env_api_key:
        keys = [args.env_api_key]
    for key in keys:
        check_credential(key, "an API key")
    return tuple(keys)


def public_tls_from_args(args) -> tuple[bytes, bytes]:
    """The router's TLS certificate and key PEM from ``--tls-cert`` / ``--tls-key`` (``(b"", b"")``:
    neither given, plaintext).

    Raises:
        ConfigError: only one of the two flags, or a file that cannot be read.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return b"", b""
    pems = []
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        try:
            pems.append(path.read_bytes())
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from None
    return pems[0], pems[1]


def exposure_warning(router: RouterConfig) -> str | None:
    """A warning when the router listens beyond loopback without API keys (``None`` otherwise)."""
    if router.security.api_keys:
        return None
    try:
        loopback = ipaddress.ip_address(router.host).is_loopback
    except ValueError:
        loopback = router.host == "localhost"
    if loopback:
        return None
    return (f"the router listens on {router.host} without API keys: anyone who reaches its ports can generate; "
            f"give --api-key, --api-key-file or ${API_KEY_ENV}")


def security_from_args(args, cluster_secret: str, internal_ca: KeyPair | None) -> SecurityConfig:
    """The router's security settings (API keys, public TLS, cluster secret and CA) from ``up``'s flags.

    Raises:
        ConfigError: bad API keys (:func:`api_keys_from_args`) or TLS files (:func:`public_tls_from_args`).
    """
    tls_cert, tls_key = public_tls_from_args(args)
    return SecurityConfig(api_keys=api_keys_from_args(args), cluster_secret=cluster_secret,
                          tls_cert=tls_cert, tls_key=tls_key,
                          internal_ca_cert=internal_ca.cert_pem if internal_ca else "",
                          internal_ca_key=internal_ca.key_pem if internal_ca else "")


def checked_model(args, folder) -> tuple[ModelConfig, DecoderArch]:
    """The config and the family's layer differences (:func:`load_arch`) of the model in
    ``folder``, refused before anything starts when the engine does not serve its architecture
    or the model does not split over the TP flags."""
    arch = load_arch(folder)
    model_cfg = ModelConfig.from_hf_folder(folder, name=args.model)
    check_tp(args, model_cfg)
    return model_cfg, arch


def check_tp(args, model_cfg: ModelConfig) -> None:
    """``--prefill-tp`` / ``--decode-tp`` in range, the model splits over that many ranks, and neither
    ``--quantization`` nor a named ``--attention-backend`` is asked of a tensor-parallel worker.

    Raises:
        ConfigError: naming the flag and the dimension that does not divide, or the flag not
            served with tensor parallelism.
    """
    tp = {"prefill": args.prefill_tp, "decode": args.decode_tp}
    for role, n in tp.items():
        if not 1 <= n <= MAX_TP:
            raise ConfigError(f"--{role}-tp must be in [1, {MAX_TP}], got {n}")
        try:
            TpLayout.of(model_cfg, n)
        except ConfigError as e:
            raise ConfigError(f"--{role}-tp {n}: {e}") from None
    if args.colocated and max(tp.values()) > 1:
        raise ConfigError("--prefill-tp / --decode-tp apply to disaggregated workers, not --colocated")
    split = {f"--{role}-tp": n for role, n in tp.items() if n > 1}
    if split and args.quantization != "none":
        raise ConfigError(f"--quantization {args.quantization} needs --prefill-tp and --decode-tp 1, got {split}")
    if split and args.attention_backend != "auto":
        raise ConfigError(f"--attention-backend {args.attention_backend} needs --prefill-tp and --decode-tp 1 "
                          f"(the tensor-parallel model picks its own), got {split}")
    if args.worker_gpus is not None and args.worker_gpus < 1:
        # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected")
        if max(tp.values()) > 1:
            raise ConfigError(f"--worker-gpus {args.worker_gpus} (workers sharing a GPU) cannot be combined with "
                              "--prefill-tp / --decode-tp > 1: a worker's ranks need a GPU each")
        if args.kv_transport == "torch_dist":
            raise ConfigError(f"--worker-gpus {args.worker_gpus} (workers sharing a GPU) cannot be combined with "
                              "--kv-transport torch_dist: NCCL cannot pair two processes on one GPU; use grpc")


def spec_from_args(args, redis_url: str, use_cuda: bool = False, cluster_secret: str = "",
                   internal_ca: KeyPair | None = None) -> ClusterSpec:
    """The cluster ``up``'s flags describe.

    Args:
        args: the parsed ``pdcluster up`` flags.
        redis_url: the registry the workers and the router use.
        use_cuda: whether the workers will run on GPUs (decides the KV dtype for ``--dtype auto``).
        cluster_secret: the internal plane's secret (``up`` generates it; empty: internal ports open).
        internal_ca: the cluster CA of internal mutual TLS (``up --internal-tls`` generates it;
            ``None``: internal traffic plaintext).

    Raises:
        engine.model_loader.ModelNotFoundError: ``--model`` names nothing loadable.
        ValueError / common.model_config.ConfigError: a flag value out of range, a model
            architecture the engine does not serve (the message lists those it does), a KV
            transport that cannot be loaded (:func:`kv_config_from_args`), bad API keys
            (:func:`api_keys_from_args`) or TLS files (:func:`public_tls_from_args`), ``--http-port``
            equal to ``--port``, a ``--max-model-len`` one worker's KV pool cannot hold
            (:func:`fitted_max_model_len`), an ``--attention-backend`` the workers' device does not run.
    """
    check_flag_shapes(args)
    folder = resolve_model(args.model, args.model_cache_dir)  # dequantize once here, not in every worker
    model_cfg, arch = checked_model(args, folder)
    kv_dtype = "float32" if args.dtype in ("auto", "float32") and not use_cuda else (
        "bfloat16" if args.dtype == "auto" else args.dtype)
    blocks = args.num_kv_blocks or num_kv_blocks(model_cfg, args.block_size, kv_dtype, args.kv_cache_gb)
    max_model_len = fitted_max_model_len(args.max_model_len, blocks, args.block_size, model_cfg.context_len)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=max_model_len, lease_s=args.kv_lease_s,
                            kv_failure_policy=args.kv_failure_policy)
    cache = CacheConfig(block_size=args.block_size, num_blocks=blocks, dtype=kv_dtype,
                        enable_prefix_caching=args.prefix_caching)
    prefill_cache = None
    if args.prefill_block_size and args.prefill_block_size != args.block_size:
        pbs = args.prefill_block_size  # same token capacity as the decode side's pool
        prefill_cache = replace(cache, block_size=pbs, num_blocks=max(2, blocks * args.block_size // pbs))
    prefill_sched = prefill_scheduler(sched, args.prefill_max_num_batched_tokens)
    kv = kv_config_from_args(args, use_cuda)
    check_attention_backend(args.attention_backend, "cuda" if use_cuda else "cpu", "--attention-backend", args.dtype)
    log = LogConfig(args.log_format, args.log_level)
    security = security_from_args(args, cluster_secret, internal_ca)
    worker = WorkerConfig(role="prefill", worker_id="template", model=args.model,
                          model_cache_dir=args.model_cache_dir, redis_url=redis_url,
                          cluster=args.cluster, device=args.device, dtype=args.dtype,
                          heartbeat_s=args.heartbeat_s, cache=cache, scheduler=sched, kv=kv,
                          prefill_cache=prefill_cache, prefill_scheduler=prefill_sched, log=log,
                          security=security.for_workers(),
                          max_queued_requests=args.max_queued_requests, cpu_nice=args.worker_nice,
                          prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, quantization=args.quantization,
                          attention_backend=args.attention_backend, arch=arch)
    router = _router_config(args, str(folder), redis_url, max_model_len, log, security)
    return cluster_from_args(args, worker, router)


def _router_config(args, folder: str, redis_url: str, max_model_len: int, log: LogConfig,
                   security: SecurityConfig) -> RouterConfig:
    """The router's config from ``up``'s flags (``folder``: the served model's HF folder)."""
    return RouterConfig(model=args.model, model_path=folder, redis_url=redis_url, cluster=args.cluster,
                      host=args.host, port=args.port, max_model_len=max_model_len, block_size=args.block_size,
                      policy=args.router_policy, view_period_s=args.heartbeat_s / 4,
                      http_port=args.http_port if args.http else None, max_request_bytes=args.max_request_bytes,
                      http_body_timeout_s=args.http_body_timeout, http_header_timeout_s=args.http_header_timeout,
                      http_max_connections=args.http_max_connections, max_migrations=args.max_migrations, log=log,
                      grpc_max_connections=args.grpc_max_connections, max_prompt_bytes=args.max_prompt_bytes,
                      security=security, admission=AdmissionConfig(max_queued_requests=args.max_queued_requests,
                                                                   ttft_slo_ms=args.ttft_slo_ms),
                      breaker=BreakerConfig(failures=args.breaker_failures, cooldown_s=args.breaker_cooldown_s),
                      reuse_port=args.routers > 1, allowed_origins=args.allowed_origins,
                      tool_call_parser=args.tool_call_parser, chat_template=args.chat_template,
                      reasoning_parser=args.reasoning_parser)


_CLUSTER_FLAGS = {"num_prefill": "--prefill", "num_decode": "--decode", "num_colocated": "--workers",
                  "timeout_s": "--timeout-s", "num_routers": "--routers"}
_PLACEMENT_FLAGS = {"strategy": "--placement", "prefill_resource": "--prefill-resource",
                    "decode_resource": "--decode-resource", "worker_cpus": "--worker-cpus",
                    "worker_gpus": "--worker-gpus", "timeout_s": "--placement-timeout-s",
                    "prefill_threads": "--prefill-threads", "decode_threads": "--decode-threads"}


def cluster_from_args(args, worker: WorkerConfig, router: RouterConfig) -> ClusterSpec:
    """The :class:`ClusterSpec` of ``up``'s worker counts, placement flags, ``--timeout-s`` and
    ``--routers``, starting ``worker`` (the template) and ``router``.

    Raises:
        common.model_config.FieldError: a flag out of range, naming the flag (e.g.
            ``--timeout-s must be > 0, got 0``).
        ValueError: a worker mix that cannot serve (no prefill or no decode worker).
    """
    placement = placement_from_args(args)
    counts = (0, 0, args.workers) if args.colocated else (args.prefill, args.decode, 0)
    try:
        return ClusterSpec(counts[0], counts[1], worker, router, placement, num_colocated=counts[2],
                           timeout_s=args.timeout_s, num_routers=args.routers)
    except FieldError as e:
        raise e.renamed(_CLUSTER_FLAGS) from None


def check_flag_shapes(args) -> None:
    """``up``'s flags whose shape is wrong whatever the model: block sizes not powers of two,
    ``--http-port`` equal to ``--port``, step limits < 1 (:func:`check_step_limits`).

    Raises:
        ConfigError: naming the flag.
    """
    for flag, bs in (("--block-size", args.block_size), ("--prefill-block-size", args.prefill_block_size)):
        if bs is not None and (bs <= 0 or bs & (bs - 1)):
            raise ConfigError(f"{flag} must be a power of two, got {bs}")
    if args.http and args.http_port and args.http_port == args.port:
        raise ConfigError(f"--http-port {args.port} is also --port: the gRPC and HTTP ports must differ "
                          "(--http-port 0: any free port)")
    check_step_limits(args)


def check_step_limits(args) -> None:
    """``up``'s step-limit flags, each named in its error (the engine's ``SchedulerConfig``
    would name its field).

    Raises:
        ConfigError: ``--max-num-seqs``, ``--max-num-batched-tokens`` or ``--max-model-len`` < 1.
    """
    for flag, value in (("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")


def prefill_scheduler(sched: SchedulerConfig, budget: int | None) -> SchedulerConfig | None:
    """Prefill workers' step limits under ``--prefill-max-num-batched-tokens`` ``budget`` (tokens):
    ``sched`` with that token budget, or ``None`` when it is not given or equals ``sched``'s.

    Raises:
        ConfigError: ``budget`` < 1.
    """
    if budget is None or budget == sched.max_num_batched_tokens:
        return None
    if budget < 1:
        raise ConfigError(f"--prefill-max-num-batched-tokens must be >= 1 (tokens), got {budget}")
    return replace(sched, max_num_batched_tokens=budget)


def placement_from_args(args) -> PlacementConfig:
    """The :class:`deploy.placement.PlacementConfig` of ``pdcluster up``'s placement flags.

    Raises:
        common.model_config.FieldError: a flag out of range (see
            :class:`~deploy.placement.PlacementConfig`), naming the flag.
    """
    try:
        return PlacementConfig(strategy=args.placement, prefill_resource=args.prefill_resource,
                               decode_resource=args.decode_resource, worker_cpus=args.worker_cpus,
                               worker_gpus=args.worker_gpus, timeout_s=args.placement_timeout_s,
                               prefill_threads=args.prefill_threads, decode_threads=args.decode_threads)
    except FieldError as e:
        raise e.renamed(_PLACEMENT_FLAGS) from None

"""``pdcluster up`` / ``down`` / ``status`` / ``scale``: their flags, and the commands they run.

The flags are parsed here; :func:`deploy.spec.spec_from_args` turns them into the
cluster's configs (the one place a :class:`serving.worker_config.WorkerConfig` is
built from flags). :mod:`deploy.local` and :mod:`deploy.scale` import Ray, so they
are imported only when their command runs, after :func:`deploy.ray_env.use_loopback_ray`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deploy import cli_types as t
from deploy.cli_chat import add_chat_flags
from deploy.heal import HealConfig
from engine.config import ATTENTION_BACKENDS, DTYPES, KV_FAILURE_POLICIES, QUANTIZATIONS
from pdcluster.client import API_KEY_ENV
from router.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_GRPC_MAX_CONNECTIONS,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_HTTP_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
)
from router.migration import DEFAULT_MAX_MIGRATIONS
from router.policy_names import DEFAULT_POLICY, POLICY_NAMES
from serving.logs import LOG_FORMATS, LOG_LEVELS
from serving.rpc import DEFAULT_MAX_QUEUED_REQUESTS
from serving.priority import DEFAULT_WORKER_NICE


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=t.state_dir, default="~/.pdcluster",
                   help="directory of the local cluster state (default: ~/.pdcluster)")


def _add_api_keys(p: argparse.ArgumentParser, env_api_key: str | None) -> None:
    """``up``'s API keys (turned into the router's keys by :func:`deploy.spec.api_keys_from_args`)."""
    p.add_argument("--api-key", dest="api_keys", action="append", default=[], metavar="KEY",
                   help="API key clients must send (gRPC 'authorization: Bearer KEY' metadata, HTTP "
                        "'Authorization: Bearer KEY' header; repeatable). Without --api-key, --api-key-file or "
                        f"${API_KEY_ENV} the router's ports are open")
    p.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                   help="file of API keys, one per line (blank lines and lines starting with # skipped)")
    p.set_defaults(env_api_key=env_api_key)


def _add_tls(p: argparse.ArgumentParser) -> None:
    """``up``'s TLS (turned into the configs' certificates by :func:`deploy.spec.spec_from_args`)."""
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PATH",
                   help="PEM certificate (chain) the router's gRPC and HTTP ports serve TLS with (needs --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, metavar="PATH", help="PEM private key of --tls-cert")
    p.add_argument("--internal-tls", action="store_true",
                   help="mutual TLS between the cluster's processes (router->workers, prefill->decode KV) "
                        "with a cluster CA generated here and kept in the state directory")


def _add_serving(p: argparse.ArgumentParser) -> None:
    """The router's HTTP port and every process' logging."""
    p.add_argument("--http-port", type=t.port, default=8000,
                   help="OpenAI-compatible HTTP port of the router, also /metrics and /health (0: any free port)")
    p.add_argument("--no-http", dest="http", action="store_false", help="serve gRPC only")
    p.add_argument("--max-request-bytes", type=t.positive, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="largest gRPC message / HTTP body the router's public ports accept "
                        f"(default: {DEFAULT_MAX_REQUEST_BYTES}, 4 MiB)")
    p.add_argument("--http-body-timeout", type=t.positive_float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="seconds an HTTP request's whole body may take to arrive; later: 408 "
                        f"(default: {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--http-header-timeout", type=t.positive_float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="seconds an HTTP request's head (request line + headers) may take to arrive, from the "
                        "connection's start or the previous response's end; later: 408 and the connection is closed "
                        f"(default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--http-max-connections", type=t.positive, default=DEFAULT_HTTP_MAX_CONNECTIONS, metavar="N",
                   help="open connections one router's HTTP port holds at most; one more gets 503 and is closed "
                        f"(default: {DEFAULT_HTTP_MAX_CONNECTIONS}; with TLS, as many more may be in their handshake)")
    p.add_argument("--allowed-origins", type=t.origins, default=(), metavar="ORIGINS",
                   help="comma-separated origins (scheme://host[:port]) whose browser pages may call the HTTP API "
                        "(CORS), or '*' for any (vLLM's default); default: none (CORS off)")
    add_chat_flags(p)
    p.add_argument("--grpc-max-connections", type=t.positive, default=DEFAULT_GRPC_MAX_CONNECTIONS, metavar="N",
                   help="connections one router's gRPC port holds at once, handshakes included; one more is closed "
                        f"at accept (default: {DEFAULT_GRPC_MAX_CONNECTIONS})")
    p.add_argument("--max-prompt-bytes", type=t.positive, default=None, metavar="BYTES",
                   help="largest prompt (text, or chat roles and contents) the router tokenizes "
                        "(default: max-model-len x the longest token of the vocabulary)")
    p.add_argument("--max-migrations", type=t.max_migrations, default=DEFAULT_MAX_MIGRATIONS, metavar="N",
                   help="times one request may resume on other workers after a worker failed it mid-request "
                        f"(0: never; then the worker's error ends it; default {DEFAULT_MAX_MIGRATIONS})")
    p.add_argument("--log-format", default="text", choices=list(LOG_FORMATS), help="log lines as text or JSON")
    p.add_argument("--log-level", default="INFO", choices=list(LOG_LEVELS),
                   help="log level of every process (DEBUG adds one line per engine step)")


def _add_admission(p: argparse.ArgumentParser) -> None:
    """Admission control and circuit breaking (the router's :class:`router.admission.AdmissionConfig`
    and :class:`router.breaker.BreakerConfig`; the queue bound goes to the decode workers too)."""
    p.add_argument("--max-queued-requests", type=t.non_negative, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
                   help="requests the router admits beyond what the decode workers run (the sum of their "
                        "--max-num-seqs); more are refused at once with RESOURCE_EXHAUSTED / HTTP 429 and a "
                        "retry-after hint. Each decode worker also holds at most --max-num-seqs + N reservations "
                        f"(default: {DEFAULT_MAX_QUEUED_REQUESTS})")
    p.add_argument("--ttft-slo-ms", type=t.positive_float, default=None, metavar="MS",
                   help="refuse a request whose predicted time to first token (prompt tokens queued at the best "
                        "prefill worker at its measured rate) exceeds MS (default: off)")
    p.add_argument("--breaker-failures", type=t.positive, default=3, metavar="N",
                   help="consecutive transport failures of a worker's calls after which the router skips it "
                        "(default: 3)")
    p.add_argument("--breaker-cooldown-s", type=t.positive_float, default=5.0, metavar="S",
                   help="seconds the router skips such a worker before probing it (default: 5)")


def _add_kv(p: argparse.ArgumentParser) -> None:
    """``up``'s KV transfer flags (turned into a :class:`kvtransfer.config.KvTransferConfig` by
    :func:`deploy.spec.kv_config_from_args`; lease and failure policy go to the decode scheduler)."""
    p.add_argument("--kv-transport", default="grpc", metavar="NAME",
                   help="KV transport from prefill to decode: grpc (gRPC streaming), torch_dist (torch.distributed "
                        "point-to-point, gloo on CPU, NCCL on GPU, with a gRPC control stream), or one that "
                        "--kv-transport-module registers")
    p.add_argument("--kv-transport-module", default=None, metavar="MODULE",
                   help="Python module every worker imports before looking the KV transport up, so a transport "
                        "outside pdcluster registers itself (importable on every node)")
    p.add_argument("--kv-transport-option", dest="kv_transport_options", action="append", type=t.key_value,
                   default=[], metavar="KEY=VALUE",
                   help="option passed to the KV transport's factories (repeatable; the transport checks its keys)")
    p.add_argument("--kv-layers-per-chunk", type=t.positive, default=2, help="layers per KV chunk at most")
    p.add_argument("--kv-layerwise", dest="kv_layerwise", action="store_true", default=None,
                   help="stream a request's KV layer by layer during its last prefill step (default: on GPUs; "
                        "on CPU the sender competes with the prefill for the same cores: bench/results/layerwise.md)")
    p.add_argument("--no-kv-layerwise", dest="kv_layerwise", action="store_false",
                   help="send a request's KV after its last prefill step (default: on CPU)")
    p.add_argument("--kv-timeout-s", type=t.positive_float, default=30.0, help="deadline of one KV transfer (seconds)")
    p.add_argument("--kv-lease-s", type=t.positive_float, default=120.0,
                   help="seconds a decode worker holds blocks for a transfer that does not finish")
    p.add_argument("--kv-failure-policy", default="error", choices=list(KV_FAILURE_POLICIES),
                   help="when a KV transfer fails: end the request with UNAVAILABLE, or recompute the prompt's "
                        "KV on the decode worker")


def _add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="pack", choices=["pack", "spread", "strict-pack", "strict-spread"],
                   help="placement-group strategy: pack keeps workers (e.g. a prefill-decode pair) on one node, "
                        "spread puts them on different nodes; strict-* fail instead of bending")
    p.add_argument("--prefill-resource", default=None, metavar="NAME",
                   help="custom Ray resource a node must advertise to host prefill workers")
    p.add_argument("--decode-resource", default=None, metavar="NAME",
                   help="custom Ray resource a node must advertise to host decode workers")
    p.add_argument("--worker-cpus", type=float, default=None, metavar="C",
                   help="logical CPUs per worker (default: 1 with GPUs, else the cluster's CPUs shared)")
    p.add_argument("--worker-gpus", type=float, default=None, metavar="G",
                   help="fraction of a GPU per worker where the cluster has GPUs, in (0, 1] (default: 1); e.g. 0.5 "
                        "puts a prefill and a decode worker on one GPU (they share its memory; not with TP > 1 "
                        "or --kv-transport torch_dist)")
    p.add_argument("--prefill-threads", type=int, default=None, metavar="N",
                   help="torch threads of each prefill worker (default: its CPU share); threads only, the reserved "
                        "CPUs stay: e.g. 2 on a 2-core 1P+1D cluster lets a burst of prefills use the decode "
                        "worker's idle core")
    p.add_argument("--decode-threads", type=int, default=None, metavar="N",
                   help="torch threads of each decode worker (default: its CPU share)")
    p.add_argument("--placement-timeout-s", type=float, default=120,
                   help="seconds to wait for Ray to find the workers' resources before failing")


def _add_up(sub: argparse._SubParsersAction, env_api_key: str | None) -> None:
    p = sub.add_parser("up", allow_abbrev=False, help="start a cluster (router, prefill and decode workers)")
    p.add_argument("--local", action="store_true", help="start a local Ray head and Redis")
    p.add_argument("--ray-address", default=None,
                   help="existing Ray cluster address (HOST:PORT or 'auto'); run `up` on its head node")
    p.add_argument("--ray-resources", default=None, metavar="JSON",
                   help='with --local: resources the Ray head advertises, e.g. \'{"CPU": 4, "prefill_node": 1}\'')
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers")
    p.add_argument("--colocated", action="store_true",
                   help="place colocated workers (prefill and decode on one engine) instead")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="colocated workers (with --colocated)")
    _add_placement(p)
    p.add_argument("--router-policy", default=DEFAULT_POLICY, choices=POLICY_NAMES,
                   help="how the router chooses workers: cache_aware (prefill workers by least expected prefill "
                        "work, i.e. uncached prompt tokens + prompt tokens queued there; decode workers least "
                        "loaded), least_loaded (fewest requests in flight) or round_robin "
                        f"(default: {DEFAULT_POLICY})")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--model-cache-dir", default=None, metavar="DIR",
                   help="where a GGUF model is dequantized once and kept, on every node (default: "
                        "$PDCLUSTER_MODEL_CACHE, else ~/.cache/pdcluster/models)")
    p.add_argument("--port", type=t.port, default=50051, help="router port (0: any free port)")
    p.add_argument("--routers", type=t.positive, default=1, metavar="N",
                   help="router processes behind the one address: they share --port and --http-port "
                        "(SO_REUSEPORT; the kernel spreads client connections over them), each admits its "
                        "share of the cluster's capacity, and one that dies is restarted on the same ports "
                        "while the others keep serving (default: 1)")
    p.add_argument("--host", default="127.0.0.1", help="router bind host (0.0.0.0: every interface)")
    p.add_argument("--redis-url", default=None, help="existing Redis URL (default: start one)")
    p.add_argument("--redis-port", type=t.port, default=0, help="port of the Redis `up` starts (0: any free)")
    _add_engine(p)
    _add_kv(p)
    _add_serving(p)
    _add_admission(p)
    _add_api_keys(p, env_api_key)
    _add_tls(p)
    p.add_argument("--heartbeat-s", type=t.positive_float, default=1.0, help="registry heartbeat period in seconds")
    p.add_argument("--hung-after-s", type=t.positive_float, default=HealConfig.hung_after_s,
                   help="seconds a worker or router whose process still runs may go without a heartbeat (paused, "
                        "deadlocked) before the controller kills and restarts it "
                        f"(default: {HealConfig.hung_after_s:g})")
    p.add_argument("--worker-nice", type=int, choices=range(20), default=DEFAULT_WORKER_NICE, metavar="N",
                   help="nice steps the worker processes run below the router, Redis and the controller (0-19; "
                        f"default {DEFAULT_WORKER_NICE}): on shared cores those answer first, e.g. refuse an "
                        "overload burst at once")
    p.add_argument("--timeout-s", type=float, default=300, help="seconds to wait for the cluster to be ready")
    p.add_argument("--cluster", default="default", help="cluster name (registry namespace)")
    _add_weights(p)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="torch device")
    _add_state_dir(p)
    p.set_defaults(func=_deploy("cmd_up"))


def _add_engine(p: argparse.ArgumentParser) -> None:
    """``up``'s flags for the workers' engines: KV cache geometry, step limits, tensor parallelism
    and the prefix cache."""
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-kv-blocks", type=t.num_kv_blocks, default=0,
                   help="KV blocks per worker; 0 = derive from --kv-cache-gb")
    p.add_argument("--kv-cache-gb", type=t.positive_float, default=1.0, help="KV cache per worker in GiB")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="max prompt+output tokens of a request; must fit one worker's KV pool (default: 2048, or "
                        "less where the pool or the model's context holds less)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="max running sequences per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--prefill-max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="token budget per step of prefill workers when it differs from --max-num-batched-tokens: a "
                        "smaller one gives the prompts of a burst their first tokens one after another instead of all "
                        "at the end of one long step, at no cost in throughput once a step is compute-bound")
    p.add_argument("--prefill-block-size", type=int, default=None,
                   help="KV block size of prefill workers when it differs from --block-size (the decode side re-blocks)")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks per prefill worker (processes on one node, one GPU each on GPUs)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="M",
                   help="tensor-parallel ranks per decode worker (may differ from --prefill-tp: the KV transfer "
                        "re-shards heads)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="disable the prefill workers' prefix cache")


def _add_weights(p: argparse.ArgumentParser) -> None:
    """``up``'s flags for how the model is computed: ``--dtype``, ``--quantization`` and
    ``--attention-backend``."""
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quantization", default=QUANTIZATIONS[0], choices=QUANTIZATIONS,
                   help="serve the decoder's projection weights quantized: int8 (one scale per 64 weights, the LM head "
                        "too) or q4 (llama.cpp Q4_1; a GGUF's own blocks where it stores them so); none = float (default)")
    p.add_argument("--attention-backend", default=ATTENTION_BACKENDS[0], choices=ATTENTION_BACKENDS,
                   help="attention kernels: auto (default) = batch-invariant for int8/q4 in float32 on CPU (a "
                        "request's output bit-identical however it is batched, chunked or cached), else torch on CPU, "
                        "triton on CUDA; or name one: torch, sdpa, batch-invariant (CPU, float32), triton (CUDA)")


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", allow_abbrev=False, help="add or remove workers while the cluster serves "
                                     "(removed workers drain first: nothing in flight is lost)")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers wanted")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers wanted")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="colocated workers wanted (clusters started with --colocated)")
    p.add_argument("--drain-timeout-s", type=float, default=600,
                   help="seconds a removed worker may take to finish its requests before it is stopped anyway "
                        "(default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=300,
                   help="seconds to wait for added workers to serve (default: %(default)s)")
    p.add_argument("--placement-timeout-s", type=float, default=None,
                   help="seconds to wait for Ray to place added workers (default: the one `up` used)")
    _add_state_dir(p)

    def run(args: argparse.Namespace) -> int:
        from deploy import ray_env
        from deploy.state import state_path

        state = ray_env.local_state(state_path(args.state_dir))
        if state is not None:
            ray_env.use_loopback_ray(state)  # before deploy.scale imports ray
        from deploy.scale import cmd_scale

        return int(cmd_scale(args))

    p.set_defaults(func=run)


def _deploy(name: str):
    def run(args: argparse.Namespace) -> int:
        from deploy import ray_env
        from deploy.state import state_path

        state = ray_env.local_state(state_path(getattr(args, "state_dir", None))) if name == "cmd_down" else None
        if getattr(args, "local", False) or state is not None:
            ray_env.use_loopback_ray(state)  # before deploy.local imports ray
        if name == "cmd_status":  # a second, not ten: deploy.local loads torch, transformers and Ray
            from deploy.status import cmd_status
            return int(cmd_status(args))
        from deploy.local import cmd_down, cmd_up

        return int({"cmd_up": cmd_up, "cmd_down": cmd_down}[name](args))

    run.__name__ = name
    return run


def register(sub: argparse._SubParsersAction, env_api_key: str | None) -> None:
    """Add ``up``, ``scale``, ``down`` and ``status`` to the ``pdcluster`` subcommands;
    ``env_api_key`` is ``$PDCLUSTER_API_KEY`` as the CLI read it (``up``'s key when no
    ``--api-key`` / ``--api-key-file`` is given)."""
    _add_up(sub, env_api_key)
    _add_scale(sub)
    p = sub.add_parser("down", help="stop the local cluster", allow_abbrev=False,
                       description="Stop what `pdcluster up` started, as its state file records it: the workers, "
                                   "routers and controller, the Redis it started and (with --local) the Ray head. "
                                   "A Ray head that no longer answers is skipped; its Redis is stopped all the same.")
    _add_state_dir(p)
    p.set_defaults(func=_deploy("cmd_down"))
    p = sub.add_parser("status", help="show the local cluster", allow_abbrev=False,
                       description="The live workers against the desired ones, the routers and where the logs are. "
                                   "Exit status: 0 every desired worker is live, 1 no cluster is up or its Redis "
                                   "does not answer, 3 a desired worker is missing.")
    _add_state_dir(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_deploy("cmd_status"))

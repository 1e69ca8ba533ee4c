"""The ``pdcluster`` command line.

Subcommands:

* ``generate`` - send one prompt to a router and print the completion;
* ``up`` / ``down`` / ``status`` - manage a deployment (delegated to
  :mod:`deploy.local`, imported lazily).

:func:`main` returns the process exit code (0 success, 1 request failure,
2 usage error, raised by argparse as ``SystemExit``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from pdcluster.client import GenerationResult, PdclusterClient, Usage, accumulate

FALLBACK_ADDRESS = "127.0.0.1:50051"


def default_address() -> str:
    """Router address of the local cluster state file, else ``127.0.0.1:50051``."""
    try:
        state = importlib.import_module("deploy.state").read_state()
    except (ImportError, FileNotFoundError):
        return FALLBACK_ADDRESS
    address = state.get("router_address") if state else None
    return address or FALLBACK_ADDRESS


def _port(value: str) -> int:
    """argparse type: a TCP port number, 0 (any free port) to 65535."""
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _state_dir(value: str) -> Path:
    return Path(value).expanduser()


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=_state_dir, default="~/.pdcluster",
                   help="directory of the local cluster state (default: ~/.pdcluster)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--address", default=None,
                   help=f"router HOST:PORT (default: from the local cluster state, else {FALLBACK_ADDRESS})")
    p.add_argument("--stream", action="store_true", help="print text deltas as they arrive")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens to generate (server default 16)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (server default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables")
    p.add_argument("--seed", type=int, default=None, help="per-request RNG seed")
    p.add_argument("--min-p", type=float, default=None,
                   help="keep tokens with prob >= MIN_P x the top prob, in [0, 1] (server default 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 0, over prompt + output tokens (HF semantics; server default 1.0: off)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="in [-2, 2], over output tokens (OpenAI semantics; server default 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="in [-2, 2], per occurrence in the output (OpenAI semantics; server default 0: off)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="token id that ends generation (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--request-id", default="", help="client-chosen request id")
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as a user chat message (server applies the chat template)")
    p.add_argument("--system", default=None, metavar="TEXT", help="system message (requires --chat)")
    p.add_argument("prompt", metavar="PROMPT")
    p.set_defaults(func=cmd_generate)


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a cluster (router, prefill and decode workers)")
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
    p.add_argument("--placement", default="pack", choices=["pack", "spread", "strict-pack", "strict-spread"],
                   help="placement-group strategy: pack keeps workers (e.g. a prefill-decode pair) on one node, "
                        "spread puts them on different nodes; strict-* fail instead of bending")
    p.add_argument("--prefill-resource", default=None, metavar="NAME",
                   help="custom Ray resource a node must advertise to host prefill workers")
    p.add_argument("--decode-resource", default=None, metavar="NAME",
                   help="custom Ray resource a node must advertise to host decode workers")
    p.add_argument("--worker-cpus", type=float, default=None, metavar="C",
                   help="logical CPUs per worker (default: 1 with GPUs, else the cluster's CPUs shared)")
    p.add_argument("--placement-timeout-s", type=float, default=120,
                   help="seconds to wait for Ray to find the workers' resources before failing")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--port", type=_port, default=50051, help="router port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="router bind host (0.0.0.0: every interface)")
    p.add_argument("--redis-url", default=None, help="existing Redis URL (default: start one)")
    p.add_argument("--redis-port", type=int, default=0, help="port of the Redis `up` starts (0: any free)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="KV blocks per worker; 0 = derive from --kv-cache-gb")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache per worker in GiB")
    p.add_argument("--max-model-len", type=int, default=2048, help="max prompt+output tokens")
    p.add_argument("--max-num-seqs", type=int, default=64, help="max running sequences per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--prefill-block-size", type=int, default=None,
                   help="KV block size of prefill workers when it differs from --block-size (the decode side re-blocks)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="disable the prefill workers' prefix cache")
    p.add_argument("--kv-transport", default="grpc", choices=["grpc", "torch_dist"],
                   help="KV transport from prefill to decode: gRPC streaming, or torch.distributed point-to-point "
                        "(gloo on CPU, NCCL on GPU) with a gRPC control stream")
    p.add_argument("--kv-layers-per-chunk", type=int, default=2, help="layers per KV chunk at most")
    p.add_argument("--kv-layerwise", dest="kv_layerwise", action="store_true", default=None,
                   help="stream a request's KV layer by layer during its last prefill step (default on GPUs; "
                        "on CPU the sender competes with the prefill for the same cores: bench/results/layerwise.md)")
    p.add_argument("--no-kv-layerwise", dest="kv_layerwise", action="store_false",
                   help="send a request's KV after its last prefill step (default on CPU)")
    p.add_argument("--kv-timeout-s", type=float, default=30.0, help="deadline of one KV transfer (seconds)")
    p.add_argument("--kv-lease-s", type=float, default=120.0,
                   help="seconds a decode worker holds blocks for a transfer that does not finish")
    p.add_argument("--kv-failure-policy", default="error", choices=["error", "recompute"],
                   help="when a KV transfer fails: end the request with UNAVAILABLE, or recompute the prompt's "
                        "KV on the decode worker")
    p.add_argument("--kv-test-corrupt-chunk", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-test-chunk-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="registry heartbeat period in seconds")
    p.add_argument("--timeout-s", type=float, default=300, help="seconds to wait for the cluster to be ready")
    p.add_argument("--cluster", default="default", help="cluster name (registry namespace)")
    p.add_argument("--dtype", default="auto", help="model dtype (auto, float16, bfloat16, float32)")
    p.add_argument("--device", default="auto", help="torch device (auto, cuda, cpu)")
    _add_state_dir(p)
    p.set_defaults(func=_deploy("cmd_up"))


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="add or remove workers while the cluster serves "
                                     "(removed workers drain first: nothing in flight is lost)")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers wanted")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers wanted")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="colocated workers wanted (clusters started with --colocated)")
    p.add_argument("--drain-timeout-s", type=float, default=600,
                   help="seconds a removed worker may take to finish its requests before it is stopped anyway")
    p.add_argument("--timeout-s", type=float, default=300, help="seconds to wait for added workers to serve")
    p.add_argument("--placement-timeout-s", type=float, default=None,
                   help="seconds to wait for Ray to place added workers (default: the one `up` used)")
    _add_state_dir(p)

    def run(args: argparse.Namespace) -> int:
        ray_env = importlib.import_module("deploy.ray_env")
        if ray_env.state_is_local(importlib.import_module("deploy.state").state_path(args.state_dir)):
            ray_env.use_loopback_ray()  # before deploy.scale imports ray
        return int(importlib.import_module("deploy.scale").cmd_scale(args))

    p.set_defaults(func=run)


def _add_loadtest(sub: argparse._SubParsersAction) -> None:
    importlib.import_module("loadtest.cli").register(sub)


def _deploy(name: str):
    def run(args: argparse.Namespace) -> int:
        ray_env = importlib.import_module("deploy.ray_env")
        state_file = importlib.import_module("deploy.state").state_path(getattr(args, "state_dir", None))
        if getattr(args, "local", False) or (name == "cmd_down" and ray_env.state_is_local(state_file)):
            ray_env.use_loopback_ray()  # before deploy.local imports ray
        return int(getattr(importlib.import_module("deploy.local"), name)(args))

    run.__name__ = name
    return run


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of all subcommands."""
    parser = argparse.ArgumentParser(prog="pdcluster", description="pdcluster serving cluster")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_up(sub)
    _add_scale(sub)
    p = sub.add_parser("down", help="stop the local cluster")
    _add_state_dir(p)
    p.set_defaults(func=_deploy("cmd_down"))
    p = sub.add_parser("status", help="show the local cluster")
    _add_state_dir(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_deploy("cmd_status"))
    _add_loadtest(sub)
    return parser


def _summary(result: GenerationResult, elapsed_s: float) -> str:
    u = result.usage
    rate = u.completion_tokens / elapsed_s if elapsed_s > 0 else 0.0
    return (f"[finish={result.finish_reason} prompt_tokens={u.prompt_tokens} "
            f"completion_tokens={u.completion_tokens} cached_prompt_tokens={u.cached_prompt_tokens} "
            f"elapsed={elapsed_s:.3f}s tokens/s={rate:.1f}]")


def _stream_print(client: PdclusterClient, prompt, params: dict) -> GenerationResult:
    chunks = []
    stream = client.stream(prompt, **params)
    try:
        for chunk in stream:
            chunks.append(chunk)
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except BaseException:
        stream.cancel()
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not chunks:
        return GenerationResult("", [], "", "UNSPECIFIED", Usage())
    return accumulate(chunks)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run ``pdcluster generate``; returns 0, or 1 on a gRPC error (printed to stderr)."""
    prompt: object = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = messages + [{"role": "user", "content": args.prompt}]
    params = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos, request_id=args.request_id, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    address = args.address or default_address()
    start = time.monotonic()
    try:
        with PdclusterClient(address) as client:
            if args.stream:
                result = _stream_print(client, prompt, params)
            else:
                result = client.generate(prompt, **params)
                print(result.text, flush=True)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"error: {code.name if code else 'UNKNOWN'}: {details}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print(_summary(result, time.monotonic() - start), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code.

    Raises:
        SystemExit: on usage errors (code 2) or ``--help`` (code 0).
        ImportError: ``up``/``down``/``status`` when :mod:`deploy.local` is missing.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.system is not None and not args.chat:
        parser.error("--system requires --chat")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""``pdcluster loadtest``: replay a trace (or a synthetic workload) against one router.

:func:`register` adds the subcommand to the ``pdcluster`` parser; it imports only
argparse, so ``pdcluster --help`` stays fast. :func:`cmd_loadtest` returns the exit code:
0 when every request completed, 1 when some failed, the run was interrupted or the
invariant completed + failed = sent broke, 2 on an invalid option.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_WORKLOADS = ("azure-conv", "azure-code", "mooncake-conv", "mooncake-synthetic", "synthetic")


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``loadtest`` subcommand to ``sub`` and return its parser."""
    p = sub.add_parser("loadtest", allow_abbrev=False, help="replay a request trace against a router and report latencies",
                       description="Replay a trace or synthetic workload against ROUTER and report TTFT, TPOT, "
                                   "ITL, E2E, throughput, SLO attainment and goodput.")
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="grpc: a pdcluster router at --address; openai: any OpenAI-compatible server at --base-url")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="router address (the only target; grpc; default: the router of the cluster in --state-dir)")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (the only target; openai; default: "
                        "the router's HTTP API of the cluster in --state-dir)")
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="state directory `pdcluster up --state-dir` wrote, read when no --address / --base-url "
                        "is given (default: ~/.pdcluster)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=_WORKLOADS, default="azure-conv",
                   help="trace or synthetic (default: azure-conv)")
    w.add_argument("--traces-dir", type=Path, default=None, help="trace folder (default: the traces shipped in loadtest/data)")
    w.add_argument("--num-requests", type=int, default=100, help="requests to send (default: 100)")
    w.add_argument("--skip", type=int, default=0, help="trace rows to skip before the slice")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace arrival times (0.1 = 10x faster; traces only)")
    w.add_argument("--rate", type=float, default=None,
                   help="mean request rate in req/s (trace: rescales its arrivals; synthetic: default 1)")
    w.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson", help="synthetic arrival process")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    w.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    w.add_argument("--output-len", type=int, default=32, help="synthetic output tokens")
    w.add_argument("--len-range", type=float, default=0.0, help="synthetic lengths uniform within ±this fraction")
    w.add_argument("--lengths-from", choices=_WORKLOADS[:-1], default=None,
                   help="synthetic: sample (input, output) lengths from this trace")
    w.add_argument("--max-input-tokens", type=int, default=None, help="clip prompts to this many tokens")
    w.add_argument("--max-output-tokens", type=int, default=None, help="clip outputs to this many tokens")
    w.add_argument("--block-scale", type=float, default=1.0,
                   help="mooncake: prefix block = 512 x this tokens, inputs scaled alike (default: 1)")
    w.add_argument("--seed", type=int, default=0, help="seed of synthetic draws and prompt text offsets")
    r = p.add_argument_group("run")
    r.add_argument("--concurrency", type=int, default=None, help="closed loop: keep N requests in flight")
    r.add_argument("--duration", type=float, default=300.0, help="send no request after this many seconds")
    r.add_argument("--drain-timeout", type=float, default=60.0,
                   help="cancel requests still running this many seconds after sending stopped")
    r.add_argument("--request-timeout", type=float, default=300.0, help="gRPC deadline per request (s)")
    r.add_argument("--max-inflight", type=int, default=512, help="client threads for open-loop sends")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: greedy)")
    r.add_argument("--tokenizer", default=None, help="model spec of the prompt tokenizer (default: served model)")
    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None, metavar="ttft=2s,tpot=200ms",
                   help="SLOs for attainment and goodput (any of ttft, tpot, e2e; units s or ms)")
    o.add_argument("--output-dir", type=Path, default=None,
                   help="write summary.json, requests.jsonl, report.md and PNG plots here")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.set_defaults(func=cmd_loadtest)
    return p


def configs_from_args(args: argparse.Namespace):
    """``(WorkloadConfig, RunConfig, SLO | None)`` from parsed arguments.

    Raises:
        ValueError: an invalid option value or combination.
    """
    from loadtest.metrics import parse_slo
    from loadtest.runner import RunConfig
    from loadtest.workload import WorkloadConfig

    workload = WorkloadConfig(
        source=args.workload, num_requests=args.num_requests, skip=args.skip, time_scale=args.time_scale,
        rate=args.rate, arrival=args.arrival, burstiness=args.burstiness, input_len=args.input_len,
        output_len=args.output_len, len_range=args.len_range, lengths_from=args.lengths_from,
        max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
        block_scale=args.block_scale, seed=args.seed)
    target = (args.base_url if args.backend == "openai" else args.address) or _target_from_state(args)
    run = RunConfig(address=target, backend=args.backend, concurrency=args.concurrency, duration_s=args.duration,
                    drain_timeout_s=args.drain_timeout, request_timeout_s=args.request_timeout,
                    max_inflight=args.max_inflight, temperature=args.temperature, api_key=args.api_key,
                    tls_ca=args.tls_ca)
    slo = parse_slo(args.slo) if args.slo else None
    return workload, run, slo


def _target_from_state(args: argparse.Namespace) -> str:
    """The cluster's router (grpc: its gRPC address; openai: its HTTP API's base URL, ``https`` with
    ``--tls-ca``) from the state ``pdcluster up`` wrote in ``--state-dir`` (default ``~/.pdcluster``).

    Raises:
        ValueError: no cluster is up from that directory (naming the flag to give instead).
    """
    from deploy.state import read_state

    flag = "--base-url" if args.backend == "openai" else "--address"
    where = args.state_dir or "~/.pdcluster"
    try:
        state = read_state(args.state_dir)
    except FileNotFoundError:
        raise ValueError(f"no pdcluster is up from state dir {where}; give {flag}") from None
    if args.backend == "grpc":
        return state["router_address"]
    if not state.get("router_http_address"):
        raise ValueError(f"the cluster in {where} serves no HTTP API; give --base-url")
    return f"{'https' if args.tls_ca else 'http'}://{state['router_http_address']}"


def cmd_loadtest(args: argparse.Namespace) -> int:
    """Run ``pdcluster loadtest``; returns the exit code (see the module docstring)."""
    import grpc
    from rich.console import Console

    from loadtest.driver import run_loadtest
    from loadtest.metrics import InvariantError
    from pdcluster.client import rpc_error_text

    console = Console(stderr=False)
    try:
        workload, run, slo = configs_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_loadtest(workload, run, slo=slo, traces_dir=args.traces_dir, tokenizer=args.tokenizer,
                              output_dir=args.output_dir, plots=not args.no_plots, console=console,
                              progress=not args.no_progress)
    except InvariantError as exc:
        print(f"error: invariant violated: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # WorkloadError (e.g. slice beyond the trace), malformed trace
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:  # e.g. UNAUTHENTICATED without the cluster's API key
        print(f"error: {rpc_error_text(exc)}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    s = result.summary
    if args.output_dir is not None:
        console.print(f"results in {args.output_dir}/ (summary.json, requests.jsonl, report.md"
                      f"{', PNG plots' if not args.no_plots else ''})")
    if s["interrupted"]:
        console.print("[bold red]interrupted: in-flight requests were cancelled[/]")
    return 0 if s["failed"] == 0 and not s["interrupted"] else 1

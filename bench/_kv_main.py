"""The code of ``bench/kvtransfer.py`` (see its docstring): prefill of each prompt, the
transfers per transport, the gRPC path's stage costs and py-spy profile, the result dict."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import _kv_measure as km
import _kv_pyspy
import _kv_report
import _kv_stages
import _prefill_measure as pm
import grpc
import torch
from prefill import load

from engine.block_pool import blocks_needed
from kvtransfer import DEFAULT_MAX_CHUNK_BYTES

import _common

PROFILE_TRANSFERS = 10


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="KV transfer bandwidth and latency per transport (bench/kvtransfer.py)")
    p.add_argument("--quick", action="store_true", help="the 1k prompt only, 3 repetitions (< 5 min)")
    p.add_argument("--prompts", default="1024,8192", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--reps", type=int, default=7, help="timed transfers per transport and prompt")
    p.add_argument("--prefill-reps", type=int, default=3, help="timed prefills of prompts within the budget")
    p.add_argument("--budget", type=int, default=2048, help="prefill token budget per step (chunk size)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of this (sender) process")
    p.add_argument("--receiver-threads", type=int, default=1, help="torch intra-op threads of the receiver")
    p.add_argument("--layers-per-chunk", type=int, default=6, help="gRPC sender's layers per chunk (the prefill "
                                                                    "worker's default)")
    p.add_argument("--max-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES, help="gRPC payload bytes per chunk")
    p.add_argument("--no-torch-dist", action="store_true",
                   help="skip the torch_dist transport (gRPC control plane, tensors over a gloo pair group)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (engine.model_loader)")
    p.add_argument("--no-py-spy", action="store_true", help="skip the py-spy sampling of gRPC transfers")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where to write <name>.json and .md (default bench/results; a temporary folder with --quick)")
    p.add_argument("--name", default=None, help="output file stem (default kvtransfer, kvtransfer_quick)")
    a = p.parse_args(argv)
    a.prompts = [1024] if a.quick else [int(x) for x in a.prompts.split(",")]
    a.reps = 3 if a.quick else a.reps
    a.prefill_reps = 2 if a.quick else a.prefill_reps
    a.name = a.name or ("kvtransfer_quick" if a.quick else "kvtransfer")
    a.out_dir = _common.out_dir(a.out_dir, a.quick, "kv-bench-")
    return a


log = _common.logger("kvtransfer")


def prefill_prompt(model, cfg, params: int, prompt: list[int], budget: int, reps: int,
                   gemm_n: int = 2048) -> tuple[torch.Tensor, list[int], dict]:
    """Prefill ``prompt`` into a fresh cache: (cache, the prompt's block ids, timing record).

    The record also holds ``prefill_roofline_s``: the prompt's model FLOPs
    (``bench/_prefill_measure.py``) at the GEMM rate measured right before and after the
    prefill runs, a lower bound on the prefill time that the machine's load hardly moves.
    """
    runner = pm.make_runner(model, cfg, len(prompt), 1)
    plans = pm.step_plans([prompt], 1, budget)
    n = reps if len(plans) == 1 else 1
    if len(plans) == 1:
        pm.run_plans(runner, plans)
    before = _common.gemm_GFLOPs(gemm_n, 2)
    times = [pm.run_plans(runner, plans)[0] for _ in range(n)]
    gemm = (before + _common.gemm_GFLOPs(gemm_n, 2)) / 2
    flops = pm.prefill_flops(cfg, params, [len(prompt)])["flops"]
    return runner.kv_cache, plans[-1].seqs[0].block_table, {
        "prefill_s": statistics.median(times), "prefill_s_all": times, "prefill_steps": len(plans),
        "prefill_warmup": len(plans) == 1, "prefill_flops": flops, "gemm_GFLOPs": gemm,
        "prefill_roofline_s": flops / (gemm * 1e9)}


def records(n: int, m: dict, pre: dict, load_avg: tuple[float, float]) -> list[dict]:
    """One record per transport for prompt length ``n``."""
    raw_gbps = m["raw_tcp"]["gb_per_s"]
    out = []
    for name in [t for t in ("grpc", "torch_dist", "grpc_floor", "raw_tcp") if t in m]:
        t = m[name]
        out.append({"transport": name, "prompt_tokens": n, "payload_bytes": m["payload_bytes"],
                    "gb_per_s": t["gb_per_s"], "latency_ms": t["latency_ms"], "ratio_raw_tcp": t["gb_per_s"] / raw_gbps,
                    "ratio_prefill_time": t["latency_ms"] / 1e3 / pre["prefill_s"],
                    "ratio_prefill_time_at_roofline": t["latency_ms"] / 1e3 / pre["prefill_roofline_s"],
                    "ratio_raw_tcp_paired": m["ratio_paired"] if name == "grpc" else t.get("ratio_paired", 1.0),
                    "verified": m["verified"] if name == "grpc" else t.get("verified"),
                    **{k: v for k, v in t.items() if k not in ("gb_per_s", "latency_ms")}, **pre,
                    "load_avg_1m": load_avg[0], "load_avg_1m_after": load_avg[1]})
    return out


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load_start = _common.load_avg_1m()
    cfg, model, tok = load(args.model)
    kv_bytes_per_token = cfg.kv_bytes_per_token(4)
    params = pm.non_embedding_params(model)
    biggest = max(args.prompts)
    shape = (cfg.num_layers, 2, blocks_needed(biggest, pm.BLOCK_SIZE) + 1, pm.BLOCK_SIZE, cfg.num_kv_heads,
             cfg.head_dim)
    points, stages, profile = [], {}, None
    log(f"receiver process, cache {list(shape)}; load {load_start:.2f}")
    with km.Receiver(shape, args.max_chunk_bytes, args.receiver_threads) as receiver:
        for n in args.prompts:
            prompt = _common.sonnet_prompts(tok, 1, n)[0]
            log(f"prefill {n} tokens, load {_common.load_avg_1m():.2f}")
            kv, src, pre = prefill_prompt(model, cfg, params, prompt, args.budget, args.prefill_reps)
            log(f"  {pre['prefill_s']:.2f} s; transfers of {len(src)} blocks, load {_common.load_avg_1m():.2f}")
            before = _common.load_avg_1m()
            m = km.measure_transports(receiver, kv, src, args.reps, args.layers_per_chunk, args.max_chunk_bytes,
                                      torch_dist=not args.no_torch_dist)
            recs = records(n, m, pre, (before, _common.load_avg_1m()))
            for r in recs:
                log(f"  {r['transport']}: {r['latency_ms']:.1f} ms, {r['gb_per_s']:.2f} GB/s, "
                    f"x raw {r['ratio_raw_tcp']:.2f}, x prefill {r['ratio_prefill_time']:.3f}")
            points += recs
            stages[str(n)] = _kv_stages.grpc_stage_costs(kv, src, args.layers_per_chunk, args.max_chunk_bytes,
                                                  receiver_threads=args.receiver_threads)
            if n == min(args.prompts) and not args.no_py_spy and _kv_pyspy.available():
                log(f"py-spy over {PROFILE_TRANSFERS} gRPC transfers of {n} tokens")
                path = km.GrpcPath(receiver, kv, src, args.layers_per_chunk, args.max_chunk_bytes)
                path.once()
                profile = _kv_pyspy.record({"sender": os.getpid(), "receiver": receiver.pid},
                                           lambda p=path: [p.once() for _ in range(PROFILE_TRANSFERS)])
                profile |= {"prompt_tokens": n, "transfers": PROFILE_TRANSFERS}
                log("py-spy --native over the sender's gRPC core calls")
                profile["sender_native"] = _kv_pyspy.record(
                    {"sender": os.getpid()}, lambda p=path: [p.once() for _ in range(2 * PROFILE_TRANSFERS)],
                    rate=250, native_category=_kv_pyspy.OPERATE)["sender"]["native"]
                path.close()
            del kv
    res = {
        "benchmark": "kvtransfer", "quick": args.quick, "model": args.model, "dtype": "float32",
        "cpu": _common.cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__, "grpc": grpc.__version__,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "kv_bytes_per_token": kv_bytes_per_token, "block_size": pm.BLOCK_SIZE, "reps": args.reps,
        "layers_per_chunk": args.layers_per_chunk, "max_chunk_bytes": args.max_chunk_bytes,
        "budget_tokens": args.budget,
        "processes": "sender = this process (prefill, then both transports' senders); receiver = one subprocess "
                     "for both transports (gRPC server + raw TCP server); both on 127.0.0.1",
        "thread_budget": f"sender: {args.threads} torch intra-op threads (prefill, gather); receiver: "
                         f"{args.receiver_threads} torch thread, gRPC server pool of 4",
        "load_avg_1m_start": load_start, "load_avg_1m_end": _common.load_avg_1m(),
        "points": points, "grpc_stage_costs": stages, "py_spy": profile, "duration_s": time.perf_counter() - t_start,
    }
    res["targets"] = _kv_report.targets(res)
    return res


def main(argv=None) -> int:
    args = _parse(argv)
    res = run(args)
    stem, text = _common.write_results(res, args.out_dir, args.name, _kv_report.markdown)
    log(f"wrote {stem}.json and {stem}.md in {res['duration_s']:.0f} s")
    sys.stdout.write(text)
    return 0


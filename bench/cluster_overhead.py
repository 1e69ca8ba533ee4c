"""Cluster overhead: what serving through a local 1P+1D cluster costs over the engine alone.

Two comparisons, each at the same torch thread count (``--threads``, 1 by default: what each
worker of a 1P+1D cluster gets on this 2-core machine), on sonnet prompts of ``--context``
tokens, greedy, ``ignore_eos``:

1. **one stream**: ``--new-tokens`` tokens of one request through the cluster's router
   (gRPC streaming, client-side inter-token latency, ITL) against the engine's batch-1 time
   per output token (TPOT, :func:`bench._decode_ours.measure_decode`: the decode worker's
   own scheduler and model runner in this process, no network). Target: ITL <= 1.1x TPOT.
2. **32 streams**: ``--batch`` concurrent requests through the cluster, output tokens per
   second while all of them are decoding (:func:`steady_rate`), against the engine's batch-32
   rate (all prompts prefilled). Target: cluster >= 0.9x engine. The rate from the first token
   of the first stream to the last token of the last (prefills included) is reported next to it.

The engine is measured first (in this process), then the cluster is brought up and
measured, so the two never share the CPU. Writes ``cluster_overhead.json`` / ``.md`` to
``--out-dir`` with the 1-minute load average before each part.

Usage (from the repository root)::

    python bench/cluster_overhead.py                # 128 tokens; 32 streams of 512
    python bench/cluster_overhead.py --quick        # 32 tokens; 8 streams of 64: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.ray_env import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before anything imports ray: the local cluster stays on loopback

import torch  # noqa: E402
from _common import cpu_name, load_avg_1m, logger, sonnet_prompts, write_results  # noqa: E402
from _common import fmt as _f  # noqa: E402

log = logger("overhead")
BLOCK_SIZE = 16
MODEL = "smollm2-135m-instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of each worker")
    p.add_argument("--context", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--batch", type=int, default=32, help="concurrent streams of the second comparison")
    p.add_argument("--batch-new-tokens", type=int, default=512,
                   help="output tokens per stream of the second comparison: enough that every stream is still "
                        "decoding once the prefill worker has prefilled the last prompt")
    p.add_argument("--quick", action="store_true", help="32 tokens, 8 streams")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", default="cluster_overhead")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.batch_new_tokens, args.batch, args.name = 32, 64, 8, args.name + "_quick"
    if min(args.threads, args.context, args.new_tokens, args.batch, args.batch_new_tokens) < 1:
        p.error("--threads, --context, --new-tokens, --batch and --batch-new-tokens must be >= 1")
    return args


def engine_rates(args, prompts: list[list[int]]) -> dict:
    """The engine alone: batch-1 TPOT and the batch-``args.batch`` token rate (median step)."""
    import _decode_ours

    from common.model_config import ModelConfig
    from engine.model import load_model
    from engine.model_loader import resolve_model

    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_hf_folder(resolve_model(MODEL), name=MODEL)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    prefilled = _decode_ours.prefill_kv(model, cfg, prompts, BLOCK_SIZE)
    _decode_ours.measure_decode(model, cfg, prompts[:2], prefilled[:2], 4, BLOCK_SIZE)  # warm-up
    one = _decode_ours.measure_decode(model, cfg, prompts[:1], prefilled[:1], args.new_tokens, BLOCK_SIZE)
    many = _decode_ours.measure_decode(model, cfg, prompts, prefilled, args.batch_new_tokens, BLOCK_SIZE)
    return {"tpot_ms_batch1": one["tpot_ms"], "tpot_ms_batch1_mean": one["tpot_ms_mean"],
            "tokens_per_s_batch": many["tokens_per_s"], "tokens_per_s_batch_mean": many["tokens_per_s_mean"],
            "token_ids_batch1": one["token_ids"][0]}


def _stream(client, prompt: list[int], n: int, times: list[float], tokens: list[int]) -> None:
    for msg in client.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True):
        now = time.perf_counter()
        times.extend([now] * len(msg.token_ids))
        tokens.extend(msg.token_ids)


def cluster_rates(args, prompts: list[list[int]]) -> dict:
    """Through a local 1P+1D cluster: one stream's ITL, then ``args.batch`` streams' token rate."""
    from deploy import local
    from pdcluster.cli import build_parser
    from pdcluster.client import PdclusterClient

    state_dir = Path(tempfile.mkdtemp(prefix="overhead-"))
    up = build_parser().parse_args(["up", "--local", "--port", "0", "--http-port", "0", "--state-dir", str(state_dir),
                                    "--prefill", "1", "--decode", "1", "--worker-cpus", str(args.threads),
                                    "--max-num-seqs", str(max(64, args.batch))])
    state = local.up(up)
    try:
        with PdclusterClient(state["router_address"], timeout_s=600) as client:
            client.wait_ready(60)
            _stream(client, prompts[0], 8, [], [])  # warm-up
            load_one = load_avg_1m()
            times, tokens = [], []
            _stream(client, prompts[0], args.new_tokens, times, tokens)
            itl = [b - a for a, b in zip(times, times[1:])]
            load_many = load_avg_1m()
            per = [([], []) for _ in prompts]
            threads = [threading.Thread(target=_stream, args=(client, p, args.batch_new_tokens, t, k))
                       for p, (t, k) in zip(prompts, per)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        local.down(state_dir)
    first = min(t[0] for t, _ in per)
    last = max(t[-1] for t, _ in per)
    total = sum(len(k) for _, k in per)
    return {"itl_ms_median": 1e3 * statistics.median(itl), "itl_ms_mean": 1e3 * statistics.fmean(itl),
            "itl_ms_p99": 1e3 * sorted(itl)[int(0.99 * (len(itl) - 1))], "tokens_per_s_batch": total / (last - first),
            **steady_rate([t for t, _ in per]),
            "load_avg_1m_before_one": load_one, "load_avg_1m_before_batch": load_many, "token_ids_one": tokens}


def steady_rate(times: list[list[float]]) -> dict:
    """Output tokens/s while every stream is decoding: from the last stream's first token to the
    first stream's last token (the engine's batch rate is measured the same way, all prompts
    prefilled); the tokens that arrived inside that window over its length. ``None`` when the
    window is empty (a stream finished before the last one started)."""
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    inside = sum(start < x <= end for t in times for x in t)
    return {"tokens_per_s_steady": inside / (end - start) if end > start and inside else None,
            "steady_window_s": max(0.0, end - start)}


def markdown(res: dict) -> str:
    e, c, t = res["engine"], res["cluster"], res["targets"]
    return "\n".join([
        "# Cluster overhead (`bench/cluster_overhead.py`)", "",
        f"{res['model']}, float32, CPU ({res['cpu']}), {res['threads']} torch thread(s) for the engine and for "
        f"each worker; {res['context']}-token sonnet prompts, {res['new_tokens']} greedy tokens ({res['batch_new_tokens']} "
        f"per stream of the {res['batch']}). 1-minute load "
        f"average: {res['load_avg_1m_engine']:.2f} before the engine part, {c['load_avg_1m_before_one']:.2f} / "
        f"{c['load_avg_1m_before_batch']:.2f} before the cluster's one-stream / {res['batch']}-stream parts.", "",
        "| comparison | engine alone | through the cluster | ratio | target | met |",
        "|---|---|---|---|---|---|",
        f"| one stream: ITL vs batch-1 TPOT (median, ms) | {e['tpot_ms_batch1']:.1f} | {c['itl_ms_median']:.1f} "
        f"(mean {c['itl_ms_mean']:.1f}, p99 {c['itl_ms_p99']:.1f}) | {t['itl_over_tpot']:.3f} | <= 1.1 | "
        f"{'yes' if t['itl_over_tpot'] <= 1.1 else 'no'} |",
        f"| {res['batch']} streams, all decoding: output tokens/s | {e['tokens_per_s_batch']:.1f} | "
        f"{_f(c['tokens_per_s_steady'], '.1f')} ({c['steady_window_s']:.1f} s window) | {_f(t['steady_rate_ratio'], '.3f')} | "
        f">= 0.9 | {'—' if t['steady_rate_ratio'] is None else 'yes' if t['steady_rate_ratio'] >= 0.9 else 'no'} |",
        f"| {res['batch']} streams, first token to last (with the prefill ramp): output tokens/s | "
        f"{e['tokens_per_s_batch']:.1f} | {c['tokens_per_s_batch']:.1f} | {t['rate_ratio']:.3f} | | |",
        "", f"Same greedy tokens, engine vs cluster (one stream): {res['same_tokens']}.", ""])


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    args = parse_args(argv)
    prompts = sonnet_prompts(AutoTokenizer.from_pretrained(resolve_model(MODEL)), args.batch, args.context)
    load_engine = load_avg_1m()
    log(f"engine alone, {args.threads} thread(s), load {load_engine:.2f}")
    engine = engine_rates(args, prompts)
    log(f"engine: TPOT {engine['tpot_ms_batch1']:.1f} ms, batch-{args.batch} {engine['tokens_per_s_batch']:.1f} tok/s")
    cluster = cluster_rates(args, prompts)
    log(f"cluster: ITL {cluster['itl_ms_median']:.1f} ms, {args.batch} streams {cluster['tokens_per_s_batch']:.1f} tok/s")
    res = {"benchmark": "cluster_overhead", "model": MODEL, "cpu": cpu_name(), "threads": args.threads,
           "context": args.context, "new_tokens": args.new_tokens, "batch": args.batch,
           "batch_new_tokens": args.batch_new_tokens, "quick": args.quick,
           "load_avg_1m_engine": load_engine,
           "same_tokens": engine.pop("token_ids_batch1") == cluster.pop("token_ids_one"),
           "engine": engine, "cluster": cluster,
           "targets": {"itl_over_tpot": cluster["itl_ms_median"] / engine["tpot_ms_batch1"],
                       "rate_ratio": cluster["tokens_per_s_batch"] / engine["tokens_per_s_batch"],
                       "steady_rate_ratio": None if cluster["tokens_per_s_steady"] is None
                       else cluster["tokens_per_s_steady"] / engine["tokens_per_s_batch"]}}
    stem, text = write_results(res, args.out_dir, args.name, markdown)
    print(text)
    log(f"wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

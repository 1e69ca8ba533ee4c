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

``--rounds`` rounds (2 by default) alternate the engine (in this process, while the cluster idles:
the two never compute at once) and the cluster (:func:`measure_rounds`); each ratio pairs a
cluster part with the engine part measured just before it, and the targets are judged on the
ratios' medians over the rounds. Writes ``cluster_overhead.json`` / ``.md`` to ``--out-dir`` with
the 1-minute load average before each part.

Usage (from the repository root)::

    python bench/cluster_overhead.py                # 128 tokens; 32 streams of 512
    python bench/cluster_overhead.py --quick        # 32 tokens; 8 streams of 64; one round: a smoke run
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
    p.add_argument("--rounds", type=int, default=2, help="rounds of the four parts, engine and cluster alternating")
    p.add_argument("--quick", action="store_true", help="32 tokens, 8 streams, one round")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", default="cluster_overhead")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.batch_new_tokens, args.batch, args.name = 32, 64, 8, args.name + "_quick"
        args.rounds = 1
    if min(args.threads, args.context, args.new_tokens, args.batch, args.batch_new_tokens, args.rounds) < 1:
        p.error("--threads, --context, --new-tokens, --batch, --batch-new-tokens and --rounds must be >= 1")
    return args


def engine_setup(args, prompts: list[list[int]]) -> tuple:
    """The engine alone, loaded and warmed up: ``(model, config, prefilled KV per prompt)``."""
    import _decode_ours

    from common.model_config import ModelConfig
    from engine.model import load_model
    from engine.model_loader import resolve_model

    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_hf_folder(resolve_model(MODEL), name=MODEL)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    prefilled = _decode_ours.prefill_kv(model, cfg, prompts, BLOCK_SIZE)
    _decode_ours.measure_decode(model, cfg, prompts[:2], prefilled[:2], 4, BLOCK_SIZE)  # warm-up
    return model, cfg, prefilled


def engine_one(engine: tuple, args, prompts: list[list[int]]) -> dict:
    """The engine's batch-1 TPOT (median and mean step, ms) and its greedy tokens."""
    import _decode_ours

    model, cfg, prefilled = engine
    one = _decode_ours.measure_decode(model, cfg, prompts[:1], prefilled[:1], args.new_tokens, BLOCK_SIZE)
    return {"tpot_ms_batch1": one["tpot_ms"], "tpot_ms_batch1_mean": one["tpot_ms_mean"],
            "token_ids_batch1": one["token_ids"][0]}


def engine_batch(engine: tuple, args, prompts: list[list[int]]) -> dict:
    """The engine's batch-``args.batch`` output token rate (from the median and the mean step)."""
    import _decode_ours

    model, cfg, prefilled = engine
    many = _decode_ours.measure_decode(model, cfg, prompts, prefilled, args.batch_new_tokens, BLOCK_SIZE)
    return {"tokens_per_s_batch": many["tokens_per_s"], "tokens_per_s_batch_mean": many["tokens_per_s_mean"]}


def _stream(client, prompt: list[int], n: int, times: list[float], tokens: list[int]) -> None:
    for msg in client.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True):
        now = time.perf_counter()
        times.extend([now] * len(msg.token_ids))
        tokens.extend(msg.token_ids)


def start_cluster(args) -> tuple[Path, dict]:
    """A local 1P+1D cluster, each worker on ``args.threads`` threads: ``(state dir, state)``."""
    from deploy import local
    from pdcluster.cli import build_parser

    state_dir = Path(tempfile.mkdtemp(prefix="overhead-"))
    up = build_parser().parse_args(["up", "--local", "--port", "0", "--http-port", "0", "--state-dir", str(state_dir),
                                    "--prefill", "1", "--decode", "1", "--worker-cpus", str(args.threads),
                                    "--max-num-seqs", str(max(64, args.batch))])
    return state_dir, local.up(up)


def cluster_one(client, args, prompts: list[list[int]]) -> dict:
    """One greedy stream through the cluster: client-side ITL (median, mean, p99; ms) and its tokens."""
    load = load_avg_1m()
    times, tokens = [], []
    _stream(client, prompts[0], args.new_tokens, times, tokens)
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"itl_ms_median": 1e3 * statistics.median(itl), "itl_ms_mean": 1e3 * statistics.fmean(itl),
            "itl_ms_p99": 1e3 * sorted(itl)[int(0.99 * (len(itl) - 1))], "load_avg_1m_before_one": load,
            "token_ids_one": tokens}


def cluster_batch(client, args, prompts: list[list[int]]) -> dict:
    """``args.batch`` concurrent streams through the cluster: output tokens/s from the first token
    to the last, and while all of them decode (:func:`steady_rate`)."""
    load = load_avg_1m()
    per = [([], []) for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(client, p, args.batch_new_tokens, t, k))
               for p, (t, k) in zip(prompts, per)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first, last = min(t[0] for t, _ in per), max(t[-1] for t, _ in per)
    return {"tokens_per_s_batch": sum(len(k) for _, k in per) / (last - first),
            **steady_rate([t for t, _ in per]), "load_avg_1m_before_batch": load}


def measure_rounds(args, prompts: list[list[int]]) -> list[dict]:
    """``args.rounds`` rounds, each: engine batch 1, cluster one stream, engine batch, cluster
    streams. The engine runs in this process while the cluster idles (never both at once); pairing
    each cluster part with the engine part measured just before it keeps the machine's drift (its
    speed moves by tens of percent within minutes here) out of the ratios."""
    from deploy import local
    from pdcluster.client import PdclusterClient

    engine = engine_setup(args, prompts)
    state_dir, state = start_cluster(args)
    rounds = []
    try:
        with PdclusterClient(state["router_address"], timeout_s=600) as client:
            client.wait_ready(60)
            _stream(client, prompts[0], 8, [], [])  # warm-up
            for r in range(args.rounds):
                e = {"load_avg_1m": load_avg_1m(), **engine_one(engine, args, prompts)}
                c = cluster_one(client, args, prompts)
                e.update(engine_batch(engine, args, prompts))
                c.update(cluster_batch(client, args, prompts))
                rounds.append(_round(e, c))
                log(f"round {r + 1}: TPOT {e['tpot_ms_batch1']:.1f} ms vs ITL {c['itl_ms_median']:.1f} ms; "
                    f"batch {e['tokens_per_s_batch']:.1f} vs {_f(c['tokens_per_s_steady'], '.1f')} tok/s")
    finally:
        local.down(state_dir)
    return rounds


def _round(e: dict, c: dict) -> dict:
    steady = c["tokens_per_s_steady"]
    return {"engine": e, "cluster": c, "same_tokens": e.pop("token_ids_batch1") == c.pop("token_ids_one"),
            "itl_over_tpot": c["itl_ms_median"] / e["tpot_ms_batch1"],
            "rate_ratio": c["tokens_per_s_batch"] / e["tokens_per_s_batch"],
            "steady_rate_ratio": None if steady is None else steady / e["tokens_per_s_batch"]}


def steady_rate(times: list[list[float]]) -> dict:
    """Output tokens/s while every stream is decoding: from the last stream's first token to the
    first stream's last token (the engine's batch rate is measured the same way, all prompts
    prefilled); the tokens that arrived inside that window over its length. ``None`` when the
    window is empty (a stream finished before the last one started)."""
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    inside = sum(start < x <= end for t in times for x in t)
    return {"tokens_per_s_steady": inside / (end - start) if end > start and inside else None,
            "steady_window_s": max(0.0, end - start)}


def summarize(rounds: list[dict]) -> dict:
    """Each ratio's median over the rounds (the targets are judged on these), and the per-part
    medians they come from."""
    def med(key: str, part: str | None = None):
        vals = [(r[part] if part else r)[key] for r in rounds]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    return {"itl_over_tpot": med("itl_over_tpot"), "rate_ratio": med("rate_ratio"),
            "steady_rate_ratio": med("steady_rate_ratio"),
            "engine_tpot_ms_batch1": med("tpot_ms_batch1", "engine"),
            "engine_tokens_per_s_batch": med("tokens_per_s_batch", "engine"),
            "cluster_itl_ms_median": med("itl_ms_median", "cluster"),
            "cluster_tokens_per_s_steady": med("tokens_per_s_steady", "cluster"),
            "cluster_tokens_per_s_batch": med("tokens_per_s_batch", "cluster")}


def _met(x, ok) -> str:
    return "—" if x is None else "yes" if ok(x) else "no"


def markdown(res: dict) -> str:
    t, n, b = res["targets"], len(res["rounds"]), res["batch"]
    lines = [
        "# Cluster overhead (`bench/cluster_overhead.py`)", "",
        f"{res['model']}, float32, CPU ({res['cpu']}), {res['threads']} torch thread(s) for the engine and for "
        f"each worker; {res['context']}-token sonnet prompts, {res['new_tokens']} greedy tokens ({res['batch_new_tokens']} "
        f"per stream of the {b}). {n} round(s), each: the engine alone at batch 1, one stream through the cluster, "
        f"the engine at batch {b}, {b} streams through the cluster (the engine in the bench's process while the "
        "cluster idles); each ratio pairs a cluster part with the engine part just before it, and the table gives "
        "the ratios' medians over the rounds.", "",
        "| comparison | engine alone | through the cluster | ratio | target | met |",
        "|---|---|---|---|---|---|",
        f"| one stream: ITL vs batch-1 TPOT (median, ms) | {_f(t['engine_tpot_ms_batch1'], '.1f')} | "
        f"{_f(t['cluster_itl_ms_median'], '.1f')} | {_f(t['itl_over_tpot'], '.3f')} | <= 1.1 | "
        f"{_met(t['itl_over_tpot'], lambda x: x <= 1.1)} |",
        f"| {b} streams, all decoding: output tokens/s | {_f(t['engine_tokens_per_s_batch'], '.1f')} | "
        f"{_f(t['cluster_tokens_per_s_steady'], '.1f')} | {_f(t['steady_rate_ratio'], '.3f')} | >= 0.9 | "
        f"{_met(t['steady_rate_ratio'], lambda x: x >= 0.9)} |",
        f"| {b} streams, first token to last (with the prefill ramp): output tokens/s | "
        f"{_f(t['engine_tokens_per_s_batch'], '.1f')} | {_f(t['cluster_tokens_per_s_batch'], '.1f')} | "
        f"{_f(t['rate_ratio'], '.3f')} | | |", "",
        "| round | 1-min load before | TPOT / ITL (ms) | ITL p99 (ms) | ratio | batch tok/s engine / cluster all decoding "
        "(window s) | ratio | same greedy tokens |",
        "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(res["rounds"], 1):
        e, c = r["engine"], r["cluster"]
        lines.append(f"| {i} | {e['load_avg_1m']:.2f} | {e['tpot_ms_batch1']:.1f} / {c['itl_ms_median']:.1f} | "
                     f"{c['itl_ms_p99']:.1f} | {r['itl_over_tpot']:.3f} | {e['tokens_per_s_batch']:.1f} / "
                     f"{_f(c['tokens_per_s_steady'], '.1f')} ({c['steady_window_s']:.1f}) | "
                     f"{_f(r['steady_rate_ratio'], '.3f')} | {r['same_tokens']} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    args = parse_args(argv)
    prompts = sonnet_prompts(AutoTokenizer.from_pretrained(resolve_model(MODEL)), args.batch, args.context)
    log(f"{args.rounds} round(s), {args.threads} thread(s), load {load_avg_1m():.2f}")
    rounds = measure_rounds(args, prompts)
    res = {"benchmark": "cluster_overhead", "model": MODEL, "cpu": cpu_name(), "threads": args.threads,
           "context": args.context, "new_tokens": args.new_tokens, "batch": args.batch,
           "batch_new_tokens": args.batch_new_tokens, "quick": args.quick,
           "same_tokens": all(r["same_tokens"] for r in rounds), "rounds": rounds, "targets": summarize(rounds)}
    stem, text = write_results(res, args.out_dir, args.name, markdown)
    print(text)
    log(f"wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

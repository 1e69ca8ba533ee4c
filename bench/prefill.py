"""Prefill throughput of SmolLM2-135M (float32, CPU) through our model runner, against the
float32 GEMM roofline measured in the same run (``--quantization``, ``--attention-backend``: another
weight format or attention path, same measurement).

For each prompt length (default 128, 512, 2048 tokens) and mode:

* ``single``: one prompt per step (``k`` prompts, ``k`` steps);
* ``batched``: the same ``k`` prompts packed into one varlen step under the token budget
  (``k = budget // length``, e.g. 4 x 512 in one 2048-token step), as the prefill
  scheduler does. At ``length == budget`` one prompt fills the step, so ``batched`` is
  ``single`` and is not run twice.

Each step is ``ModelRunner.execute`` (attention metadata, forward, LM head on the last
row of each prompt, greedy sampling), timed wall-clock; the median of ``--reps``
repetitions after a warm-up. tokens/s = prompt tokens / seconds. The roofline: model
FLOPs (``bench/_prefill_measure.py``: 2 x non-embedding parameters x tokens + causal
attention 4 x layers x heads x head_dim x sum of context lengths) over the GEMM rate
(``torch.mm`` of two ``--gemm-n`` square float32 matrices, same threads) measured just
before and after every repetition; ``ratio_roofline`` = achieved FLOP/s / GEMM FLOP/s.
One profiled run at the longest length splits the step into operator categories.

Writes ``<name>.json`` and ``<name>.md`` under ``--out-dir`` and prints the JSON to
stdout (progress on stderr). ``--quick`` runs one point (2048 tokens, single, 2
repetitions) into a temporary folder unless ``--out-dir`` is given.

Usage::

    python bench/prefill.py --quick
    python bench/prefill.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

import _prefill_measure as pm  # noqa: E402
import _prefill_report  # noqa: E402
import torch  # noqa: E402

import _common  # noqa: E402

TARGET_LENGTH, TARGET_RATIO = 2048, 0.6


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one point: 2048 tokens, single, 2 reps (< 5 min)")
    p.add_argument("--lengths", default="128,512,2048", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--budget", type=int, default=2048, help="token budget of one step (max_num_batched_tokens)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per point (after one warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--gemm-n", type=int, default=2048, help="size of the square GEMM of the roofline")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (engine.model_loader)")
    p.add_argument("--quantization", default="none", help="none|int8|q4 (engine.model.load_model)")
    p.add_argument("--attention-backend", default=None,
                   help="a registered attention backend (default: the model's default for CPU and --quantization)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler run")
    p.add_argument("--diag-threads", type=int, default=1,
                   help="re-measure the shortest and longest length (single) at this many threads, same run "
                        "(0 = skip; skipped with --quick)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where to write <name>.json and .md (default bench/results; a temporary folder with --quick)")
    p.add_argument("--name", default=None, help="output file stem (default prefill, prefill_quick)")
    a = p.parse_args(argv)
    a.lengths = [TARGET_LENGTH] if a.quick else [int(x) for x in a.lengths.split(",")]
    a.modes = ("single",) if a.quick else ("single", "batched")
    a.reps = 2 if a.quick else a.reps
    a.diag_threads = 0 if a.quick else a.diag_threads
    a.name = a.name or ("prefill_quick" if a.quick else "prefill")
    a.out_dir = _common.out_dir(a.out_dir, a.quick, "prefill-bench-")
    return a


log = _common.logger("prefill")


def load(model_spec: str, quantization: str = "none", attention_backend: str | None = None):
    """(model config, float32 model on CPU, tokenizer) of ``model_spec``, its decoder projections served as
    ``quantization``, its attention through ``attention_backend`` (None: the default)."""
    from transformers import AutoTokenizer

    from common.model_config import ModelConfig
    from engine.model import load_model
    from engine.model_loader import resolve_model_source

    folder, gguf = resolve_model_source(model_spec)
    cfg = ModelConfig.from_hf_folder(folder, name=model_spec)
    model = load_model(cfg, torch.device("cpu"), torch.float32, attention_backend=attention_backend,
                       quantization=quantization, gguf_path=gguf)
    return cfg, model, AutoTokenizer.from_pretrained(folder)


def run_point(model, cfg, params: int, prompts: list[list[int]], mode: str, budget: int, reps: int,
              gemm_n: int = 2048) -> dict:
    """Measure one (length, mode) point over ``prompts`` (all of one length)."""
    k, n = len(prompts), len(prompts[0])
    per_step = k if mode == "batched" else 1
    runner = pm.make_runner(model, cfg, n, k)
    plans = pm.step_plans(prompts, per_step, budget)
    flops = pm.prefill_flops(cfg, params, [n] * k)
    load_before = _common.load_avg_1m()
    m = pm.measure_prefill(runner, plans, flops["flops"], reps, gemm_n)
    tokens = k * n
    return {"prompt_len": n, "mode": mode, "num_prompts": k, "prompts_per_step": per_step, "steps": len(plans),
            "tokens": tokens, "tokens_per_s": tokens / m["seconds"], "ratio_roofline": m["ratio_roofline"],
            "roofline_tokens_per_s": tokens / (flops["flops"] / (m["gemm_GFLOPs"] * 1e9)),
            **flops, **{k2: v for k2, v in m.items() if k2 != "tokens"},
            "load_avg_1m": load_before, "load_avg_1m_after": _common.load_avg_1m()}


def run(args) -> dict:
    from engine.model import default_attention_backend

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load_start = _common.load_avg_1m()
    cfg, model, tok = load(args.model, args.quantization, args.attention_backend)
    params = pm.non_embedding_params(model)
    log(f"model loaded, {params / 1e6:.1f} M non-embedding parameters, load {load_start:.2f}")
    points, profile = [], None
    for n in args.lengths:
        prompts = _common.sonnet_prompts(tok, max(1, args.budget // n), n)
        for mode in args.modes:
            if mode == "batched" and len(prompts) == 1:
                continue
            log(f"{n} tokens, {mode}, {len(prompts)} prompts, load {_common.load_avg_1m():.2f}")
            rec = run_point(model, cfg, params, prompts, mode, args.budget, args.reps, args.gemm_n)
            log(f"  {rec['tokens_per_s']:.0f} tok/s, {rec['achieved_GFLOPs']:.1f} GFLOP/s, "
                f"GEMM {rec['gemm_GFLOPs']:.1f} GFLOP/s, roofline x{rec['ratio_roofline']:.2f}")
            points.append(rec)
    for rec in points:
        single = next((p for p in points if p["prompt_len"] == rec["prompt_len"] and p["mode"] == "single"), None)
        rec["ratio_batched_vs_single"] = (rec["tokens_per_s"] / single["tokens_per_s"]
                                          if rec["mode"] == "batched" and single else None)
    diagnostic = thread_diagnostic(args, model, cfg, params, tok, points) if args.diag_threads else []
    if not args.no_profile:
        n = max(args.lengths)
        log(f"profiling one {n}-token step")
        prompts = _common.sonnet_prompts(tok, 1, n)
        profile = pm.profile_step(pm.make_runner(model, cfg, n, 1), pm.step_plans(prompts, 1, args.budget),
                                  gemm_n=args.gemm_n)
        profile |= {"prompt_len": n, "flops": pm.prefill_flops(cfg, params, [n]),
                    "attention_variants": pm.attention_variants(cfg, n)}
    res = {
        "benchmark": "prefill", "quick": args.quick, "model": args.model, "dtype": "float32", "device": "cpu",
        "quantization": args.quantization,
        "attention_backend": args.attention_backend or default_attention_backend(torch.device("cpu"), args.quantization),
        "cpu": _common.cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": args.threads, "thread_budget": f"{args.threads} torch intra-op threads, one process",
        "budget_tokens": args.budget, "block_size": pm.BLOCK_SIZE, "reps": args.reps, "gemm_n": args.gemm_n,
        "non_embedding_params": params, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
        "head_dim": cfg.head_dim, "flops_formula": "2 * non_embedding_params * tokens + 4 * num_layers * "
                                                   "num_heads * head_dim * sum over prompts of n (n + 1) / 2",
        "load_avg_1m_start": load_start, "load_avg_1m_end": _common.load_avg_1m(),
        "points": points, "thread_diagnostic": diagnostic, "profile": profile,
        "duration_s": time.perf_counter() - t_start,
    }
    res["targets"] = targets(res)
    return res


def thread_diagnostic(args, model, cfg, params: int, tok, points: list[dict]) -> list[dict]:
    """The shortest and the longest length, single, again at ``--diag-threads`` torch threads
    (their roofline: the GEMM rate at those threads); ``ratio_vs_main_threads`` = tokens/s over
    the main point's."""
    torch.set_num_threads(args.diag_threads)
    out = []
    try:
        for n in sorted({min(args.lengths), max(args.lengths)}):
            prompts = _common.sonnet_prompts(tok, max(1, args.budget // n), n)
            log(f"diagnostic: {n} tokens, single, {args.diag_threads} thread(s), load {_common.load_avg_1m():.2f}")
            rec = run_point(model, cfg, params, prompts, "single", args.budget, args.reps, args.gemm_n)
            main = next(p for p in points if p["prompt_len"] == n and p["mode"] == "single")
            rec |= {"threads": args.diag_threads, "ratio_vs_main_threads": rec["tokens_per_s"] / main["tokens_per_s"]}
            log(f"  {rec['tokens_per_s']:.0f} tok/s (x{rec['ratio_vs_main_threads']:.2f} of {args.threads} threads), "
                f"GEMM {rec['gemm_GFLOPs']:.1f} GFLOP/s, roofline x{rec['ratio_roofline']:.2f}")
            out.append(rec)
    finally:
        torch.set_num_threads(args.threads)
    return out


def targets(res: dict) -> list[dict]:
    """The issue's target (ratio_roofline >= 0.6 at 2048 tokens), per measured 2048 point."""
    rows = []
    for p in res["points"]:
        if p["prompt_len"] == TARGET_LENGTH:
            v = p["ratio_roofline"]
            rows.append({"target": f"prefill / roofline at {TARGET_LENGTH} tokens ({p['mode']})",
                         "minimum": TARGET_RATIO, "value": v, "met": v >= TARGET_RATIO,
                         "shortfall": None if v >= TARGET_RATIO else 1 - v / TARGET_RATIO})
    return rows


def main(argv=None) -> int:
    args = _parse(argv)
    res = run(args)
    stem, text = _common.write_results(res, args.out_dir, args.name, _prefill_report.markdown)
    log(f"wrote {stem}.json and {stem}.md in {res['duration_s']:.0f} s")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

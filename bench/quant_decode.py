"""Quantized against float32 decode in one run: the ratio issue #14 item 2 asks for (int8 >= 2.5x float32).

``bench/decode.py --quantization int8`` and a float32 ``bench/decode.py`` are two runs, minutes apart, and
this shared machine's speed changes between runs by more than the effect measured (float32 batch-1 TPOT
was 18.4 ms in one run and 12.4 ms in another). Here both models live in one process and each point's
decode is measured for every model in turn, ``--rounds`` times in rotating order; the ratio per point is
computed from the two best runs of the same rounds. The path measured is the decode worker's
(:func:`_decode_ours.measure_decode`: a :class:`DecodeScheduler` stepping a batch of prefilled prompts,
greedy, EOS ignored); TPOT is the median step time of a run.

Per point: TPOT p50 (ms) per model and run, the best of each, ``tok/s``, the ratio to float32, the
1-minute load average before the point, and the greedy agreement with float32 (sequences whose every token
equals float32's). The machine's copy bandwidth is measured at the start.

Writes ``quant_decode.json`` / ``.md`` under ``--out-dir`` (default ``bench/results``; a temporary folder
with ``--quick``) and prints the JSON.

Usage::

    python bench/quant_decode.py                   # int8 and q4 vs float32, batch 1, 8, 32 at context 128
    python bench/quant_decode.py --quick           # int8 only, batch 1 and 8, 32 new tokens
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common  # noqa: E402
import _decode_ours  # noqa: E402
import torch  # noqa: E402

from decode_worker.events import Tokens  # noqa: E402

BLOCK_SIZE = 16
log = _common.logger("quant_decode")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="int8 only, batch 1 and 8, 32 new tokens, 2 rounds")
    p.add_argument("--quantizations", default="int8,q4", help="comma-separated, each compared with float32")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=128, help="prompt length (tokens)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--rounds", type=int, default=3, help="runs per model per point, in rotating order")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (engine.model_loader)")
    p.add_argument("--out-dir", type=Path, default=None, help="default bench/results (temporary with --quick)")
    p.add_argument("--name", default="quant_decode", help="output file stem")
    p.add_argument("--no-decode-plan", action="store_true",
                   help="run decode steps through the model's modules (engine.model.decode_plan off), for comparison")
    p.add_argument("--python-layer-loop", action="store_true",
                   help="run the decode plan's layer loop in Python (engine.kernels.cpu.decode_step off), for "
                        "comparison")
    a = p.parse_args(argv)
    if a.quick:
        a.quantizations, a.batches, a.new_tokens, a.rounds = "int8", "1,8", 32, 2
    a.quantizations = ["none"] + [q for q in a.quantizations.split(",") if q and q != "none"]
    a.batches = [int(b) for b in a.batches.split(",")]
    a.out_dir = _common.out_dir(a.out_dir, a.quick, "quant-decode-")
    return a


def _interleaved(models: dict, cfg, prompts: list[list[int]], prefilled: dict, new_tokens: int, first: int,
                 decode_plan: bool = True, layer_loop: str = "c++") -> dict:
    """One decode of ``prompts`` per model, their steps interleaved (model ``first`` first, then the next...):
    each model's step ``i`` runs right after the other models' step ``i``, so a change in the machine's
    speed lasting longer than a few steps reaches every model alike. Step wall times (s) and tokens per model."""
    names = list(models)
    names = names[first % len(names):] + names[:first % len(names)]
    batches = {q: _decode_ours._admitted_batch(models[q], cfg, prompts, prefilled[q], new_tokens, BLOCK_SIZE,
                                               decode_plan, layer_loop)
               for q in names}
    steps: dict[str, list[float]] = {q: [] for q in names}
    live = set(names)
    while live:
        for q in names:
            if q not in live:
                continue
            t0 = time.perf_counter()
            ran = batches[q][1].step(block=False)
            if not ran:
                live.discard(q)
                continue
            steps[q].append(time.perf_counter() - t0)
    tokens: dict[str, list[list[int]]] = {}
    for q in names:
        events = [_decode_ours._drain(s) for s in batches[q][2]]
        if any(not isinstance(ev, Tokens) for evs in events for ev in evs):
            raise RuntimeError(f"{q}: a request failed: {events}")
        tokens[q] = [[t for ev in evs for t in ev.token_ids] for evs in events]
        if len(steps[q]) != new_tokens - 1 or any(len(t) != new_tokens for t in tokens[q]):
            raise RuntimeError(f"{q}: expected {new_tokens} tokens in {new_tokens - 1} steps, got {len(steps[q])}")
    return {"steps": steps, "tokens": tokens}


def run_point(models: dict, cfg, prompts: list[list[int]], new_tokens: int, rounds: int,
              decode_plan: bool = True, layer_loop: str = "c++") -> dict:
    """``rounds`` interleaved decodes of ``prompts`` by every model (:func:`_interleaved`, starting model
    rotating), then one plain :func:`_decode_ours.measure_decode` per model for the step's parts. Per model:
    TPOT p50 of each round (ms), the best round, the speed-up over float32 (best rounds) and the median over
    steps of the paired ratio (float32 step i / this model's step i, every round). ``decode_plan`` False: decode
    steps through the models' modules; ``layer_loop`` ``"python"``: the decode plan's layer loop in Python
    (:func:`_decode_ours._admitted_batch`)."""
    prefilled = {q: _decode_ours.prefill_kv(m, cfg, prompts, BLOCK_SIZE) for q, m in models.items()}
    rounds_out = [_interleaved(models, cfg, prompts, prefilled, new_tokens, r, decode_plan, layer_loop)
                  for r in range(rounds)]
    ref_tokens = rounds_out[0]["tokens"]["none"]
    out = {}
    for q in models:
        tpots = [statistics.median(r["steps"][q]) * 1e3 for r in rounds_out]
        paired = [a / b for r in rounds_out for a, b in zip(r["steps"]["none"], r["steps"][q])]
        parts = _decode_ours.measure_decode(models[q], cfg, prompts, prefilled[q], new_tokens, BLOCK_SIZE,
                                            decode_plan=decode_plan, layer_loop=layer_loop)
        out[q] = {"tpot_ms": min(tpots), "tpot_ms_runs": tpots, "tokens_per_s": len(prompts) / min(tpots) * 1e3,
                  "median_ms": parts["median_ms"], "paired_speedup_vs_fp32": statistics.median(paired),
                  "identical_to_fp32": sum(a == c for a, c in zip(rounds_out[0]["tokens"][q], ref_tokens))}
    for q in models:
        out[q]["speedup_vs_fp32"] = out["none"]["tpot_ms"] / out[q]["tpot_ms"]
    return out


def run(args) -> dict:
    from transformers import AutoTokenizer

    from common.model_config import ModelConfig
    from engine.model import load_model
    from engine.model_loader import resolve_model_source

    torch.set_num_threads(args.threads)
    model_dir, gguf = resolve_model_source(args.model)
    cfg = ModelConfig.from_hf_folder(model_dir, name=args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    models = {q: load_model(cfg, torch.device("cpu"), torch.float32, quantization=q, gguf_path=gguf)
              for q in args.quantizations}
    res = {"benchmark": "quant_decode", "quick": args.quick, "model": args.model, "cpu": _common.cpu_name(),
           "threads": args.threads, "torch": torch.__version__, "context": args.context,
           "decode_plan": not args.no_decode_plan, "layer_loop": _layer_loop(args),
           "new_tokens": args.new_tokens, "rounds": args.rounds, "quantizations": args.quantizations,
           "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "load_avg_1m_start": _common.load_avg_1m(), "copy_GBps_start": _common.copy_bandwidth_GBps(),
           "points": []}
    t0 = time.perf_counter()
    prompts_all = _common.sonnet_prompts(tokenizer, max(args.batches), args.context)
    for b in args.batches:
        load = _common.load_avg_1m()
        log(f"batch {b}, load {load:.2f}")
        point = run_point(models, cfg, prompts_all[:b], args.new_tokens, args.rounds, not args.no_decode_plan,
                          _layer_loop(args))
        res["points"].append({"batch_size": b, "load_avg_1m_before": load, "models": point})
        log("  " + ", ".join(f"{q} {v['tpot_ms']:.1f} ms ({v['speedup_vs_fp32']:.2f}x)" for q, v in point.items()))
    res["load_avg_1m_end"], res["duration_s"] = _common.load_avg_1m(), time.perf_counter() - t0
    return res


def _layer_loop(args) -> str:
    return "python" if args.python_layer_loop else "c++"


def markdown(res: dict) -> str:
    qs = [q for q in res["quantizations"] if q != "none"]
    loop = {"c++": ", its layer loop in C++ (`engine/kernels/cpu/decode_step.py`)",
            "python": ", its layer loop in Python (`--python-layer-loop`)"}.get(res.get("layer_loop"), "")
    steps = (f"the runner's decode plan (`engine/model/decode_plan.py`){loop}" if res.get("decode_plan", True)
             else "the model's modules (`--no-decode-plan`)")
    head = ["batch", "load 1m", "fp32 TPOT ms (runs)"] + [f"{q} TPOT ms (runs)" for q in qs] + \
        [f"{q} / fp32 speed (paired)" for q in qs] + [f"{q} identical to fp32" for q in qs]
    lines = [f"# Quantized vs float32 decode, one run: {res['model']}", "",
             f"Run {res['started_at']}, {res['duration_s'] / 60:.1f} min; {res['cpu']}, {res['threads']} threads, "
             f"torch {res['torch']}. Context {res['context']} tokens, {res['new_tokens']} new tokens (greedy, EOS "
             f"ignored), {res['rounds']} runs per point, each decoding the batch with every model, their steps "
             f"interleaved (step i of each model, then step i + 1...; the first model rotating); TPOT = median "
             f"decode step of a run, the best run shown, every run's in parentheses; speed = fp32's best TPOT / "
             f"the model's, paired = the median over all steps of fp32's step i / the model's step i. Copy "
             f"bandwidth at the start "
             f"{res['copy_GBps_start']:.1f} GB/s; 1-minute load average {res['load_avg_1m_start']:.2f} at the start, "
             f"{res['load_avg_1m_end']:.2f} at the end. Decode steps: {steps}.", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for p in res["points"]:
        m = p["models"]

        def runs(q):
            return f"{m[q]['tpot_ms']:.1f} ({', '.join(f'{t:.1f}' for t in m[q]['tpot_ms_runs'])})"
        row = [str(p["batch_size"]), f"{p['load_avg_1m_before']:.2f}", runs("none")] + [runs(q) for q in qs] + \
            [f"{m[q]['speedup_vs_fp32']:.2f}x ({m[q]['paired_speedup_vs_fp32']:.2f}x)" for q in qs] + \
            [f"{m[q]['identical_to_fp32']}/{p['batch_size']}" for q in qs]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Decode step parts (one plain run per model after the interleaved ones, median ms: forward = decoder "
              "layers, LM head, overhead = the rest of the step):",
              "", "| batch | model | step | forward | LM head | overhead |", "|---:|---|---:|---:|---:|---:|"]
    for p in res["points"]:
        for q, v in p["models"].items():
            md = v["median_ms"]
            lines.append(f"| {p['batch_size']} | {q} | {md['step']:.2f} | {md['forward']:.2f} | {md['lm_head']:.2f} | "
                         f"{md['overhead']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parse(argv)
    res = run(args)
    _, text = _common.write_results(res, args.out_dir, args.name, markdown)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

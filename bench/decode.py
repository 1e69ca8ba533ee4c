"""Decode throughput of SmolLM2-135M (float32, CPU): our decode worker's engine against the
memory-bandwidth floor, HF ``transformers`` ``generate`` and (optionally) vLLM's CPU build.

Measured in one run on one machine:

(a) the machine: copy bandwidth (a 512 MiB float32 ``copy_``, bytes read + written) and
    float32 GEMM GFLOP/s (``torch.mm``, n = 2048), at the start and the bandwidth again
    before every point;
(b) ours: greedy decode through :class:`decode_worker.scheduler.DecodeScheduler` with the
    prompts' KV delivered by a local prefill (``bench/_decode_ours.py``): tokens/s, TPOT,
    and each step split into model forward (decoder + LM head) and overhead (metadata,
    sampling, the rest of the runner, the scheduler), plus the per-token cost of streaming
    and detokenization after the step;
(c) HF ``generate`` on the same weights, prompts, batch and lengths (``bench/_decode_hf.py``);
(d) with ``--vllm-python``, vLLM offline inference on the same weights, prompts, batch and
    lengths in its own virtual environment (``bench/_decode_vllm.py``).

Per point (batch size x context length; ``new_tokens`` greedy tokens, EOS ignored; the
first token comes from the prefill, so TPOT is the mean of the ``new_tokens - 1`` decode
steps): tokens/s, TPOT (ms) and the ratios ours / bandwidth floor (floor = (weights + KV
bytes read per step) / measured bandwidth, as tokens/s), ours / HF and ours / vLLM (tokens/s).

Writes ``<name>.json`` (one record per point) and ``<name>.md`` under ``--out-dir`` and prints
the JSON to stdout (progress goes to stderr). ``--quick`` runs batch 1 and 32 at context 128
and writes ``decode_quick.*`` to a temporary folder unless ``--out-dir`` is given.

Usage::

    python bench/decode.py --quick
    python bench/decode.py --vllm-python VLLM_VENV/bin/python
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import _decode_hf
import _decode_ours
import _decode_report
import torch
from _decode_llamacpp import LlamaCppError, LlamaCppPeer
from _decode_vllm import VllmError, VllmPeer

from engine.config import QUANTIZATIONS
from engine.model.linear import dense_weights

import _common

BLOCK_SIZE = 16
VLLM_BUDGET = ("1 OpenMP model thread bound to core 0; core 1 reserved for its engine-core scheduler and "
               "front end (vLLM's CPU default on this 2-core machine)")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 1 and 32 at context 128 (< 5 min without vLLM)")
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--contexts", default="128,1024", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--new-tokens-long", type=int, default=None,
                   help="tokens generated at contexts >= 1024 (default: --new-tokens)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for ours and HF")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (engine.model_loader)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate")
    p.add_argument("--linear-backend", default=None,
                   help="our engine's linear backend (engine.model.linear.LINEAR_BACKENDS; default: the engine's)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="our engine's weights; HF and vLLM stay float32")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--llamacpp-server", default=None,
                   help="a llama-server binary: llama.cpp as a peer on the model's own GGUF (bench/_decode_llamacpp.py)")
    p.add_argument("--rounds", type=int, default=None,
                   help="runs of each engine per point, interleaved in rotating order; the best run "
                        "counts (default 2, 1 with --quick)")
    p.add_argument("--profile-steps", type=int, default=6,
                   help="decode steps profiled with torch.profiler at batch 1 and 32 of every "
                        "context (0 = no profile)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where to write <name>.json and .md (default bench/results; a temporary folder "
                        "with --quick)")
    p.add_argument("--name", default=None, help="output file stem (default decode, decode_quick)")
    p.add_argument("--render", type=Path, default=None,
                   help="measure nothing: re-render the markdown next to this result JSON (with --notes)")
    p.add_argument("--notes", type=Path, default=None,
                   help="with --render: a markdown file stored as the result's hand-written analysis")
    a = p.parse_args(argv)
    if a.quick:
        a.batches, a.contexts = "1,32", "128"
    a.rounds = a.rounds or (1 if a.quick else 2)
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.name = a.name or ("decode_quick" if a.quick else "decode")
    a.out_dir = _common.out_dir(a.out_dir, a.quick, "decode-bench-")
    return a


log = _common.logger("decode")


def _new_tokens(args, ctx: int) -> int:
    return args.new_tokens_long if (ctx >= 1024 and args.new_tokens_long) else args.new_tokens


def _weights(model) -> dict:
    """Weights read by a step, by name: the decoder's and the LM head's (the token embedding is a
    row lookup, read whole only where it is the tied LM head itself)."""
    w = dense_weights(model)
    if "lm_head.weight" in w:  # an LM head of its own (untied, or a packed / quantized copy)
        w.pop("model.embed_tokens.weight", None)
    return w


def model_stats(model, cfg) -> dict:
    """Bytes of the weights (as stored: quantized ones at their size), weights in matmuls, KV bytes
    and attention flops per context token."""
    weights = _weights(model)
    # bytes as stored: a packed or quantized layer's own count (int8: 1 B per weight + its scales)
    stored = {f"{n}.weight": m.weight_nbytes for n, m in model.named_modules() if hasattr(m, "weight_nbytes")}
    weight_bytes = sum(stored.get(n, p.numel() * p.element_size()) for n, p in weights.items())
    num_params = sum(p.numel() for p in weights.values() if p.dim() == 2)
    return {"weight_bytes": weight_bytes, "matmul_params": num_params,
            "kv_bytes_per_token": cfg.kv_bytes_per_token(4),
            "attn_flops_per_ctx_token": 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim}


PEERS = ("vllm", "llamacpp")
"""Peer engines, each a process of its own with ``run_point(batch, context, new_tokens, prompts)``."""


def _run_engine(engine: str, model, cfg, hf, peers, prompts, prefilled, new_tokens) -> dict:
    if engine == "ours":
        return _decode_ours.measure_decode(model, cfg, prompts, prefilled, new_tokens, BLOCK_SIZE)
    if engine == "hf":
        return _decode_hf.measure_hf(hf, prompts, prefilled, new_tokens)
    try:
        return peers[engine].run_point(len(prompts), len(prompts[0]), new_tokens, prompts)
    except (VllmError, LlamaCppError, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def run_point(model, cfg, hf, tokenizer, prompts, prefilled, new_tokens, stats, peers=None,
              rounds: int = 1, no_hf: bool = False, copy_bytes: int = 512 << 20, gemm_n: int = 2048) -> dict:
    """Measure one (batch, context) point: the machine now (copy bandwidth of ``copy_bytes``,
    one-row linear rate, GEMM rate at ``gemm_n``, ``F.linear`` vs oneDNN at this batch), then
    ``rounds`` runs of each engine (ours, HF unless ``no_hf``, each of ``peers``) interleaved
    in rotating order; each engine's best run (lowest p50 TPOT) gives its numbers."""
    b, ctx = len(prompts), len(prompts[0])
    mats = [p for p in _weights(model).values() if p.dim() == 2]
    bw = _common.copy_bandwidth_GBps(copy_bytes)
    gemv = _common.linear_stream_GBps(mats)
    gemm = _common.gemm_GFLOPs(gemm_n, reps=3)
    variants = _common.linear_variants(mats, b)
    load = _common.load_avg_1m()
    peers = peers or {}
    engines = ["ours"] + ([] if no_hf else ["hf"]) + list(peers)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(rounds):
        for e in engines[r % len(engines):] + engines[:r % len(engines)]:
            runs[e].append(_run_engine(e, model, cfg, hf, peers, prompts, prefilled, new_tokens))
    best = {e: min((x for x in rs if "error" not in x), key=lambda x: x["tpot_ms"], default=None)
            for e, rs in runs.items()}
    ours, hf_res = best["ours"], best.get("hf")
    stream = _decode_ours.stream_costs(tokenizer, prompts, ours.pop("events"))
    for x in runs["ours"]:
        x.pop("events", None)
    floors = _common.decode_floors(stats["weight_bytes"], stats["matmul_params"], stats["kv_bytes_per_token"],
                                   stats["attn_flops_per_ctx_token"], b, ctx + new_tokens / 2, bw, gemm)
    kv_ms = (floors["bytes_per_step"] - stats["weight_bytes"]) / bw / 1e6
    linear_floor_ms = stats["weight_bytes"] / gemv / 1e6 + kv_ms  # weights at torch's one-row linear rate
    tps = ours["tokens_per_s"]
    strip = lambda x: None if x is None else {k: v for k, v in x.items() if k != "token_ids"}  # noqa: E731
    rec = {
        "batch_size": b, "context_len": ctx, "new_tokens": new_tokens,
        "tokens_per_s": tps, "tpot_ms": ours["tpot_ms"],
        "ratio_bandwidth_floor": floors["bandwidth_floor_ms"] / ours["tpot_ms"],
        "ratio_linear_floor": linear_floor_ms / ours["tpot_ms"],
        "ratio_roofline": floors["roofline_floor_ms"] / ours["tpot_ms"],
        "ratio_hf": tps / hf_res["tokens_per_s"] if hf_res else None,
        "load_avg_1m": load, "load_avg_1m_after": _common.load_avg_1m(), "copy_GBps_at_point": bw,
        "linear_GBps_at_point": gemv, "gemm_GFLOPs_at_point": gemm, "linear_variants_at_point": variants,
        "linear_floor_ms": linear_floor_ms,
        "bandwidth_floor_tokens_per_s": b / floors["bandwidth_floor_ms"] * 1e3, **floors,
        "rounds_tpot_ms": {e: [x.get("tpot_ms") for x in rs] for e, rs in runs.items()},
        "ours": strip(ours) | stream, "hf": strip(hf_res),
        "greedy_agreement_hf": _common.greedy_agreement(ours["token_ids"], hf_res and hf_res["token_ids"]),
    }
    for name in PEERS:
        res = best.get(name)
        rec |= {name: strip(res), f"ratio_{name}": tps / res["tokens_per_s"] if res else None,
                f"{name}_errors": [x["error"] for x in runs.get(name, []) if "error" in x],
                f"greedy_agreement_{name}": _common.greedy_agreement(ours["token_ids"], res and res["token_ids"])}
    rec["ours"].update(stream_overhead(rec["ours"], b))
    return rec


def stream_overhead(ours: dict, batch_size: int) -> dict:
    """Median step overhead plus the per-step cost of streaming and detokenizing ``batch_size``
    tokens (``overhead_with_stream_ms``) and its share of the step plus that cost."""
    med = ours["median_ms"]
    per_step_ms = (ours["worker_stream_us_per_token"] + ours["router_detok_stream_us_per_token"]) * batch_size / 1e3
    with_stream = med["overhead"] + per_step_ms
    return {"overhead_with_stream_ms": with_stream, "overhead_with_stream_share": with_stream / (med["step"] + per_step_ms),
            "overhead_share_median": med["overhead"] / med["step"]}


def _start_vllm(args, model_dir) -> tuple[VllmPeer | None, str | None]:
    if not args.vllm_python:
        return None, None
    log_path = Path(tempfile.mkdtemp(prefix="decode-vllm-")) / "vllm.log"
    log(f"starting vLLM (model load + compilation, ~2 min); its log: {log_path}")
    try:
        return VllmPeer(args.vllm_python, str(model_dir), 2048, log_path), None
    except VllmError as e:
        log(f"vLLM failed: {e}")
        return None, str(e)


def _start_llamacpp(args, gguf) -> tuple[LlamaCppPeer | None, str | None]:
    if not args.llamacpp_server:
        return None, None
    if gguf is None:
        return None, f"{args.model} has no GGUF file for llama.cpp"
    log_path = Path(tempfile.mkdtemp(prefix="decode-llamacpp-")) / "llama-server.log"
    log(f"starting llama-server on {gguf.name}; its log: {log_path}")
    longest = max(args.contexts) + max(args.new_tokens, args.new_tokens_long or 0) + 16
    try:
        return LlamaCppPeer(args.llamacpp_server, gguf, args.threads, max(args.batches), longest, log_path), None
    except LlamaCppError as e:
        log(f"llama.cpp failed: {e}")
        return None, str(e)


def _profiles(args, model, cfg, hf, prompts, prefilled) -> list[dict]:
    n = args.profile_steps
    out = []
    for b in (1, 32):
        if b > len(prompts):
            continue
        p, pre = prompts[:b], prefilled[:b]
        ours: dict = {"engine": "ours", "batch_size": b, "context_len": len(p[0]), "steps": n}
        _decode_ours.measure_decode(model, cfg, p, pre, n + 1, BLOCK_SIZE, _common.op_profile(ours, n))
        out.append(ours)
        if not args.no_hf:
            h: dict = {"engine": "hf", "batch_size": b, "context_len": len(p[0]), "steps": n + 1}
            _decode_hf.measure_hf(hf, p, pre, n + 1, _common.op_profile(h, n + 1))  # its first step decodes too
            out.append(h)
    return out


def save(res: dict, out_dir: Path, name: str) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` (targets recomputed); returns the stem."""
    res["targets"] = _decode_report.targets(res)
    return _common.write_results(res, out_dir, name, _decode_report.markdown)[0]


def run(args) -> dict:
    """The whole benchmark; results are saved after every point (``complete`` false until the end)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.model_config import ModelConfig
    from engine.model import default_linear_backend, load_model
    from engine.model_loader import resolve_model_source

    torch.set_num_threads(args.threads)
    t_start, load_start = time.perf_counter(), _common.load_avg_1m()
    model_dir, gguf = resolve_model_source(args.model)
    cfg = ModelConfig.from_hf_folder(model_dir, name=args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backend = args.linear_backend or default_linear_backend(torch.device("cpu"), torch.float32)
    model = load_model(cfg, torch.device("cpu"), torch.float32, linear_backend=backend,
                       quantization=args.quantization, gguf_path=gguf)
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stats = model_stats(model, cfg)
    log(f"machine rates, load {load_start:.2f}")
    bw, gemm = _common.copy_bandwidth_GBps(), _common.gemm_GFLOPs()
    gemv = _common.linear_stream_GBps([p for p in _weights(model).values() if p.dim() == 2])
    log(f"copy {bw:.1f} GB/s, GEMM {gemm:.1f} GFLOP/s, one-row linear {gemv:.1f} GB/s")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    peer, vllm_start_error = _start_vllm(args, model_dir)
    llama, llamacpp_start_error = _start_llamacpp(args, gguf)
    peers = {name: p for name, p in zip(PEERS, (peer, llama)) if p is not None}
    res = {
        "benchmark": "decode", "complete": False, "quick": args.quick, "model": args.model,
        "model_dir": str(model_dir), "dtype": "float32", "device": "cpu", "cpu": _common.cpu_name(),
        "cpu_count": os.cpu_count(), "linear_backend": backend,
        "quantization": args.quantization, "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": peer.info["vllm"] if peer else None, "block_size": BLOCK_SIZE, "rounds": args.rounds,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "thread_budget": {"ours": f"{args.threads} torch intra-op threads (one process)",
                          "hf": f"{args.threads} torch intra-op threads (same process)",
                          "vllm": VLLM_BUDGET if args.vllm_python else None,
                          "llamacpp": f"-t {args.threads} -tb {args.threads}" if args.llamacpp_server else None},
        "machine": {"copy_GBps": bw, "copy_bytes": 512 << 20, "gemm_GFLOPs": gemm, "gemm_n": 2048,
                    "linear_GBps": gemv},
        **stats, "load_avg_1m_start": load_start, "load_avg_1m_end": None,
        "points": [], "vllm_start_error": vllm_start_error, "vllm_info": peer.info if peer else None,
        "llamacpp_start_error": llamacpp_start_error, "llamacpp_info": llama.info if llama else None,
        "profiles": [], "duration_s": None,
    }

    def checkpoint() -> None:
        res["load_avg_1m_end"] = _common.load_avg_1m()
        res["duration_s"] = time.perf_counter() - t_start
        save(res, args.out_dir, args.name)

    try:
        _sweep(args, res, checkpoint, model, cfg, hf, tokenizer, stats, peers)
    finally:
        for p in peers.values():
            p.close()
    res["complete"] = True
    checkpoint()
    return res


def _sweep(args, res: dict, checkpoint, model, cfg, hf, tokenizer, stats: dict, peers: dict) -> None:
    """Every (context, batch) point, in order, saving after each."""
    for ctx in args.contexts:
        prompts = _common.sonnet_prompts(tokenizer, max(args.batches), ctx)
        log(f"prefill {len(prompts)} x {ctx} tokens")
        prefilled = _decode_ours.prefill_kv(model, cfg, prompts, BLOCK_SIZE)
        _decode_ours.measure_decode(model, cfg, prompts[:2], prefilled[:2], 4, BLOCK_SIZE)  # warm-up
        if not args.no_hf:
            _decode_hf.measure_hf(hf, prompts[:2], prefilled[:2], 4)
        for b in args.batches:
            nt = _new_tokens(args, ctx)
            log(f"point batch {b} context {ctx} new {nt}, load {_common.load_avg_1m():.2f}")
            rec = run_point(model, cfg, hf, tokenizer, prompts[:b], prefilled[:b], nt, stats, peers,
                            args.rounds, args.no_hf)
            res["points"].append(rec)
            checkpoint()
            log(f"  ours {rec['tokens_per_s']:.1f} tok/s ({rec['tpot_ms']:.1f} ms), "
                f"floor x{rec['ratio_bandwidth_floor']:.2f}, HF x{rec['ratio_hf'] or float('nan'):.2f}, "
                f"vLLM x{rec['ratio_vllm'] or float('nan'):.2f}, llama.cpp x{rec['ratio_llamacpp'] or float('nan'):.2f}; "
                f"rounds {rec['rounds_tpot_ms']}")
        if args.profile_steps:
            log("profiling")
            res["profiles"] += _profiles(args, model, cfg, hf, prompts, prefilled)
        del prefilled
        gc.collect()


def main(argv=None) -> int:
    args = _parse(argv)
    if args.render:
        res = json.loads(args.render.read_text())
        for p in res["points"]:
            p["ours"].update(stream_overhead(p["ours"], p["batch_size"]))
        res["targets"] = _decode_report.targets(res)  # as the report declares them now
        if args.notes:
            res["analysis"] = args.notes.read_text()
        log(f"rendered {save(res, args.render.parent, args.render.stem)}.md")
        return 0
    res = run(args)
    log(f"wrote {args.out_dir / args.name}.json and .md in {res['duration_s']:.0f} s")
    sys.stdout.write(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

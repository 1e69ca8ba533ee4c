"""Weight-streaming rate of the CPU linear kernels at decode row counts, over SmolLM2-135M's
matrices (float32 ``[out, in]``: per layer q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536; 30 layers; the tied LM head 49152x576; random values, only the sizes matter).

Measured in one run, at each thread count (``torch.set_num_threads``):

(a) the machine: copy bandwidth (a 512 MiB float32 ``copy_``, bytes read + written, as
    ``bench/decode.py``) and read bandwidth (``torch.sum`` of the same tensor, bytes read);
(b) one pass of ``rows``-row inputs over every matrix with each variant: ``F.linear`` (MKL),
    oneDNN prepacked (``PackedLinear``'s ops), oneDNN on the plain weight, this project's fp32
    GEMV kernel (``csrc/gemv.cpp``), its panel GEMM (``csrc/panel_gemm.cpp``), the int8 kernel (int8 activations too:
    ``csrc/w8a8_gemm.cpp``) and the Q4_1 kernel (int8 activations too: ``csrc/w4a8_gemm.cpp``),
    alternating the variants ``--reps`` times and keeping each one's fastest pass (a shared
    machine only ever slows a pass down).

Per (threads, rows, variant): ms per pass (wall; at 1 thread also the calling thread's CPU
time, which a busy machine's time slicing does not inflate), GB/s of the weight bytes the variant streams
(float32 4 B, int8 1 B + a 4-byte scale and a 4-byte weight sum per 64, Q4_1 0.5 B + 4-byte d and m per 32), its ratio to the copy
bandwidth, speed-up over ``F.linear`` and the max abs difference from ``F.linear`` (fp32
variants). The 1-minute load average is recorded per thread count: the machine is shared.

Writes ``gemv.json`` / ``gemv.md`` to ``--out-dir`` (default ``bench/results``; a temporary
folder with ``--quick``, which times 6 layers + the LM head and fewer rows) and prints the JSON.

Usage::

    python bench/gemv.py --quick
    python bench/gemv.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.kernels.cpu import panel_gemm, quant_ops
from engine.kernels.cpu.build import load
from engine.model.quant import Int8Linear, Q4Linear

import _common

HIDDEN, INTER, VOCAB, KV_DIM, LAYERS = 576, 1536, 49152, 192, 30
LAYER_SHAPES = ((HIDDEN, HIDDEN), (KV_DIM, HIDDEN), (KV_DIM, HIDDEN), (HIDDEN, HIDDEN),
                (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
FP32_VARIANTS = ("f_linear", "onednn_packed", "onednn_plain", "gemv_f32", "panel_f32")

log = _common.logger("gemv")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 layers + LM head, rows 1,8, 3 reps")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--rows", default=None, help="comma-separated input row counts (default 1,2,4,8,16,64,256; "
                                                "1,8 with --quick)")
    p.add_argument("--quant-max-rows", type=int, default=16, help="quantized kernels timed up to this row count")
    p.add_argument("--reps", type=int, default=None, help="alternating passes per variant (default 7, 3 quick)")
    p.add_argument("--out-dir", type=Path, default=None, help="default bench/results (temporary with --quick)")
    a = p.parse_args(argv)
    a.layers = 6 if a.quick else LAYERS
    a.rows = a.rows or ("1,8" if a.quick else "1,2,4,8,16,64,256")
    a.reps = a.reps or (3 if a.quick else 7)
    a.threads = [int(t) for t in a.threads.split(",")]
    a.rows = [int(r) for r in a.rows.split(",")]
    a.out_dir = _common.out_dir(a.out_dir, a.quick, "gemv-bench-")
    return a


def make_weights(layers: int) -> dict:
    """Every matrix in each format: ``f32`` dense, ``packed`` (oneDNN), ``int8`` (q, scale),
    ``q4_1`` (qs, d, m), with the bytes each format streams per pass."""
    g = torch.Generator().manual_seed(0)
    f32 = [torch.randn(n, k, generator=g) * 0.05 for _ in range(layers) for n, k in LAYER_SHAPES]
    f32.append(torch.randn(VOCAB, HIDDEN, generator=g) * 0.05)
    out = {"f32": f32, "bytes": {}}
    out["bytes"]["fp32"] = sum(w.numel() * 4 for w in f32)
    if _common_onednn():
        out["packed"] = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in f32]
    if panel_gemm.available():
        out["panels"] = [panel_gemm.pack(w) for w in f32]
    out["int8"] = [quant_ops.quantize_int8(w) for w in f32]
    out["int8_packed"] = [(quant_ops.pack_int8(q, s), q.shape[0]) for q, s in out["int8"]]
    out["q4_1"] = [quant_ops.quantize_q4_1(w) for w in f32]
    out["q4_1_packed"] = [(quant_ops.pack_q4_1(*t), t[0].shape[0]) for t in out["q4_1"]]
    out["bytes"]["int8"] = sum(Int8Linear(*w, None).weight_nbytes for w in out["int8"])
    out["bytes"]["q4_1"] = sum(Q4Linear(*w, None).weight_nbytes for w in out["q4_1"])
    return out


def _common_onednn() -> bool:
    from engine.model.linear import onednn_available
    return onednn_available()


def variants(w: dict, rows: int, quant: bool) -> dict:
    """Name -> (format, zero-argument pass over every matrix) for the variants available here."""
    g, q, w8 = load("gemv"), load("w4a8_gemm"), load("w8a8_gemm")
    xs = [torch.randn(rows, m.shape[1]) for m in w["f32"]]
    mk = torch.ops.mkldnn
    fl = torch.nn.functional.linear
    out = {"f_linear": ("fp32", lambda: [fl(x, m) for x, m in zip(xs, w["f32"])])}
    if "packed" in w:
        out["onednn_packed"] = ("fp32", lambda: [mk._linear_pointwise(x, p, None, "none", [], "")
                                                 for x, p in zip(xs, w["packed"])])
        out["onednn_plain"] = ("fp32", lambda: [mk._linear_pointwise(x, m, None, "none", [], "")
                                                for x, m in zip(xs, w["f32"])])
    if g is not None:
        out["gemv_f32"] = ("fp32", lambda: [g.linear_f32(x, m) for x, m in zip(xs, w["f32"])])
    if "panels" in w:
        pg = load(panel_gemm.NAME)
        out["panel_f32"] = ("fp32", lambda: [pg.linear(x, p, m.shape[0]) for x, p, m in zip(xs, w["panels"], w["f32"])])
    if w8 is not None and quant:
        out["int8"] = ("int8", lambda: [w8.linear_w8a8(x, *p, n) for x, (p, n) in zip(xs, w["int8_packed"])])
    if q is not None and quant:
        out["q4_1"] = ("q4_1", lambda: [q.linear_w4a8(x, *p, n) for x, (p, n) in zip(xs, w["q4_1_packed"])])
    return out


def time_point(w: dict, rows: int, reps: int, copy_GBps: float, quant: bool) -> list[dict]:
    """Best-of-``reps`` ms per pass of every variant at ``rows`` rows, with rates and ratios."""
    vs = variants(w, rows, quant)
    with torch.inference_mode():
        ref = vs["f_linear"][1]()
        diffs = {n: max(float((a - b).abs().max()) for a, b in zip(ref, fn()))
                 for n, (fmt, fn) in vs.items() if fmt == "fp32"}
        best, cpu = dict.fromkeys(vs, float("inf")), dict.fromkeys(vs, float("inf"))
        for _ in range(reps):
            for name, (_, fn) in vs.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
                cpu[name] = min(cpu[name], time.thread_time() - c0)
    single = torch.get_num_threads() == 1
    out = []
    for name, (fmt, _) in vs.items():
        gbps = w["bytes"][fmt] / best[name] / 1e9
        out.append({"rows": rows, "variant": name, "format": fmt, "ms": best[name] * 1e3, "weight_GBps": gbps,
                    "cpu_ms": cpu[name] * 1e3 if single else None,
                    "cpu_weight_GBps": w["bytes"][fmt] / cpu[name] / 1e9 if single else None,
                    "ratio_copy_bandwidth": gbps / copy_GBps, "speedup_vs_f_linear": best["f_linear"] / best[name],
                    "max_abs_diff_vs_f_linear": diffs.get(name)})
    return out


def read_bandwidth_GBps(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Read-only memory bandwidth: bytes / median seconds of ``torch.sum`` of a float32 tensor."""
    src = torch.ones(nbytes // 4)
    return nbytes / _common._median_time_s(lambda: src.sum(), reps) / 1e9


def run(args) -> dict:
    """Measure every thread count; returns the result record."""
    t_start = time.time()
    w = make_weights(args.layers)
    res = {"benchmark": "gemv", "quick": args.quick, "layers": args.layers, "cpu": _common.cpu_name(),
           "torch": torch.__version__, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "weight_bytes": w["bytes"], "kernels_built": {k: load(k) is not None for k in ("gemv", "w8a8_gemm", "w4a8_gemm", panel_gemm.NAME)},
           "per_threads": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        rec = {"threads": threads, "load_avg_1m_before": _common.load_avg_1m(),
               "copy_GBps": _common.copy_bandwidth_GBps(), "read_GBps": read_bandwidth_GBps(), "points": []}
        log(f"{threads} thread(s): copy {rec['copy_GBps']:.1f} GB/s, read {rec['read_GBps']:.1f} GB/s, "
            f"load {rec['load_avg_1m_before']:.2f}")
        for rows in args.rows:
            rec["points"] += time_point(w, rows, args.reps, rec["copy_GBps"], rows <= args.quant_max_rows)
        rec["load_avg_1m_after"] = _common.load_avg_1m()
        res["per_threads"].append(rec)
    res["duration_s"] = time.time() - t_start
    return res


def markdown(res: dict) -> str:
    """The result as a markdown report: one table per thread count."""
    lines = [f"# CPU linear kernels at decode row counts: SmolLM2-135M matrices ({res['layers']} layers + LM head)",
             "", f"Run {res['started']}, {res['duration_s']:.0f} s; {res['cpu']}; torch {res['torch']}. Weights "
             f"streamed per pass: fp32 {res['weight_bytes']['fp32'] / 1e6:.0f} MB, int8 "
             f"{res['weight_bytes']['int8'] / 1e6:.0f} MB, Q4_1 {res['weight_bytes']['q4_1'] / 1e6:.0f} MB. "
             "Fastest of the alternating passes; GB/s counts the bytes the variant's weight format streams; "
             "ratio = GB/s / copy GB/s (read + write of a 512 MiB `copy_`) measured in the same run.", ""]
    for rec in res["per_threads"]:
        lines += [f"## {rec['threads']} thread(s)", "",
                  f"Copy bandwidth {rec['copy_GBps']:.1f} GB/s, read bandwidth (`torch.sum`) {rec['read_GBps']:.1f}"
                  f" GB/s; 1-minute load average {rec['load_avg_1m_before']:.2f} before, "
                  f"{rec['load_avg_1m_after']:.2f} after.", "",
                  "| rows | variant | format | ms / pass | weight GB/s | / copy bw | vs F.linear | CPU ms | CPU GB/s "
                  "| max abs diff |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for p in rec["points"]:
            diff = "" if p["max_abs_diff_vs_f_linear"] is None else f"{p['max_abs_diff_vs_f_linear']:.1e}"
            lines.append(f"| {p['rows']} | {p['variant']} | {p['format']} | {p['ms']:.2f} | {p['weight_GBps']:.1f} "
                         f"| {p['ratio_copy_bandwidth']:.2f} | {p['speedup_vs_f_linear']:.2f}x "
                         f"| {_num(p['cpu_ms'], 2)} "
                         f"| {_num(p['cpu_weight_GBps'], 1)} | {diff} |")
        lines.append("")
    return "\n".join(lines)


def _num(v: float | None, digits: int) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def main(argv=None) -> int:
    args = _parse(argv)
    res = run(args)
    stem, text = _common.write_results(res, args.out_dir, "gemv_quick" if args.quick else "gemv", markdown)
    print(text)
    log(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

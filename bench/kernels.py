"""Benchmark of the Triton paged-attention kernels (engine/kernels/).

Measures, in one run on one device:

* the device's copy bandwidth: a large device-to-device ``copy_`` (bytes read + written);
* a bf16 GEMM rate: ``torch.matmul`` of two square matrices;
* the decode kernel (``paged_decode_attention``) at several (batch, context) points:
  achieved GB/s, where bytes = K/V bytes of every context token + q + out, and its ratio
  to the measured copy bandwidth;
* the varlen prefill kernel (``varlen_prefill_attention``) at several (batch, new tokens,
  cached prefix) points: TFLOP/s of the causal attention (4 * head_dim flops per
  (query, key, head) pair that is not masked) and its ratio to the GEMM rate;
* at every point the ``"sdpa"`` backend (gather + SDPA) on the same step, as a second
  ratio, and the largest difference between the two outputs (a broken kernel is not timed
  as a fast one).

Writes ``kernels_<device>.json`` and ``kernels_<device>.md`` under ``--out-dir``.

``--interpret --quick`` runs tiny shapes on CPU under the Triton interpreter as a smoke
test (float32, the interpreter has no bf16 ``tl.dot``); its numbers are not performance
figures and by default go to a temporary folder.

Usage (CUDA): ``python bench/kernels.py``; smoke test: ``python bench/kernels.py --interpret --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, block 16
FULL = {
    "heads": (32, 8, 128), "block_size": 16, "dtype": "bfloat16",
    "decode": [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (64, 8192), (256, 1024)],
    "prefill": [(1, 4096, 0), (4, 2048, 0), (16, 512, 0), (2, 1024, 3072)],
    "copy_bytes": 2 << 30, "gemm_n": 8192,
}
QUICK = {
    "heads": (4, 2, 64), "block_size": 16, "dtype": "float32",
    "decode": [(2, 100), (1, 600)],  # (1, 600) splits in two on CPU: the reduce runs too
    "prefill": [(2, 40, 0), (1, 16, 20)],
    "copy_bytes": 16 << 20, "gemm_n": 256,
}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true",
                   help="run on CPU under the Triton interpreter (smoke test, no performance figures)")
    p.add_argument("--quick", action="store_true", help="tiny shapes")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where to write the JSON and markdown (default bench/results; a temporary "
                        "folder with --interpret)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of engine.kernels
    import torch

    if not args.interpret and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or use --interpret --quick for a CPU smoke test")
    device = torch.device("cpu" if args.interpret else "cuda")
    cfg = QUICK if args.quick else FULL
    res = run(cfg, device, args.interpret)
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="kernels-bench-")) if args.interpret
                               else REPO / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"kernels_{res['device_tag']}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def _timer(device):
    """``time(fn) -> ms``: median of CUDA-event timings with the L2 flushed between runs
    (``triton.testing.do_bench``; host launch overhead counts where the GPU waits for it)
    on CUDA; the median of two wall-clock runs after one warm-up on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_time(fn):
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_time


def _step(torch, lens, heads, block_size, dtype, device, seed):
    """Random q and a paged cache holding ``lens`` = (num_computed, num_new) per sequence in
    shuffled blocks; returns ``(q, k_cache, v_cache, meta)``."""
    from engine.attention import SeqSlice, build_attention_metadata

    h, kh, d = heads
    g = torch.Generator().manual_seed(seed)
    need = [-(-(nc + nn) // block_size) for nc, nn in lens]
    num_blocks = sum(need) + 1
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    slices, at = [], 0
    for (nc, nn), nb in zip(lens, need):
        slices.append(SeqSlice(nc, nn, order[at:at + nb]))
        at += nb
    k_cache = torch.randn(num_blocks, block_size, kh, d, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kh, d, device=device, dtype=dtype)
    q = torch.randn(sum(nn for _, nn in lens), h, d, device=device, dtype=dtype)
    return q, k_cache, v_cache, build_attention_metadata(slices, block_size, device=device)


def _machine_rates(torch, cfg: dict, device, timer) -> tuple[float, float, object]:
    """Device copy bandwidth (GB/s), GEMM rate (TFLOP/s) and the GEMM dtype (bf16 on CUDA)."""
    n = cfg["copy_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_gbps = 2 * n / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e9
    del src, dst
    m = cfg["gemm_n"]
    gemm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(m, m, device=device, dtype=gemm_dtype)
    b = torch.randn(m, m, device=device, dtype=gemm_dtype)
    gemm_tflops = 2 * m**3 / (timer(lambda: torch.matmul(a, b)) * 1e-3) / 1e12
    return copy_gbps, gemm_tflops, gemm_dtype


def run(cfg: dict, device, interpret: bool) -> dict:
    import torch
    import triton

    from engine.attention import get_attention_backend

    timer = _timer(device)
    dtype = getattr(torch, cfg["dtype"])
    h, kh, d = cfg["heads"]
    scale = d**-0.5
    triton_be, torch_be = get_attention_backend("triton"), get_attention_backend("sdpa")

    copy_gbps, gemm_tflops, gemm_dtype = _machine_rates(torch, cfg, device, timer)
    m = cfg["gemm_n"]

    elem = torch.tensor([], dtype=dtype).element_size()
    decode = []
    for i, (batch, ctx) in enumerate(cfg["decode"]):
        q, k, v, meta = _step(torch, [(ctx - 1, 1)] * batch, cfg["heads"], cfg["block_size"], dtype, device, i)
        ms = timer(lambda: triton_be(q, k, v, meta, scale))
        torch_ms = timer(lambda: torch_be(q, k, v, meta, scale))
        err = (triton_be(q, k, v, meta, scale).float() - torch_be(q, k, v, meta, scale).float()).abs().max()
        nbytes = batch * ctx * kh * d * 2 * elem + 2 * q.numel() * elem
        gbps = nbytes / (ms * 1e-3) / 1e9
        decode.append({"batch": batch, "context": ctx, "ms": ms, "GBps": gbps, "of_copy_peak": gbps / copy_gbps,
                       "torch_backend_ms": torch_ms, "speedup_vs_torch": torch_ms / ms,
                       "max_abs_diff_vs_torch": float(err)})
        del q, k, v, meta

    prefill = []
    for i, (batch, new, prefix) in enumerate(cfg["prefill"]):
        q, k, v, meta = _step(torch, [(prefix, new)] * batch, cfg["heads"], cfg["block_size"], dtype, device, 100 + i)
        ms = timer(lambda: triton_be(q, k, v, meta, scale))
        torch_ms = timer(lambda: torch_be(q, k, v, meta, scale))
        err = (triton_be(q, k, v, meta, scale).float() - torch_be(q, k, v, meta, scale).float()).abs().max()
        pairs = batch * (new * prefix + new * (new + 1) // 2)  # causal (query, key) pairs per head
        tflops = 4 * pairs * h * d / (ms * 1e-3) / 1e12
        prefill.append({"batch": batch, "new_tokens": new, "prefix": prefix, "ms": ms, "TFLOPs": tflops,
                        "of_gemm": tflops / gemm_tflops, "torch_backend_ms": torch_ms,
                        "speedup_vs_torch": torch_ms / ms, "max_abs_diff_vs_torch": float(err)})
        del q, k, v, meta

    name = "cpu (Triton interpreter)" if interpret else torch.cuda.get_device_name(device)
    tag = "cpu_interpret" if interpret else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return {
        "device": name, "device_tag": tag, "interpreter": interpret,
        "torch": torch.__version__, "triton": triton.__version__,
        "dtype": cfg["dtype"], "num_heads": h, "num_kv_heads": kh, "head_dim": d,
        "block_size": cfg["block_size"],
        "copy_GBps": copy_gbps, "copy_bytes": cfg["copy_bytes"],
        "gemm_TFLOPs": gemm_tflops, "gemm_n": m, "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
        "decode": decode, "prefill": prefill,
    }


def markdown(r: dict) -> str:
    head = (f"# Triton paged-attention kernels on {r['device']}\n\n"
            + ("**Smoke test under the Triton interpreter: these numbers are not performance figures.**\n\n"
               if r["interpreter"] else "")
            + f"torch {r['torch']}, triton {r['triton']}; {r['dtype']}, {r['num_heads']} query heads, "
            f"{r['num_kv_heads']} KV heads, head_dim {r['head_dim']}, block size {r['block_size']}; "
            "block tables shuffled.\n\n"
            f"Measured in the same run: device copy {r['copy_GBps']:.0f} GB/s "
            f"({r['copy_bytes'] >> 20} MiB `copy_`, read + write); {r['gemm_dtype']} GEMM "
            f"{r['gemm_TFLOPs']:.1f} TFLOP/s (`torch.matmul`, n = {r['gemm_n']}).\n\n")
    dec = ["## Decode (`paged_decode_attention`)\n",
           "| batch | context | ms | GB/s | of copy GB/s | torch backend ms | speed-up vs torch | max abs diff |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dec += [f"| {x['batch']} | {x['context']} | {x['ms']:.4f} | {x['GBps']:.0f} | {x['of_copy_peak']:.2f} | "
            f"{x['torch_backend_ms']:.4f} | {x['speedup_vs_torch']:.2f}x | {x['max_abs_diff_vs_torch']:.1e} |"
            for x in r["decode"]]
    pre = ["\n## Prefill (`varlen_prefill_attention`, causal)\n",
           "| batch | new tokens | cached prefix | ms | TFLOP/s | of GEMM | torch backend ms | speed-up vs torch "
           "| max abs diff |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    pre += [f"| {x['batch']} | {x['new_tokens']} | {x['prefix']} | {x['ms']:.4f} | {x['TFLOPs']:.1f} | "
            f"{x['of_gemm']:.2f} | {x['torch_backend_ms']:.4f} | {x['speedup_vs_torch']:.2f}x | "
            f"{x['max_abs_diff_vs_torch']:.1e} |" for x in r["prefill"]]
    return head + "\n".join(dec) + "\n" + "\n".join(pre) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

"""Shared helpers of the CPU benchmarks: machine rates, load average, prompts, decode floors.

Units are in the names: ``_s`` seconds, ``_ms`` milliseconds, ``_GBps`` 1e9 bytes per
second, ``_GFLOPs`` 1e9 floating-point operations per second, ``_bytes`` bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SONNET = REPO / "loadtest" / "data" / "prompts" / "sonnet.txt"
RESULTS = REPO / "bench" / "results"


def out_dir(given: Path | None, quick: bool, prefix: str) -> Path:
    """A benchmark's ``--out-dir``: ``given``, else a new temporary folder (named ``<prefix>...``) for a
    ``--quick`` run, else ``bench/results``."""
    if given is not None:
        return given
    return Path(tempfile.mkdtemp(prefix=prefix)) if quick else RESULTS


def logger(tag: str) -> Callable[[str], None]:
    """A progress printer for one benchmark: ``[tag HH:MM:SS] message`` on stderr."""

    def log(msg: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def write_results(res: dict, out_dir: Path, name: str, markdown: Callable[[dict], str]) -> tuple[Path, str]:
    """Write ``<out_dir>/<name>.json`` (``res``, indented) and ``<name>.md`` (``markdown(res)``).

    Returns:
        ``(stem, json_text)``: the path without suffix and the JSON written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / name
    text = json.dumps(res, indent=2) + "\n"
    stem.with_suffix(".json").write_text(text)
    stem.with_suffix(".md").write_text(markdown(res))
    return stem, text


def fmt(x, spec: str = ".2f") -> str:
    """``x`` formatted with ``spec``, or an em dash for None (a value a run did not measure)."""
    return "—" if x is None else format(x, spec)


def load_avg_1m() -> float:
    """The machine's 1-minute load average (runnable + running tasks)."""
    return os.getloadavg()[0]


def cpu_name() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _median_time_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth_GBps(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Memory bandwidth of a large float32 tensor copy: (bytes read + bytes written) /
    median seconds of ``reps`` copies, at the current torch thread count."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    s = _median_time_s(lambda: dst.copy_(src), reps)
    return 2 * nbytes / s / 1e9


def gemm_GFLOPs(n: int = 2048, reps: int = 5) -> float:
    """float32 GEMM rate: ``2 n^3`` / median seconds of ``torch.mm`` of two ``n x n`` matrices."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    s = _median_time_s(lambda: torch.mm(a, b), reps)
    return 2 * n**3 / s / 1e9


def linear_stream_GBps(weights: list[torch.Tensor], reps: int = 3) -> float:
    """Weight-streaming rate of torch's own kernels at one row: bytes of ``weights`` / median
    seconds of ``F.linear(x, w)`` with ``x`` of shape ``[1, in_features]`` over every ``w``
    (what a batch-1 decode step's matmuls can do at best with these kernels)."""
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]

    def run() -> None:
        for x, w in zip(xs, weights):
            torch.nn.functional.linear(x, w)

    with torch.inference_mode():
        s = _median_time_s(run, reps)
    return sum(w.numel() * w.element_size() for w in weights) / s / 1e9


def linear_variants(weights: list[torch.Tensor], rows: int, reps: int = 3) -> dict | None:
    """Time one pass of ``rows``-row inputs over every weight matrix with ``F.linear`` (what
    the model runs) and with oneDNN's prepacked linear (``torch.ops.mkldnn._linear_pointwise``
    on ``_reorder_linear_weight``; what inductor's CPU freezing and vLLM's CPU build use),
    alternating the two ``reps`` times and keeping each one's fastest pass (a shared machine
    only ever slows a pass down).

    Returns:
        ``{"rows", "f_linear_ms", "mkldnn_packed_ms", "speedup", "max_abs_diff"}``, or None
        when this torch build has no oneDNN linear.
    """
    mk = getattr(torch.ops, "mkldnn", None)
    if mk is None or not hasattr(mk, "_linear_pointwise") or not torch.backends.mkldnn.is_available():
        return None
    with torch.inference_mode():
        xs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
        packed = [mk._reorder_linear_weight(w, rows) for w in weights]
        plain = lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)]  # noqa: E731
        onednn = lambda: [mk._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)]  # noqa: E731
        diff = max(float((a - b).abs().max()) for a, b in zip(plain(), onednn()))
        best = {"plain": float("inf"), "onednn": float("inf")}
        for _ in range(reps):
            for name, fn in (("plain", plain), ("onednn", onednn)):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return {"rows": rows, "f_linear_ms": best["plain"] * 1e3, "mkldnn_packed_ms": best["onednn"] * 1e3,
            "speedup": best["plain"] / best["onednn"], "max_abs_diff": diff}


def sonnet_prompts(tokenizer, num: int, context_len: int, path: Path = SONNET) -> list[list[int]]:
    """``num`` distinct prompts of exactly ``context_len`` tokens: windows of the tokenized
    text at evenly spread offsets (the text is repeated when it is too short)."""
    ids = tokenizer(path.read_text())["input_ids"]
    while len(ids) < context_len + num:
        ids = ids + ids
    stride = max(1, (len(ids) - context_len) // num)
    return [ids[i * stride:i * stride + context_len] for i in range(num)]


def decode_floors(weight_bytes: int, num_params: int, kv_bytes_per_token: int, attn_flops_per_ctx_token: int,
                  batch_size: int, mean_context: float, bandwidth_GBps: float, gemm_rate: float) -> dict:
    """Lower bounds on one decode step of ``batch_size`` sequences.

    Args:
        weight_bytes: bytes of every weight, read once per step (the tied LM head included).
        num_params: weights in matmuls (2 flops each per token).
        kv_bytes_per_token: K + V bytes of one context token over all layers.
        attn_flops_per_ctx_token: attention flops of one new token per context token.
        mean_context: mean context length (tokens) over the timed steps.
        bandwidth_GBps / gemm_rate: measured copy bandwidth and GEMM GFLOP/s.

    Returns:
        ``bytes_per_step``, ``flops_per_step``, ``bandwidth_floor_ms`` (bytes / bandwidth),
        ``compute_floor_ms`` (flops / GEMM rate), ``roofline_floor_ms`` (the larger).
    """
    nbytes = weight_bytes + batch_size * mean_context * kv_bytes_per_token
    flops = batch_size * (2 * num_params + mean_context * attn_flops_per_ctx_token)
    bw_ms = nbytes / (bandwidth_GBps * 1e9) * 1e3
    comp_ms = flops / (gemm_rate * 1e9) * 1e3
    return {"bytes_per_step": int(nbytes), "flops_per_step": int(flops), "bandwidth_floor_ms": bw_ms,
            "compute_floor_ms": comp_ms, "roofline_floor_ms": max(bw_ms, comp_ms)}


def greedy_agreement(ours: list[list[int]], other: list[list[int]] | None) -> dict | None:
    """How far two engines' greedy outputs match: sequences identical end to end, and the
    mean length of the common prefix (tokens); None when ``other`` is missing."""
    if other is None:
        return None
    same = sum(a == b for a, b in zip(ours, other))
    prefix = []
    for a, b in zip(ours, other):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    return {"identical_seqs": same, "num_seqs": len(ours), "mean_common_prefix": statistics.mean(prefix)}



@contextlib.contextmanager
def op_profile(out: dict, num_steps: int, top: int = 12):
    """Profile the ``with`` body under ``torch.profiler`` (CPU); on exit fill ``out`` with
    its busiest operators.

    Args:
        out: receives ``wall_ms_per_step`` (profiled, so inflated by the profiler),
            ``ops_self_ms_per_step`` (sum of every operator's self time) and ``top``:
            ``{"op", "self_ms_per_step", "calls_per_step", "share_of_wall"}`` rows. Wall
            time not covered by operator self time is Python and dispatch outside torch
            operators.
        num_steps: decode steps the body runs (per-step figures divide by it).
        top: operators kept, by self CPU time.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        yield
        wall_ms = (time.perf_counter() - t0) * 1e3 / num_steps
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    out["wall_ms_per_step"] = wall_ms
    out["ops_self_ms_per_step"] = sum(e.self_cpu_time_total for e in events) / 1e3 / num_steps
    out["top"] = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / num_steps,
                   "calls_per_step": e.count / num_steps,
                   "share_of_wall": e.self_cpu_time_total / 1e3 / num_steps / wall_ms} for e in events[:top]]

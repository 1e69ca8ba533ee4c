"""Prefill measurements through :class:`engine.model_runner.ModelRunner` (shared by
``bench/prefill.py`` and ``bench/kvtransfer.py``).

Model FLOPs of a prefill (what the roofline counts, useful work only)::

    flops = 2 * P * T  +  4 * L * H * D * sum over prompts of n (n + 1) / 2

with ``P`` the non-embedding parameters (every parameter but ``embed_tokens`` and an
untied ``lm_head``: the LM head runs on one row per prompt, < 0.02 % of the work at 128
tokens), ``T`` the prompt tokens, ``L`` layers, ``H`` query heads, ``D`` head_dim and
``n`` each prompt's length: causal attention does ``QK^T`` and ``PV`` (2 x 2 x D flops)
per (query, key, head) with ``n (n + 1) / 2`` (query, key) pairs per prompt. Masked-out
pairs the backend computes anyway are not counted; chunking a prompt does not change
the count.

The roofline is the float32 GEMM rate of ``torch.mm`` on two ``n x n`` matrices at the
same torch thread count, measured right before and right after every timed
repetition (the machine is shared: each repetition's ratio uses the mean of its own
two brackets).
"""

from __future__ import annotations

import statistics
import time

import torch

from common.model_config import ModelConfig
from engine.block_pool import blocks_needed
from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model.linear import dense_weights
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan

import _common

GREEDY = SamplingOptions(temperature=0.0)
BLOCK_SIZE = 16


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters of the decoder layers and final norm (not ``embed_tokens`` nor ``lm_head``)."""
    return sum(p.numel() for name, p in dense_weights(model).items()
               if "embed_tokens" not in name and not name.startswith("lm_head"))


def prefill_flops(cfg: ModelConfig, params: int, lengths: list[int]) -> dict:
    """Model FLOPs of prefilling prompts of ``lengths`` tokens (formula in the module doc)."""
    linear = 2 * params * sum(lengths)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(n * (n + 1) // 2 for n in lengths)
    return {"linear_flops": linear, "attention_flops": attention, "flops": linear + attention}


def make_runner(model, cfg: ModelConfig, num_tokens: int, num_prompts: int,
                block_size: int = BLOCK_SIZE) -> ModelRunner:
    """A runner whose cache holds ``num_prompts`` prompts of ``num_tokens`` tokens (block 0 unused)."""
    blocks = num_prompts * blocks_needed(num_tokens, block_size) + 1
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=block_size, num_blocks=blocks), torch.device("cpu"))
    return ModelRunner(model, kv, block_size)


def block_tables(prompts: list[list[int]], block_size: int = BLOCK_SIZE) -> list[list[int]]:
    """Disjoint block tables, prompt ``j`` from block ``1 + j * need`` on."""
    need = max(blocks_needed(len(p), block_size) for p in prompts)
    return [list(range(1 + j * need, 1 + j * need + blocks_needed(len(p), block_size)))
            for j, p in enumerate(prompts)]


def step_plans(prompts: list[list[int]], per_step: int, budget: int, block_size: int = BLOCK_SIZE) -> list[StepPlan]:
    """The steps a prefill scheduler runs for ``prompts``: ``per_step`` prompts packed in one
    varlen step while they fit ``budget`` tokens; a prompt longer than ``budget`` is cut into
    ``budget``-token chunks, one step each, attending to the earlier chunks' KV (chunked
    prefill), its token sampled after the last chunk only."""
    tables = block_tables(prompts, block_size)
    plans = []
    for at in range(0, len(prompts), per_step):
        group = list(range(at, min(at + per_step, len(prompts))))
        if sum(len(prompts[j]) for j in group) <= budget:
            plans.append(StepPlan([ScheduledSeq(f"p{j}", prompts[j], 0, tables[j], True, GREEDY) for j in group]))
            continue
        for j in group:
            n = len(prompts[j])
            for c in range(0, n, budget):
                plans.append(StepPlan([ScheduledSeq(f"p{j}", prompts[j][c:c + budget], c, tables[j],
                                                    c + budget >= n, GREEDY)]))
    return plans


def run_plans(runner: ModelRunner, plans: list[StepPlan]) -> tuple[float, list[int]]:
    """Execute the steps in order; wall seconds of all of them and the sampled tokens."""
    tokens: list[int] = []
    t0 = time.perf_counter()
    for plan in plans:
        tokens += runner.execute(plan).token_ids
    return time.perf_counter() - t0, tokens


def measure_prefill(runner: ModelRunner, plans: list[StepPlan], flops: int, reps: int,
                    gemm_n: int = 2048, gemm_reps: int = 2) -> dict:
    """Time ``reps`` repetitions of ``plans`` (after one warm-up), each bracketed by GEMM-rate
    measurements (:func:`_common.gemm_GFLOPs`, ``gemm_n``).

    Returns:
        ``seconds`` (median), ``seconds_all``, ``gemm_GFLOPs`` (median of the per-repetition
        bracket means), ``gemm_GFLOPs_all``, ``achieved_GFLOPs`` (flops / median seconds),
        ``ratio_roofline`` (median over repetitions of achieved / that repetition's GEMM rate),
        ``ratio_roofline_of_medians`` (achieved / median GEMM rate), ``tokens`` (first tokens
        of the last repetition).
    """
    run_plans(runner, plans)
    times, rates, ratios = [], [], []
    before = _common.gemm_GFLOPs(gemm_n, gemm_reps)
    tokens: list[int] = []
    for _ in range(reps):
        s, tokens = run_plans(runner, plans)
        after = _common.gemm_GFLOPs(gemm_n, gemm_reps)
        rate = (before + after) / 2
        times.append(s)
        rates.append(rate)
        ratios.append(flops / s / 1e9 / rate)
        before = after
    sec, gemm = statistics.median(times), statistics.median(rates)
    return {"seconds": sec, "seconds_all": times, "gemm_GFLOPs": gemm, "gemm_GFLOPs_all": rates,
            "achieved_GFLOPs": flops / sec / 1e9, "ratio_roofline": statistics.median(ratios),
            "ratio_roofline_of_medians": flops / sec / 1e9 / gemm, "tokens": tokens}


#: operator-name fragments of each category of :func:`op_categories` (first match wins).
CATEGORIES = (
    ("GEMM (linear layers)", ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise", "pdcluster::panel_gemm",
                              "pdcluster::gemv", "pdcluster::linear_w8a8", "pdcluster::linear_q4_1")),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "aten::bmm", "aten::_softmax", "aten::baddbmm",
                          "pdcluster::paged_decode_attention")),
    ("elementwise (RMSNorm, RoPE, SwiGLU, residual)", ("aten::mul", "aten::add", "aten::cat", "aten::neg",
                                                       "aten::pow", "aten::sum", "aten::mean", "aten::rsqrt",
                                                       "aten::silu", "aten::div", "aten::fill_", "aten::copy_",
                                                       "pdcluster::rms_norm", "pdcluster::add_rms_norm",
                                                       "pdcluster::silu_and_mul")),
    ("indexing (KV gather, cache write, RoPE table) and masks", ("pdcluster::rope_store", "aten::index",
                                                                 "aten::gather", "aten::where",
                                                                 "aten::le", "aten::lt", "aten::bitwise_and")),
)


def op_categories(events: list[tuple[str, float]], wall_ms: float) -> list[dict]:
    """Group ``(op name, self ms)`` pairs into :data:`CATEGORIES` plus "other operators" and
    "outside operators" (wall time no operator's self time covers: Python, dispatch)."""
    sums = {name: 0.0 for name, _ in CATEGORIES} | {"other operators": 0.0}
    for op, ms in events:
        cat = next((name for name, frags in CATEGORIES if any(f in op for f in frags)), "other operators")
        sums[cat] += ms
    sums["outside operators"] = max(0.0, wall_ms - sum(sums.values()))
    return [{"category": k, "ms": v, "share": v / wall_ms} for k, v in sums.items()]


def profile_step(runner: ModelRunner, plans: list[StepPlan], top: int = 12, gemm_n: int = 2048) -> dict:
    """One profiled run of ``plans`` under ``torch.profiler`` (CPU): wall, top operators by
    self time, :func:`op_categories`, and the GEMM rate (``gemm_n``) around it."""
    from torch.profiler import ProfilerActivity, profile

    gemm_before = _common.gemm_GFLOPs(gemm_n, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall_s, _ = run_plans(runner, plans)
    gemm = (gemm_before + _common.gemm_GFLOPs(gemm_n, 2)) / 2
    events = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e[1], reverse=True)
    wall_ms = wall_s * 1e3
    return {"wall_ms": wall_ms, "gemm_GFLOPs": gemm,
            "top": [{"op": k, "self_ms": ms, "calls": n, "share_of_wall": ms / wall_ms} for k, ms, n in events[:top]],
            "categories": op_categories([(k, ms) for k, ms, _ in events], wall_ms)}


def attention_variants(cfg: ModelConfig, n: int, reps: int = 3) -> dict:
    """One layer's prefill attention of an ``n``-token prompt (no cached prefix), as the torch
    backend calls it (explicit boolean causal mask, grouped-query) and with ``is_causal=True``
    instead of the mask: median milliseconds each, their ratio and the largest difference."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.num_heads, n, cfg.head_dim, generator=g)
    k = torch.randn(1, cfg.num_kv_heads, n, cfg.head_dim, generator=g)
    v = torch.randn(1, cfg.num_kv_heads, n, cfg.head_dim, generator=g)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    gqa = cfg.num_kv_heads != cfg.num_heads
    masked = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # noqa: E731
    causal = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # noqa: E731
    with torch.inference_mode():
        masked_s = _common._median_time_s(masked, reps)
        causal_s = _common._median_time_s(causal, reps)
        diff = float((masked() - causal()).abs().max())
    return {"prompt_len": n, "masked_ms": masked_s * 1e3, "is_causal_ms": causal_s * 1e3,
            "speedup": masked_s / causal_s, "max_abs_diff": diff}

"""The markdown report of ``bench/prefill.py`` (from its result dict)."""

from __future__ import annotations

from _common import fmt as _f


def _cat(profile: dict, prefix: str) -> dict:
    return next(c for c in profile["categories"] if c["category"].startswith(prefix))


def _why(r: dict) -> list[str]:
    """Where the step's time goes, from the profile (empty without one)."""
    pr = r.get("profile")
    if not pr:
        return []
    fl = pr["flops"]
    gemm, attn = _cat(pr, "GEMM"), _cat(pr, "attention")
    elem, idx = _cat(pr, "elementwise"), _cat(pr, "indexing")
    point = next((p for p in r["points"] if p["prompt_len"] == pr["prompt_len"] and p["mode"] == "single"), None)
    ref = pr["gemm_GFLOPs"]
    gemm_rate = fl["linear_flops"] / gemm["ms"] / 1e6 if gemm["ms"] else None
    attn_rate = fl["attention_flops"] / attn["ms"] / 1e6 if attn["ms"] else None
    out = [
        f"Where the time of one {pr['prompt_len']}-token step goes (`torch.profiler`, operator self time). The "
        f"profiled step took {pr['wall_ms'] / 1e3:.2f} s"
        + (f" (unprofiled median above: {point['seconds']:.2f} s)" if point else "")
        + f"; GEMM rate around it {ref:.1f} GFLOP/s. Profiler overhead and the machine's load change the "
        "seconds; the shares are what this section is for:",
        "",
        "| category | s | share of the step |",
        "|---|---:|---:|",
        *[f"| {c['category']} | {c['ms'] / 1e3:.2f} | {c['share']:.1%} |" for c in pr["categories"]],
        "",
        f"* GEMMs of the linear layers: {fl['linear_flops'] / 1e9:.0f} GFLOP at {_f(gemm_rate, '.1f')} GFLOP/s "
        f"inside the step" + (f" ({gemm_rate / ref:.2f} of the square-GEMM rate around it)" if gemm_rate else "")
        + f", {gemm['share']:.0%} of the step. They are the only part the roofline budgets at full speed.",
        f"* Attention: {fl['attention_flops'] / 1e9:.0f} GFLOP of causal work at {_f(attn_rate, '.1f')} GFLOP/s, "
        f"{attn['share']:.0%} of the step. The torch backend calls SDPA with `is_causal=True` for one prompt "
        "without cached context (this step) and with an explicit boolean mask for batched or prefix steps, where "
        "the CPU flash kernel also computes the masked upper triangle.",
        f"* Elementwise work (RMSNorm, RoPE's rotate-half, SwiGLU, residual adds): {elem['share']:.0%}, and "
        f"indexing (KV gather, cache writes, the RoPE table looked up once per step) with mask building: "
        f"{idx['share']:.0%}. The roofline counts no FLOPs for either. These are memory-bound passes over "
        "`[tokens, hidden]` and `[tokens, intermediate]` activations, one kernel each.",
    ]
    av = pr.get("attention_variants")
    if av:
        out += ["", f"One layer's attention at {av['prompt_len']} tokens, same run: masked SDPA (the backend's path for "
                f"batched or prefix steps) {av['masked_ms']:.0f} ms, `is_causal=True` {av['is_causal_ms']:.0f} ms ({av['speedup']:.2f}x "
                f"faster, max abs difference {av['max_abs_diff']:.1e})."]
    return out


def _threads_why(r: dict) -> list[str]:
    """What the thread diagnostic says about a missed target (nothing without one)."""
    longest = max(q["prompt_len"] for q in r["points"])
    main = next((p for p in r["points"] if p["prompt_len"] == longest and p["mode"] == "single"), None)
    diag = next((d for d in r.get("thread_diagnostic") or [] if main and d["prompt_len"] == longest), None)
    if not diag:
        return []
    g_main, g_diag = main["gemm_GFLOPs"], diag["gemm_GFLOPs"]
    rel = "no higher than" if g_main <= g_diag else f"only {g_main / g_diag:.2f}x"
    return ["", f"Why, first: in this run the {r['threads']}-thread GEMM rate ({g_main:.1f} GFLOP/s) was {rel} the "
            f"{diag['threads']}-thread one ({g_diag:.1f} GFLOP/s): the second core was mostly held by other jobs "
            f"(load average {main['load_avg_1m']:.2f}). With {diag['threads']} thread(s) the same {longest}-token "
            f"prefill ran at {diag['tokens_per_s']:.0f} tok/s ({diag['ratio_vs_main_threads']:.2f}x), "
            f"{diag['ratio_roofline']:.2f} of its roofline; with {r['threads']} threads each of the step's operators "
            "waits for a thread that is not running (section above). The profile below shows what remains at any "
            "thread count."]


def _diagnostic(r: dict) -> list[str]:
    rows = r.get("thread_diagnostic") or []
    if not rows:
        return []
    out = ["", f"## Same points at {rows[0]['threads']} torch thread(s), same run (diagnostic)", "",
           f"With {r['threads']} threads every parallel operator ends in a barrier. When another process "
           "holds one of the cores, that barrier waits for a descheduled thread, at each of the hundreds of "
           "operators of a step; the GEMM of the roofline (a few long operators) hardly suffers. The rows "
           "below repeat points with fewer threads, against the GEMM rate at those threads; *x main* = "
           f"tokens/s over the {r['threads']}-thread row above.", "",
           "| length | threads | s (median) | tok/s | achieved GFLOP/s | GEMM GFLOP/s | x roofline | x main "
           "| load 1m before / after |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    out += [f"| {p['prompt_len']} | {p['threads']} | {p['seconds']:.2f} | {p['tokens_per_s']:.0f} | "
            f"{p['achieved_GFLOPs']:.1f} | {p['gemm_GFLOPs']:.1f} | {p['ratio_roofline']:.2f} | "
            f"{p['ratio_vs_main_threads']:.2f} | {p['load_avg_1m']:.2f} / {p['load_avg_1m_after']:.2f} |" for p in rows]
    return out


CLOSE = [
    "What would close the gap (engine changes, not made here; each aimed at a measured share above):",
    "",
    "0. Thread budget: give a worker no more torch threads than cores it actually gets (the diagnostic above); "
    "on a machine shared with other jobs, 2 threads on 2 nominal cores lose to 1.",
    "1. Attention: a causal varlen kernel for batched and prefix steps, so the masked triangle is skipped there "
    "too (single prompts without a cached prefix already use `is_causal=True`; the same-run comparison above).",
    "2. Elementwise: fuse RMSNorm, RoPE and SwiGLU (e.g. `torch.compile` of the decoder layer with inductor's "
    "CPU backend, or hand-fused kernels) so each activation is read and written once instead of once per op.",
    "3. Indexing: build the attention mask only for steps that need one.",
    "4. GEMMs: merge the Q/K/V and gate/up projections into one GEMM each (fewer, larger oneDNN calls).",
]


def markdown(r: dict) -> str:
    """The report: run conditions, formula, the main table, targets, the profile."""
    out = [
        f"# Prefill throughput: {r['model']} on CPU, float32 activations" + (" (quick)" if r["quick"] else ""),
        "",
        f"Weights: {r.get('quantization', 'none')} (`--quantization`); attention backend "
        f"`{r.get('attention_backend', 'torch')}`.",
        "",
        f"Run {r['started_at']}, {r['duration_s'] / 60:.1f} min; {r['cpu']}, {r['cpu_count']} cores; torch "
        f"{r['torch']}; {r['thread_budget']}. 1-minute load average {r['load_avg_1m_start']:.2f} at the start, "
        f"{r['load_avg_1m_end']:.2f} at the end (other jobs share the machine; per point below).",
        "",
        f"Each step is `ModelRunner.execute` (metadata, forward, LM head on each prompt's last row, greedy "
        f"sampling), block size {r['block_size']}, token budget {r['budget_tokens']} per step; seconds are the "
        f"median of {r['reps']} repetitions after a warm-up. *single*: one prompt per step; *batched*: "
        f"budget / length prompts of that length in one varlen step (at length = budget the two coincide and "
        f"only *single* is run).",
        "",
        f"Roofline: model FLOPs = `{r['flops_formula']}` (non-embedding parameters "
        f"{r['non_embedding_params'] / 1e6:.2f} M, {r['num_layers']} layers, {r['num_heads']} heads, head_dim "
        f"{r['head_dim']}; masked-out pairs not counted) over the float32 GEMM rate of `torch.mm` on two "
        f"{r['gemm_n']} x {r['gemm_n']} matrices, same threads, measured right before and after every "
        "repetition. *x roofline* is the median over repetitions of achieved FLOP/s / that repetition's GEMM "
        "rate; *roofline tok/s* = tokens at the median GEMM rate.",
        "",
        "| length | mode | prompts | per step | steps | tokens | s (median) | tok/s | achieved GFLOP/s "
        "| GEMM GFLOP/s | x roofline | roofline tok/s | batched / single | load 1m before / after |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in r["points"]:
        out.append(
            f"| {p['prompt_len']} | {p['mode']} | {p['num_prompts']} | {p['prompts_per_step']} | {p['steps']} | "
            f"{p['tokens']} | {p['seconds']:.2f} | {p['tokens_per_s']:.0f} | {p['achieved_GFLOPs']:.1f} | "
            f"{p['gemm_GFLOPs']:.1f} | {p['ratio_roofline']:.2f} | {p['roofline_tokens_per_s']:.0f} | "
            f"{_f(p.get('ratio_batched_vs_single'))} | {p['load_avg_1m']:.2f} / {p['load_avg_1m_after']:.2f} |")
    out += _diagnostic(r)
    out += ["", "## Targets", "", "| target | value | minimum | met | shortfall |", "|---|---:|---:|---|---:|"]
    for t in r["targets"]:
        out.append(f"| {t['target']} | {t['value']:.2f} | {t['minimum']:.2f} | {'yes' if t['met'] else '**no**'} "
                   f"| {_f(t['shortfall'], '.0%')} |")
    missed = [t for t in r["targets"] if not t["met"]]
    out += _threads_why(r) if missed else []
    if r.get("profile"):
        out += ["", "## Profile", "", *_why(r)]
        if missed:
            out += ["", *CLOSE]
        pr = r["profile"]
        out += ["", "Top operators by self time:", "", "| op | self s | calls | share of the step |",
                "|---|---:|---:|---:|"]
        out += [f"| `{t['op']}` | {t['self_ms'] / 1e3:.2f} | {t['calls']} | {t['share_of_wall']:.1%} |"
                for t in pr["top"]]
    return "\n".join(out) + "\n"

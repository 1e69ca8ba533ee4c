"""Targets and the markdown report of ``bench/decode.py`` (from its result dict)."""

from __future__ import annotations

from pathlib import Path

from _common import fmt as _f

#: (name, batch size, context or None for every context, record key, minimum): issue #14's targets
#: on the 2-core CPU (batch 1 at the memory limit, long-context batches against vLLM's CPU build),
#: and the earlier batch-32 ones.
TARGETS = (
    ("batch 1: ours / bandwidth floor", 1, None, "ratio_bandwidth_floor", 0.6),
    ("batch 1: ours / vLLM", 1, None, "ratio_vllm", 1.5),
    ("batch 32: ours / vLLM", 32, 128, "ratio_vllm", 1.2),
    ("batch 32: ours / vLLM", 32, 1024, "ratio_vllm", 1.2),
    ("batch 64: ours / vLLM", 64, 1024, "ratio_vllm", 1.2),
    ("batch 32: ours / HF generate", 32, None, "ratio_hf", 1.3),
)


def targets(res: dict) -> list[dict]:
    """One row per (target, context) point measured: value, whether it is met and, when
    missed, by how much (``shortfall`` = 1 - value / minimum)."""
    rows = []
    for name, batch, context, key, minimum in TARGETS:
        for p in res["points"]:
            if p["batch_size"] != batch or context not in (None, p["context_len"]):
                continue
            v = p.get(key)
            rows.append({"target": name, "context_len": p["context_len"], "minimum": minimum, "value": v,
                         "met": None if v is None else v >= minimum,
                         "shortfall": None if v is None or v >= minimum else 1 - v / minimum})
    return rows


def _x(x) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _pm(rec: dict) -> str:
    return "—" if not rec else f"{rec['tpot_ms']:.1f} / {rec['tpot_ms_mean']:.1f}"


def _llamacpp(r: dict) -> list[str]:
    """The llama.cpp peer's section (nothing when it was not asked for)."""
    info = r.get("llamacpp_info")
    if info is None and not r.get("llamacpp_start_error"):
        return []
    out = ["", "## llama.cpp peer", ""]
    if info is None:
        return out + [f"llama.cpp did not start: `{r['llamacpp_start_error'][:800]}`"]
    out += [f"`llama-server` with `-t {info['threads']} -tb {info['threads']} --parallel {info['parallel']}` on "
            f"`{Path(info['gguf']).name}`: llama.cpp computes with the file's quantized weights; our engine "
            f"ran `--quantization {r.get('quantization', 'none')}`. Its TPOT is the median over the batch of "
            "each request's `predicted_ms / predicted_n` (an upper bound above batch 1: see "
            "`bench/_decode_llamacpp.py`).", "",
            "| batch | context | ours tok/s | llama.cpp tok/s | llama.cpp TPOT ms | ours / llama.cpp | same greedy tokens |",
            "|---:|---:|---:|---:|---:|---:|---|"]
    for p in r["points"]:
        lc, agree = p.get("llamacpp") or {}, p.get("greedy_agreement_llamacpp") or {}
        same = f"{agree['identical_seqs']}/{agree['num_seqs']}" if agree else "—"
        out.append(f"| {p['batch_size']} | {p['context_len']} | {p['tokens_per_s']:.1f} | "
                   f"{_f(lc.get('tokens_per_s'), '.1f')} | {_f(lc.get('tpot_ms'), '.1f')} | "
                   f"{_x(p.get('ratio_llamacpp'))} | {same} |")
        out += [f"* error at batch {p['batch_size']}: `{e[:400]}`" for e in p.get("llamacpp_errors") or []]
    return out


def markdown(r: dict) -> str:
    """The report: run conditions, the main table, the step breakdown, targets, profiles."""
    m = r["machine"]
    tb = r["thread_budget"]
    out = [
        f"# Decode throughput: {r['model']} float32 on CPU" + (" (quick)" if r["quick"] else ""),
        "",
        *([] if r.get("quantization", "none") == "none" else [
            f"**Our engine ran `--quantization {r['quantization']}`** (its weights as stored count in its "
            "bandwidth floor); HF and vLLM ran float32 weights.", ""]),
        *([] if r.get("complete", True) else ["**Partial result: the run had not finished when this was written.**", ""]),
        f"Run {r['started_at']}, {r['duration_s'] / 60:.1f} min; {r['cpu']}, {r['cpu_count']} cores; "
        f"torch {r['torch']}, transformers {r['transformers']}, vLLM {r['vllm'] or 'not run'}. "
        f"1-minute load average {r['load_avg_1m_start']:.2f} at the start, {r['load_avg_1m_end']:.2f} at the "
        "end (other engineers' jobs share the machine; per point below).",
        "",
        f"Machine, same run, at the start: copy bandwidth {m['copy_GBps']:.1f} GB/s ({m['copy_bytes'] >> 20} MiB "
        f"float32 `copy_`, read + write), float32 GEMM {m['gemm_GFLOPs']:.1f} GFLOP/s (`torch.mm`, "
        f"n = {m['gemm_n']}), one-row linear {m['linear_GBps']:.1f} GB/s (`F.linear` of a `[1, in]` row over "
        "every weight matrix: the weight-streaming rate torch's own kernels reach at batch 1). All three are "
        "measured again right before each point (columns *copy GB/s*, *linear GB/s*, *GEMM GFLOP/s*) and the "
        f"point's own values give its floors. Weights {r['weight_bytes'] / 1e6:.0f} MB, "
        f"KV {r['kv_bytes_per_token'] / 1024:.0f} KiB per token.",
        "",
        f"Thread budget: ours — {tb['ours']}; HF — {tb['hf']}; vLLM — {tb['vllm'] or 'not run'}. "
        f"Our linear layers: the `{r.get('linear_backend', 'default')}` backend (`engine/model/linear.py`).",
        "",
        "Greedy, EOS ignored, distinct prompts cut from `sonnet.txt`; the first token comes from the "
        "prefill. TPOT is the median wall time of the remaining decode steps (p50; robust to other jobs' "
        "bursts on this shared machine; the mean is shown next to it) and tok/s = batch / p50 TPOT. "
        "Floor = (weights + KV bytes read per step, mean context) / copy bandwidth at the point; linear "
        "floor = weights at the one-row linear rate + KV at copy bandwidth (the best torch's own kernels "
        "allow); roofline = max(floor, step flops / GEMM rate). Every ratio is tokens/s over tokens/s "
        "measured in this run.",
        "",
        "| batch | context | new | ours tok/s | ours TPOT ms p50 / mean | floor tok/s | ours/floor "
        "| ours/linear floor | ours/roofline | HF tok/s | HF TPOT ms p50 / mean | ours/HF | vLLM tok/s "
        "| vLLM TPOT ms p50 / mean | ours/vLLM | load 1m | copy GB/s | linear GB/s | GEMM GFLOP/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in r["points"]:
        hf, vl, o = p.get("hf") or {}, p.get("vllm") or {}, p["ours"]
        out.append(
            f"| {p['batch_size']} | {p['context_len']} | {p['new_tokens']} | {p['tokens_per_s']:.1f} | "
            f"{p['tpot_ms']:.1f} / {o['tpot_ms_mean']:.1f} | {p['bandwidth_floor_tokens_per_s']:.1f} | "
            f"{p['ratio_bandwidth_floor']:.2f} | {p['ratio_linear_floor']:.2f} | {p['ratio_roofline']:.2f} | "
            f"{_f(hf.get('tokens_per_s'), '.1f')} | {_pm(hf)} | {_x(p['ratio_hf'])} | "
            f"{_f(vl.get('tokens_per_s'), '.1f')} | {_pm(vl)} | {_x(p['ratio_vllm'])} | "
            f"{p['load_avg_1m']:.2f} | {p['copy_GBps_at_point']:.1f} | {p['linear_GBps_at_point']:.1f} | "
            f"{_f(p.get('gemm_GFLOPs_at_point'), '.1f')} |")
    out += ["", f"Each engine ran {r.get('rounds', 1)} time(s) per point, interleaved in rotating order; the "
            "table shows each engine's best run. p50 TPOT (ms) of every run, in order:", ""]
    out += [f"* batch {p['batch_size']}, context {p['context_len']}: " + "; ".join(
        f"{e} " + ", ".join(_f(t, ".0f") for t in ts) for e, ts in p.get("rounds_tpot_ms", {}).items())
        for p in r["points"]]
    variants = [p for p in r["points"] if p.get("linear_variants_at_point")]
    if variants:
        out += ["", "One step's matmuls (every weight matrix once, `batch` rows) with `F.linear`, as the model "
                "runs them, and with oneDNN's prepacked linear (`torch.ops.mkldnn._linear_pointwise`; what "
                "inductor's CPU freezing and vLLM's CPU build use), fastest of 3 alternating passes each, "
                "right before the point:", "",
                "| batch | context | F.linear ms | oneDNN prepacked ms | speed-up | max abs diff |",
                "|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {p['batch_size']} | {p['context_len']} | {v['f_linear_ms']:.1f} | {v['mkldnn_packed_ms']:.1f} | "
                f"{v['speedup']:.2f}x | {v['max_abs_diff']:.1e} |"
                for p in r["points"] for v in [p["linear_variants_at_point"]] if v]
    if r.get("vllm_start_error"):
        out += ["", f"vLLM did not start: `{r['vllm_start_error'][:800]}`"]
    for p in r["points"]:
        for e in p.get("vllm_errors") or []:
            out += ["", f"vLLM error at batch {p['batch_size']} x context {p['context_len']}: `{e[:600]}`"]
    out += _llamacpp(r)
    out += [
        "",
        "## Step overhead (ours)",
        "",
        "Median ms per decode step (each part's own median over the steps of the best run; means are in "
        "the JSON) on the stepping thread. Overhead = step − (decoder forward + LM head): "
        "attention metadata, sampling, the rest of `ModelRunner.execute`, and the scheduler (inbox, plan, "
        "block growth, stop checks, events). After the step, per token: the worker's `DecodeEvent` "
        "(built + serialized) and the router's parse + incremental detokenization (`OutputAssembler`) + "
        "serialized `GenerateResponse`; *with stream* adds both, times the batch, to the overhead.",
        "",
        "| batch | context | step | forward | LM head | overhead | metadata | sampling | runner other | scheduler "
        "| overhead share | worker stream µs/tok | router detok µs/tok | overhead with stream | share with stream |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in r["points"]:
        o, mm = p["ours"], p["ours"]["median_ms"]
        out.append(
            f"| {p['batch_size']} | {p['context_len']} | {mm['step']:.2f} | {mm['forward']:.2f} | {mm['lm_head']:.2f} "
            f"| {mm['overhead']:.2f} | {mm['metadata']:.2f} | {mm['sampling']:.2f} | {mm['runner_other']:.2f} "
            f"| {mm['scheduler']:.2f} | {o['overhead_share_median']:.1%} | {o['worker_stream_us_per_token']:.1f} "
            f"| {o['router_detok_stream_us_per_token']:.1f} | {o['overhead_with_stream_ms']:.2f} "
            f"| {o['overhead_with_stream_share']:.1%} |")
    agree = [p for p in r["points"] if p.get("greedy_agreement_hf") or p.get("greedy_agreement_vllm")]
    if agree:
        out += ["", "## Greedy agreement", "",
                "Sequences whose whole greedy output equals ours (mean common prefix in tokens); float "
                "rounding differs between engines, so a late divergence where two logits nearly tie is expected.",
                "", "| batch | context | vs HF | vs vLLM |", "|---:|---:|---|---|"]
        for p in agree:
            cells = []
            for k in ("greedy_agreement_hf", "greedy_agreement_vllm"):
                a = p.get(k)
                cells.append("—" if a is None else
                             f"{a['identical_seqs']}/{a['num_seqs']} (prefix {a['mean_common_prefix']:.0f})")
            out.append(f"| {p['batch_size']} | {p['context_len']} | {cells[0]} | {cells[1]} |")
    out += ["", "## Targets", "", "| target | context | value | minimum | met | shortfall |", "|---|---:|---:|---:|---|---:|"]
    for t in r["targets"]:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        out.append(f"| {t['target']} | {t['context_len']} | {_f(t['value'])} | {t['minimum']:.2f} | {met} "
                   f"| {_f(t['shortfall'], '.0%')} |")
    if r.get("analysis"):
        out += ["", r["analysis"].rstrip()]
    for pr in r["profiles"]:
        out += ["", f"## Profile: {pr['engine']}, batch {pr['batch_size']}, context {pr['context_len']} "
                f"({pr['steps']} steps, `torch.profiler`)", "",
                f"Profiled wall {pr['wall_ms_per_step']:.2f} ms/step, of which operator self time "
                f"{pr['ops_self_ms_per_step']:.2f} ms; the rest is Python and dispatch outside operators.", "",
                "| op | self ms/step | calls/step | share of wall |", "|---|---:|---:|---:|"]
        out += [f"| `{row['op']}` | {row['self_ms_per_step']:.2f} | {row['calls_per_step']:.0f} | "
                f"{row['share_of_wall']:.1%} |" for row in pr["top"]]
    return "\n".join(out) + "\n"

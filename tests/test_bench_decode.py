"""Smoke test of bench/decode.py's measurement functions: one point (batch 2, context 32,
4 new tokens) through the decode scheduler, without HF or vLLM, plus the report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _decode_ours  # noqa: E402
import _decode_report  # noqa: E402
import decode  # noqa: E402
from _decode_vllm import steady_window  # noqa: E402

from engine.model import load_model  # noqa: E402

import _common  # noqa: E402


@pytest.fixture(scope="module")
def model(model_config):
    return load_model(model_config, torch.device("cpu"), torch.float32)


def test_one_point_through_the_decode_scheduler(model, model_config, tokenizer):
    prompts = _common.sonnet_prompts(tokenizer, 2, 32)
    assert len(prompts) == 2 and all(len(p) == 32 for p in prompts) and prompts[0] != prompts[1]
    prefilled = _decode_ours.prefill_kv(model, model_config, prompts, decode.BLOCK_SIZE)
    stats = decode.model_stats(model, model_config)
    rec = decode.run_point(model, model_config, None, tokenizer, prompts, prefilled, 4, stats, peers=None,
                           rounds=2, no_hf=True, copy_bytes=8 << 20, gemm_n=128)
    assert (rec["batch_size"], rec["context_len"], rec["new_tokens"]) == (2, 32, 4)
    assert rec["ratio_hf"] is None and rec["ratio_vllm"] is None and rec["hf"] is None
    assert rec["tokens_per_s"] > 0 and rec["tpot_ms"] > 0 and rec["ratio_bandwidth_floor"] > 0
    ours = rec["ours"]
    assert ours["decode_steps"] == 3 and ours["num_tokens"] == 8 and "events" not in ours
    assert len(rec["rounds_tpot_ms"]["ours"]) == 2 and rec["tpot_ms"] == min(rec["rounds_tpot_ms"]["ours"])
    mm = ours["mean_ms"]
    assert mm["forward"] > 0 and mm["lm_head"] > 0 and ours["metadata_timed_separately"]
    assert mm["step"] == pytest.approx(mm["forward"] + mm["lm_head"] + mm["overhead"])
    assert mm["overhead"] == pytest.approx(mm["metadata"] + mm["sampling"] + mm["runner_other"] + mm["scheduler"])
    assert ours["worker_stream_us_per_token"] > 0 and ours["router_detok_stream_us_per_token"] > 0
    assert ours["overhead_with_stream_ms"] > ours["median_ms"]["overhead"]
    v = rec["linear_variants_at_point"]
    assert v is None or (v["rows"] == 2 and v["max_abs_diff"] < 1e-3)
    # the timing wrappers are removed after a run: two more runs give the same greedy tokens
    a = _decode_ours.measure_decode(model, model_config, prompts, prefilled, 4, decode.BLOCK_SIZE)
    b = _decode_ours.measure_decode(model, model_config, prompts, prefilled, 4, decode.BLOCK_SIZE)
    assert a["token_ids"] == b["token_ids"]
    assert [t[0] for t in a["token_ids"]] == [tok for _, tok in prefilled]

    res = {"quick": True, "model": "m", "started_at": "t", "duration_s": 1.0, "cpu": "c", "cpu_count": 2,
           "torch": "t", "transformers": "t", "vllm": None, "load_avg_1m_start": 1.0, "load_avg_1m_end": 1.0,
           "machine": {"copy_GBps": 10.0, "copy_bytes": 8 << 20, "gemm_GFLOPs": 50.0, "gemm_n": 64,
                       "linear_GBps": 5.0}, "rounds": 2,
           "thread_budget": {"ours": "2", "hf": "2", "vllm": None}, "points": [rec | {"batch_size": 1}],
           "vllm_start_error": None, "profiles": [], **stats}
    res["targets"] = _decode_report.targets(res)
    targets = {t["target"]: t for t in res["targets"]}  # batch 1 at context 32: the two batch-1 targets
    assert list(targets) == ["batch 1: ours / bandwidth floor", "batch 1: ours / vLLM"]
    assert targets["batch 1: ours / vLLM"]["met"] is None  # no vLLM in this run
    md = _decode_report.markdown(res)
    assert "| 1 | 32 | 4 |" in md and "## Step overhead (ours)" in md and "* batch 1, context 32: ours" in md


def test_floors_and_vllm_window():
    f = _common.decode_floors(weight_bytes=1000, num_params=100, kv_bytes_per_token=10,
                              attn_flops_per_ctx_token=4, batch_size=2, mean_context=50,
                              bandwidth_GBps=1e-6, gemm_rate=1e-6)
    assert f["bytes_per_step"] == 2000 and f["flops_per_step"] == 2 * (200 + 200)
    assert f["bandwidth_floor_ms"] == pytest.approx(2000.0) and f["roofline_floor_ms"] == f["bandwidth_floor_ms"]
    # r1 starts a step before r2; window = after r2's first token until r1 finishes (4 tokens)
    events = [(0.0, {"r1": 1}), (1.0, {"r1": 2, "r2": 1}), (2.0, {"r1": 3, "r2": 2}),
              (3.0, {"r1": 4, "r2": 3}), (4.0, {"r2": 4})]
    assert steady_window(events, 4) == {"window_s": 2.0, "window_steps": 2, "window_tokens": 4,
                                        "median_step_s": 1.0}
    assert _common.greedy_agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == {
        "identical_seqs": 1, "num_seqs": 2, "mean_common_prefix": 1.5}

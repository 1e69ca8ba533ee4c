"""Trace parsers on the real files shipped in loadtest/data (statistics from its README.md),
workload planning and exact-length prompts with the model's tokenizer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.prompts import PromptFactory, corpus_text
from loadtest.traces import MOONCAKE_BLOCK_TOKENS, default_traces_dir, load_trace, spread_ties, trace_path
from loadtest.workload import PlannedRequest, WorkloadConfig, WorkloadError, build_plan

TRACES = default_traces_dir()


@pytest.fixture(scope="module")
def traces():
    return {name: load_trace(name, TRACES) for name in
            ("azure-conv", "azure-code", "mooncake-conv", "mooncake-synthetic")}


def _col(rows, attr):
    return np.array([getattr(r, attr) for r in rows], dtype=np.float64)


def test_azure_conv(traces):
    rows = traces["azure-conv"]
    assert len(rows) == 19_366
    assert (rows[0].input_tokens, rows[0].output_tokens, rows[0].arrival_s) == (374, 44, 0.0)
    assert rows[1].arrival_s == pytest.approx(4.314579)  # 18:15:50.9951690 - 18:15:46.6805900
    assert (rows[1].input_tokens, rows[1].output_tokens) == (396, 109)
    assert rows[-1].arrival_s == pytest.approx(3501.72, abs=0.01)
    inp, out = _col(rows, "input_tokens"), _col(rows, "output_tokens")
    assert inp.mean() == pytest.approx(1154.7, abs=0.05) and np.percentile(inp, 50) == 1020
    assert (inp.min(), inp.max(), out.min(), out.max()) == (2, 14_050, 7, 1_000)
    assert out.mean() == pytest.approx(211.1, abs=0.05) and np.percentile(out, 99) == 601
    assert all(r.hash_ids is None for r in rows[:10])
    assert np.all(np.diff(_col(rows, "arrival_s")) > 0)  # sorted, no duplicates


def test_azure_code(traces):
    rows = traces["azure-code"]
    assert len(rows) == 8_819
    assert rows[-1].arrival_s == pytest.approx(3435.9, abs=0.05)
    inp, out = _col(rows, "input_tokens"), _col(rows, "output_tokens")
    assert inp.mean() == pytest.approx(2047.8, abs=0.05) and np.percentile(inp, 50) == 1469
    assert out.mean() == pytest.approx(27.9, abs=0.05) and np.percentile(out, 50) == 13
    assert (out.min(), out.max()) == (6, 1_899)


def test_mooncake_conversation(traces):
    rows = traces["mooncake-conv"]
    assert len(rows) == 12_031
    first = rows[0]
    assert (first.input_tokens, first.output_tokens, first.hash_ids) == (6758, 500, tuple(range(14)))
    t = _col(rows, "arrival_s")
    assert t[-1] == pytest.approx(3536.999) and len(set(t)) == 1_180  # bucketed to ~3 s
    assert _col(rows, "input_tokens").mean() == pytest.approx(12_035.1, abs=0.05)
    assert _col(rows, "output_tokens").mean() == pytest.approx(342.6, abs=0.05)
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / MOONCAKE_BLOCK_TOKENS) for r in rows)
    assert all(r.hash_ids[0] == 0 for r in rows)  # a shared first block
    assert sum(len(r.hash_ids) for r in rows) == 288_500
    assert len({h for r in rows for h in r.hash_ids}) == 182_790


def test_mooncake_synthetic(traces):
    rows = traces["mooncake-synthetic"]
    assert len(rows) == 3_993
    assert rows[-1].arrival_s == pytest.approx(1022.025)
    assert (rows[0].input_tokens, rows[0].output_tokens) == (40_160, 6)
    assert _col(rows, "input_tokens").mean() == pytest.approx(15_325.5, abs=0.05)
    assert sum(len(r.hash_ids) for r in rows) == 121_877


def test_trace_path_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown trace"):
        trace_path("sharegpt")
    with pytest.raises(FileNotFoundError, match="--traces-dir"):
        trace_path("azure-conv", tmp_path)


def test_spread_ties():
    assert spread_ties([0.0, 0.0, 0.0, 3.0, 3.0]) == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.5])
    assert spread_ties([1.0, 2.0]) == [1.0, 2.0]


def test_trace_slice_rate_and_time_scale():
    plan, clip = build_plan(WorkloadConfig(source="azure-conv", num_requests=50, skip=100), TRACES)
    rows = load_trace("azure-conv", TRACES)[100:150]
    assert [p.input_tokens for p in plan] == [r.input_tokens for r in rows]
    assert plan[0].arrival_s == 0.0
    assert plan[-1].arrival_s == pytest.approx(rows[-1].arrival_s - rows[0].arrival_s)
    fast, _ = build_plan(WorkloadConfig(source="azure-conv", num_requests=50, skip=100, time_scale=0.1), TRACES)
    assert fast[-1].arrival_s == pytest.approx(plan[-1].arrival_s * 0.1)
    paced, _ = build_plan(WorkloadConfig(source="azure-conv", num_requests=50, skip=100, rate=2.0), TRACES)
    assert 49 / paced[-1].arrival_s == pytest.approx(2.0)  # mean rate as asked, same burst pattern
    gaps, paced_gaps = np.diff([p.arrival_s for p in plan]), np.diff([p.arrival_s for p in paced])
    assert np.allclose(paced_gaps / gaps, paced_gaps[0] / gaps[0])
    assert clip.inputs_clipped == 0 and clip.outputs_clipped == 0


def test_clipping_is_reported():
    cfg = WorkloadConfig(source="azure-conv", num_requests=20, max_input_tokens=128, max_output_tokens=16)
    plan, clip = build_plan(cfg, TRACES)
    rows = load_trace("azure-conv", TRACES)[:20]
    assert all(p.input_tokens == min(r.input_tokens, 128) and p.output_tokens == min(r.output_tokens, 16)
               for p, r in zip(plan, rows))
    assert clip.inputs_clipped == sum(r.input_tokens > 128 for r in rows)
    assert clip.input_tokens_removed == sum(max(0, r.input_tokens - 128) for r in rows)
    assert clip.outputs_clipped == sum(r.output_tokens > 16 for r in rows)
    fitted, clip2 = build_plan(WorkloadConfig(source="azure-conv", num_requests=20), TRACES, max_model_len=300)
    assert all(p.input_tokens + p.output_tokens <= 300 and p.input_tokens >= 1 for p in fitted)
    assert clip2.fitted_to_max_model_len > 0


def test_synthetic_arrivals_and_lengths():
    n = 4000
    poisson, _ = build_plan(WorkloadConfig(source="synthetic", num_requests=n, rate=4.0, seed=1))
    gaps = np.diff([p.arrival_s for p in poisson])
    assert gaps.mean() == pytest.approx(0.25, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)
    bursty, _ = build_plan(WorkloadConfig(source="synthetic", num_requests=n, rate=4.0, arrival="gamma",
                                          burstiness=0.25, seed=1))
    gaps = np.diff([p.arrival_s for p in bursty])
    assert gaps.mean() == pytest.approx(0.25, rel=0.1) and gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)
    assert {(p.input_tokens, p.output_tokens) for p in poisson} == {(128, 32)}
    ranged, _ = build_plan(WorkloadConfig(source="synthetic", num_requests=500, input_len=100, len_range=0.5))
    assert {p.input_tokens for p in ranged} <= set(range(50, 151)) and len({p.input_tokens for p in ranged}) > 50
    sampled, _ = build_plan(WorkloadConfig(source="synthetic", num_requests=200, lengths_from="azure-code"), TRACES)
    code = {(r.input_tokens, r.output_tokens) for r in load_trace("azure-code", TRACES)}
    assert all((p.input_tokens, p.output_tokens) in code for p in sampled)
    again, _ = build_plan(WorkloadConfig(source="synthetic", num_requests=n, rate=4.0, seed=1))
    assert again == poisson  # seeded


def test_mooncake_block_scaling():
    cfg = WorkloadConfig(source="mooncake-synthetic", num_requests=200, block_scale=1 / 16)
    plan, clip = build_plan(cfg, TRACES)
    assert all(p.block_tokens == 32 for p in plan)
    assert all(len(p.hash_ids) == math.ceil(p.input_tokens / 32) for p in plan)
    assert plan[0].input_tokens == 78 * 32 + round((40_160 - 78 * 512) / 16)
    assert "32 tokens" in clip.notes[0]


@pytest.mark.parametrize("kwargs", [
    dict(num_requests=0), dict(rate=-1.0), dict(rate=2.0, time_scale=0.5), dict(source="synthetic", time_scale=2.0),
    dict(source="nope"), dict(block_scale=0.5), dict(source="synthetic", burstiness=0.5),
    dict(max_input_tokens=0), dict(source="synthetic", len_range=1.0),
])
def test_workload_validation(kwargs):
    with pytest.raises(WorkloadError):
        WorkloadConfig(**kwargs)


def test_slice_beyond_trace():
    with pytest.raises(WorkloadError, match="19366 rows"):
        build_plan(WorkloadConfig(source="azure-conv", num_requests=10, skip=19_360), TRACES)


def test_prompts_exact_length_from_real_text(tokenizer):
    text = corpus_text(TRACES)
    assert "FROM fairest creatures" in text and "time management" in text
    factory = PromptFactory.from_tokenizer(tokenizer, TRACES, seed=3)
    assert factory.corpus_tokens > 5_000
    plan, _ = build_plan(WorkloadConfig(source="azure-conv", num_requests=30), TRACES)
    for req in plan:
        ids = factory.prompt(req)
        assert len(ids) == req.input_tokens
    ids = factory.prompt(PlannedRequest(0, 0.0, 40, 1))
    words = tokenizer.decode(ids).split()
    assert len(words) > 10 and factory.prompt(PlannedRequest(0, 0.0, 40, 1)) == ids  # deterministic
    assert factory.prompt(PlannedRequest(1, 0.0, 40, 1)) != ids


def test_mooncake_prompts_share_real_prefixes():
    factory = PromptFactory(list(range(1000)), seed=0)
    a = PlannedRequest(0, 0.0, 100, 1, hash_ids=(0, 1, 2, 3), block_tokens=32)
    b = PlannedRequest(1, 0.0, 90, 1, hash_ids=(0, 1, 7), block_tokens=32)
    pa, pb = factory.prompt(a), factory.prompt(b)
    assert len(pa) == 100 and len(pb) == 90
    assert pa[:64] == pb[:64] and pa[64:90] != pb[64:90]
    clipped = factory.prompt(PlannedRequest(2, 0.0, 40, 1, hash_ids=(0, 1, 2, 3), block_tokens=32))
    assert clipped == pa[:40]

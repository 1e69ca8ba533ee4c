"""Smoke test of bench/prefill.py's and bench/kvtransfer.py's measurement functions: the
FLOP formula and step plans, one tiny prefill point with its profile, real transfers per
transport into a tiny receiver process, the gRPC stage costs, the py-spy classifier and
both reports."""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.append(str(BENCH))

import _kv_main  # noqa: E402
import _kv_measure as km  # noqa: E402
import _kv_pyspy  # noqa: E402
import _kv_report  # noqa: E402
import _kv_stages  # noqa: E402
import _prefill_measure as pm  # noqa: E402
import _prefill_report  # noqa: E402
import prefill  # noqa: E402

from engine.model import load_model  # noqa: E402
from kvtransfer import onepass  # noqa: E402
from engine.model.linear import dense_weights  # noqa: E402

import _common  # noqa: E402


@pytest.fixture(scope="module")
def model(model_config):
    return load_model(model_config, torch.device("cpu"), torch.float32)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a busy 2-core machine two threads wait on each other at every
    operator (seconds per tiny step); this test checks the measurement code, not speed."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_flops_and_step_plans(model, model_config):
    cfg = model_config
    params = pm.non_embedding_params(model)
    layer = sum(p.numel() for p in dense_weights(model.model.layers[0]).values())
    assert params == cfg.num_layers * layer + cfg.hidden_size  # layers + final norm, no embeddings
    f = pm.prefill_flops(cfg, params, [3, 2])
    per_pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert f["linear_flops"] == 2 * params * 5 and f["attention_flops"] == per_pair * (6 + 3)
    assert f["flops"] == f["linear_flops"] + f["attention_flops"]
    prompts = [list(range(10, 50)), list(range(60, 70)), list(range(80, 90))]
    plans = pm.step_plans(prompts, per_step=3, budget=16)  # 60 tokens > budget: every prompt on its own
    assert [[(s.request_id, len(s.token_ids), s.num_computed, s.sample) for s in p.seqs] for p in plans] == [
        [("p0", 16, 0, False)], [("p0", 16, 16, False)], [("p0", 8, 32, True)],
        [("p1", 10, 0, True)], [("p2", 10, 0, True)]]
    packed = pm.step_plans(prompts[1:], per_step=2, budget=32)
    assert len(packed) == 1 and [s.request_id for s in packed[0].seqs] == ["p0", "p1"]
    tables = [s.block_table for s in packed[0].seqs]
    assert not set(tables[0]) & set(tables[1]) and 0 not in tables[0] + tables[1]


def test_one_prefill_point_and_report(model, model_config, tokenizer):
    params = pm.non_embedding_params(model)
    prompts = _common.sonnet_prompts(tokenizer, 2, 8)
    single = prefill.run_point(model, model_config, params, prompts, "single", 16, reps=2, gemm_n=64)
    batched = prefill.run_point(model, model_config, params, prompts, "batched", 16, reps=2, gemm_n=64)
    assert (single["steps"], batched["steps"], batched["prompts_per_step"]) == (2, 1, 2)
    for rec in (single, batched):
        assert rec["tokens"] == 16 and rec["tokens_per_s"] > 0 and rec["ratio_roofline"] > 0
        assert len(rec["seconds_all"]) == 2 and len(rec["gemm_GFLOPs_all"]) == 2
        assert rec["tokens_per_s"] == pytest.approx(16 / rec["seconds"])
    runner = pm.make_runner(model, model_config, 8, 1)
    prof = pm.profile_step(runner, pm.step_plans(prompts[:1], 1, 16), gemm_n=64) | {
        "prompt_len": 8, "flops": pm.prefill_flops(model_config, params, [8]),
        "attention_variants": pm.attention_variants(model_config, 8, reps=1)}
    assert sum(c["ms"] for c in prof["categories"]) == pytest.approx(prof["wall_ms"], rel=1e-6)
    assert next(c for c in prof["categories"] if c["category"].startswith("GEMM"))["ms"] > 0
    assert prof["attention_variants"]["max_abs_diff"] < 1e-4
    args = argparse.Namespace(diag_threads=1, threads=1, lengths=[8], budget=16, reps=1, gemm_n=64)
    diag = prefill.thread_diagnostic(args, model, model_config, params, tokenizer, [single])
    assert [(d["prompt_len"], d["threads"]) for d in diag] == [(8, 1)] and diag[0]["ratio_vs_main_threads"] > 0
    single |= {"prompt_len": 2048}
    res = {"quick": True, "model": "m", "started_at": "t", "duration_s": 1.0, "cpu": "c", "cpu_count": 2,
           "torch": "t", "thread_budget": "2", "load_avg_1m_start": 1.0, "load_avg_1m_end": 1.0, "block_size": 16,
           "budget_tokens": 16, "reps": 2, "flops_formula": "f", "non_embedding_params": params, "num_layers": 30,
           "num_heads": 9, "head_dim": 64, "gemm_n": 64, "points": [single | {"ratio_batched_vs_single": None}],
           "profile": prof, "threads": 1, "thread_diagnostic": diag}
    res["targets"] = prefill.targets(res)
    assert res["targets"][0]["met"] == (single["ratio_roofline"] >= 0.6)
    md = _prefill_report.markdown(res)
    assert "| 2048 | single | 2 | 1 | 2 | 16 |" in md and "## Profile" in md and "(diagnostic)" in md


def _line_of(path: str, text: str) -> int:
    """1-based number of the first line of ``path`` (repo-relative) containing ``text``."""
    lines = (BENCH.parent / path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_transfers_per_transport_and_report():
    shape = (2, 2, 6, 4, 2, 8)  # layers, K/V, blocks, block size, KV heads, head_dim
    kv = torch.randn(*shape)
    src = [3, 1, 4]
    with km.Receiver(shape, max_chunk_bytes=1100) as receiver:  # 2 chunks per layer
        m = km.measure_transports(receiver, kv, src, reps=2, layers_per_chunk=1, max_chunk_bytes=1100)
        assert m["verified"] and m["payload_bytes"] == 2 * 2 * 3 * 4 * 2 * 8 * 4
        assert m["grpc"]["num_chunks"] == 4 and len(m["raw_tcp"]["latency_ms_all"]) == 2
        samples = _kv_pyspy.summarize(collections.Counter({
            "gather_blocks (kvtransfer/blocks.py:76)": 3, "Condition.wait (threading.py:331)": 5,
            f"crc32c (kvtransfer/checksum.py:{_line_of('kvtransfer/checksum.py', 'return int(_EXTEND(0, address')})": 2,
            "_transform (grpc/_common.py:87)": 1}))
    assert (samples["busy_samples"], samples["idle_samples"]) == (6, 5)
    cats = {c["category"]: c["samples"] for c in samples["categories"]}
    assert cats["CRC32C"] == 2 and cats["gather (index_select of the blocks into the reused buffer)"] == 3
    assert _kv_pyspy.parse_raw("a;b (x.py:1) 3\na;c (y.py:2);d (lib.so) 4\n") == {"b (x.py:1)": 3, "c (y.py:2)": 4}
    nat = _kv_pyspy.native_breakdown("f (nofile.py:1);0x7f01 (libc.so.6) 2\nf (nofile.py:1);sendmsg (libc.so.6) 1\n",
                                     "other")
    assert [(t["frame"], t["samples"]) for t in nat["leaves"]] == [("unresolved address in libc.so.6", 2),
                                                                   ("sendmsg (libc.so.6)", 1)]
    st = _kv_stages.grpc_stage_costs(kv, src, 1, 1100, reps=1)
    assert st["payload_bytes"] == m["payload_bytes"] and st["num_chunks"] == 4
    # the one-pass stage where the C++ kernel is built (the real path), else the plain path's four
    assert set(st["sender"]) == ({"onepass"} if onepass.available() else {k for k, _ in _kv_report.SENDER_STAGES[1:]})
    assert set(st["receiver"]) == {k for k, _ in _kv_report.RECEIVER_STAGES}
    recs = _kv_main.records(1024, m, {"prefill_s": 2.0, "prefill_s_all": [2.0], "prefill_steps": 1,
                                      "prefill_warmup": True, "prefill_roofline_s": 0.5}, (1.0, 1.1))
    assert [r["transport"] for r in recs] == ["grpc", "grpc_floor", "raw_tcp"] and recs[2]["ratio_raw_tcp"] == 1.0
    assert m["grpc_floor"]["num_chunks"] == 4 and recs[1]["verified"] is None
    assert recs[0]["ratio_prefill_time"] == pytest.approx(recs[0]["latency_ms"] / 2000)
    assert recs[0]["ratio_prefill_time_at_roofline"] == pytest.approx(recs[0]["latency_ms"] / 500)
    res = {"quick": True, "model": "m", "started_at": "t", "duration_s": 1.0, "cpu": "c", "cpu_count": 2,
           "torch": "t", "grpc": "g", "load_avg_1m_start": 1.0, "load_avg_1m_end": 1.0, "processes": "p",
           "thread_budget": "t", "kv_bytes_per_token": 46080, "block_size": 4, "layers_per_chunk": 1,
           "max_chunk_bytes": 1100, "reps": 2, "points": recs, "grpc_stage_costs": {"1024": st}, "py_spy": None}
    res["targets"] = _kv_report.targets(res)
    assert [(t["target"], t["limit"]) for t in res["targets"]] == [
        ("grpc GB/s / raw loopback TCP GB/s", ">= 0.40"), ("grpc transfer time / prefill time", "<= 0.10")]
    md = _kv_report.markdown(res)
    assert "| 1024 | grpc |" in md and "| 1024 | raw_tcp |" in md and "py-spy was not run." in md
    assert "| 1024 | grpc_floor |" in md and "(`grpc_floor`, no KV work on either side)" in md
    full = _kv_report.targets(res | {"quick": False, "points": recs + [recs[0] | {"transport": "torch_dist"}]})
    assert [(t["target"], t["limit"]) for t in full][:3] == [
        ("grpc GB/s / raw loopback TCP GB/s", ">= 0.60"), ("grpc transfer time / prefill time", "<= 0.10"),
        ("torch_dist GB/s / raw loopback TCP GB/s", ">= 0.60")]


def test_bench_script_does_not_shadow_the_package(monkeypatch):
    """bench/kvtransfer.py imported as ``kvtransfer`` (bench/ first on sys.path) is the package."""
    monkeypatch.syspath_prepend(str(BENCH))
    for name in [n for n in sys.modules if n == "kvtransfer" or n.startswith("kvtransfer.")]:
        monkeypatch.delitem(sys.modules, name)
    pkg = importlib.import_module("kvtransfer")
    assert Path(pkg.__file__).parent.name == "kvtransfer" and hasattr(pkg, "GrpcKvSender")

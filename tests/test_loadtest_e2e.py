"""`pdcluster loadtest` end to end: 20 Azure-conversation requests (lengths clipped) against a
real local cluster (1 prefill + 1 decode), through the CLI parser as a user runs it."""

from __future__ import annotations

import json

import pytest

from loadtest.traces import load_trace
from pdcluster.cli import main

from cluster_utils import assert_no_leak, running_cluster

N, MAX_IN, MAX_OUT = 20, 128, 16
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")



@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", "512", "--block-size", "16",
                         "--num-kv-blocks", "400", "--heartbeat-s", "0.5") as state:
        yield state


@pytest.mark.timeout(300)
def test_loadtest_20_azure_conv_requests(cluster, tmp_path):
    out = tmp_path / "lt"
    rc = main(["loadtest", "--address", cluster["router_address"], "--workload", "azure-conv",
               "--num-requests", str(N), "--max-input-tokens", str(MAX_IN), "--max-output-tokens", str(MAX_OUT),
               "--time-scale", "0.5", "--duration", "60", "--drain-timeout", "60", "--slo", "ttft=2s,tpot=200ms",
               "--output-dir", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["sent"] == N and s["completed"] + s["failed"] == s["sent"]
    assert s["completed"] == N and s["failed"] == 0 and s["errors"] == {} and not s["interrupted"]

    rows = load_trace("azure-conv")[:N]
    assert s["clipping"]["inputs_clipped"] == sum(r.input_tokens > MAX_IN for r in rows)
    assert s["total_output_tokens"] == sum(min(r.output_tokens, MAX_OUT) for r in rows)  # ignore_eos: exact
    assert s["output_token_mismatches"] == 0

    for key in LATENCIES:
        assert set(s[key]) >= {"mean", "p50", "p90", "p95", "p99"}
        st = s[key]
        assert 0 <= st["p50"] <= st["p90"] <= st["p95"] <= st["p99"], (key, st)
        assert st["mean"] > 0 and st["p99"] < 60_000, (key, st)
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] and s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert s["itl_ms"]["p99"] >= s["tpot_ms"]["p50"] * 0.5
    assert 0 < s["duration_s"] < 60
    assert s["request_throughput"] == pytest.approx(N / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert 0.0 <= s["slo_attainment"] <= 1.0
    assert s["goodput"] == pytest.approx(s["slo_attainment"] * N / s["duration_s"])
    assert s["max_send_lag_ms"] < 1_000

    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(N))
    for r, row in zip(records, rows):
        assert r["status"] == "OK" and r["finish_reason"] == "LENGTH"
        assert r["input_tokens"] == min(row.input_tokens, MAX_IN)
        assert len(r["token_times_s"]) == r["expected_output_tokens"] == min(row.output_tokens, MAX_OUT)
        assert r["arrival_s"] <= r["token_times_s"][0] <= r["token_times_s"][-1] <= r["end_s"]
    for name in ("report.md", "cdf.png", "latency_over_time.png", "throughput_over_time.png", "overview.png"):
        assert (out / name).stat().st_size > 1_000, name
    assert_no_leak(cluster)

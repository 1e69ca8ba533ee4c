"""bench/disagg_vs_colocated.py: its statistics and load gate (pure functions, against hand
computations), and an end-to-end smoke run (colocated only, 1 workload, 1 rate, 2 repetitions
of 4 requests, load gate opened with --max-load 100) checking the JSON document."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cluster_utils import live_session_members

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _disagg_stats as ds  # noqa: E402


def test_mean_ci_matches_a_hand_computation():
    # values 1, 2, 6: mean 3, sample variance ((4 + 1 + 9) / 2) = 7, t_{0.975,2} = 4.303
    ci = ds.mean_ci([1.0, 2.0, 6.0])
    half = 4.303 * math.sqrt(7) / math.sqrt(3)
    assert ci["n"] == 3 and ci["mean"] == pytest.approx(3.0)
    assert ci["ci95_half"] == pytest.approx(half) and ci["ci95_low"] == pytest.approx(3 - half)
    assert ci["ci95_high"] == pytest.approx(3 + half) and ci["values"] == [1.0, 2.0, 6.0]
    two = ds.mean_ci([10.0, None, 14.0])  # a missing p99 (no completion) is left out
    assert two["n"] == 2 and two["mean"] == 12.0
    assert two["ci95_half"] == pytest.approx(12.706 * math.sqrt(8) / math.sqrt(2))
    assert ds.mean_ci([5.0])["ci95_half"] is None and ds.mean_ci([])["mean"] is None


def test_t_quantiles():
    assert ds.t_quantile_975(1) == 12.706 and ds.t_quantile_975(4) == 2.776
    assert ds.t_quantile_975(30) == ds.t_quantile_975(200) == 2.042
    with pytest.raises(ValueError, match="df"):
        ds.t_quantile_975(0)


class FakeClock:
    def __init__(self, loads):
        self.t, self.loads, self.slept = 0.0, list(loads), []

    def read(self):
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def _wait(clock, **kw):
    opts = dict(max_load=1.0, idle_baseline=0.3, wait_s=30.0, poll_s=10.0) | kw
    return ds.wait_for_load(clock.read, clock.sleep, lambda: clock.t, **opts)


def test_load_gate_decisions():
    assert ds.gate_value(1.25, 0.3) == pytest.approx(0.95) and ds.gate_value(0.5, -1.0) == 0.5
    ok = _wait(FakeClock([1.2]))  # 1.2 - 0.3 <= 1.0: no wait
    assert ok == {"ok": True, "load_1m": 1.2, "gate_value": pytest.approx(0.9), "waited_s": 0.0}
    c = FakeClock([2.0, 1.8, 1.25])  # drops under the gate on the third reading
    got = _wait(c)
    assert got["ok"] and got["load_1m"] == 1.25 and got["waited_s"] == 20.0 and c.slept == [10.0, 10.0]
    c = FakeClock([3.0])  # never drops: refused after wait_s, the last reading reported
    got = _wait(c, wait_s=25.0)
    assert not got["ok"] and got["load_1m"] == 3.0 and got["waited_s"] == 25.0 and c.slept == [10.0, 10.0, 5.0]
    assert not _wait(FakeClock([1.31]), wait_s=0.0)["ok"]
    with pytest.raises(ValueError, match="poll_s"):
        _wait(FakeClock([0.0]), poll_s=0)


def _point(rate, att, itl, runs=1):
    return {"rate": rate, "runs": [{}] * runs,
            "stats": {"slo_attainment": {"mean": att}, "itl_p99_ms": {"mean": itl}}}


def test_sweep_decisions_and_targets():
    colo = [_point(0.2, 1.0, 200), _point(0.4, 0.95, 300), _point(0.8, 0.5, 1000)]
    dis = [_point(0.2, 1.0, 150), _point(0.4, 1.0, 160), _point(0.8, 0.92, 400)]
    assert ds.distserve_goodput(colo, 0.9) == 0.4 and ds.distserve_goodput(dis, 0.9) == 0.8
    assert ds.should_stop(colo[2], 0.9) and not ds.should_stop(colo[1], 0.9) and not ds.should_stop(colo[2], None)
    assert ds.comparison_rate(colo, 0.9) == 0.8 and ds.comparison_rate(colo[:2], 0.9) == 0.4
    t = ds.targets(dis, colo, 0.9)
    assert t["itl"]["rate"] == 0.8 and t["itl"]["ratio"] == pytest.approx(0.4) and t["itl"]["met"] is True
    assert t["goodput"] == {"disagg": 0.8, "colocated": 0.4, "met": True}
    t = ds.targets(dis[:2], colo[:2], 0.9)  # at 0.4: 160 / 300 > 0.5
    assert t["itl"]["met"] is False and t["goodput"]["met"] is True
    assert ds.targets([], colo, 0.9)["goodput"]["met"] is None and ds.targets([], colo, 0.9)["itl"]["met"] is None


def test_aggregate_point():
    runs = [{"goodput": 1.0, "slo_attainment": 1.0, "itl_p99_ms": 100.0, "ttft_p99_ms": None},
            {"goodput": 3.0, "slo_attainment": 0.5, "itl_p99_ms": 300.0, "ttft_p99_ms": 50.0}]
    agg = ds.aggregate_point(runs)
    assert set(agg) == set(ds.COMPARED + ds.GAPS) and agg["goodput"]["mean"] == 2.0 and agg["ttft_p99_ms"]["n"] == 1
    assert agg["last_gap_p99_ms"]["n"] == 0 and agg["last_gap_p99_ms"]["mean"] is None  # runs recorded before the gaps
    assert agg["slo_attainment"]["ci95_half"] == pytest.approx(12.706 * math.sqrt(0.125) / math.sqrt(2))


def test_profile_is_the_difference_of_two_readings():
    import _disagg_profile as dp

    before = {"router": {"time_to_first_token_seconds_sum": 1.0, "time_to_first_token_seconds_count": 2},
              "workers": {"prefill_step_seconds_sum": 2.0, "prefill_step_seconds_count": 4,
                          "prefill_batch_tokens_sum": 1000, "prefill_batch_tokens_count": 4}}
    after = {"router": {"time_to_first_token_seconds_sum": 4.0, "time_to_first_token_seconds_count": 6},
             "workers": {"prefill_step_seconds_sum": 6.0, "prefill_step_seconds_count": 8,
                         "prefill_batch_tokens_sum": 3000, "prefill_batch_tokens_count": 8,
                         "decode_time_seconds_sum": 1.5, "decode_time_seconds_count": 50}}
    prof = dp.profile(before, after, wall_s=8.0)
    assert prof["ttft_mean_ms"] == pytest.approx(750.0)  # 3 s over 4 requests
    assert prof["prefill_step_mean_ms"] == pytest.approx(1000.0) and prof["prefill_step_tokens_mean"] == 500
    assert prof["prefill_tokens_per_s"] == pytest.approx(500.0) and prof["prefill_busy"] == pytest.approx(0.5)
    assert prof["decode_step_mean_ms"] == pytest.approx(30.0) and prof["decode_busy"] == pytest.approx(1.5 / 8)
    assert prof["kv_transfer_mean_ms"] is None and prof["prefill_queue_mean_ms"] is None
    assert dp.profile(None, after, 8.0) == {}
    runs = [{"profile": prof}, {"profile": {}}, {"profile": prof | {"ttft_mean_ms": 250.0}}]
    assert dp.mean_profile(runs)["ttft_mean_ms"] == pytest.approx(500.0)


def test_attainment_and_goodput_by_slo_scale():
    from loadtest.metrics import SLO

    records = [_record(0, [1.0, 1.0625]), _record(1, [3.0, 3.0625]),  # TTFT 1 s and 3 s, TPOT 62.5 ms
               _record(2, [0.5]), _record(3, [0.1, 0.11], status="UNAVAILABLE")]  # TTFT 0.5 s, no TPOT; failed
    att = ds.attainment_by_scale(records, SLO(ttft_s=2.0, tpot_s=0.2), [0.25, 1, 2])
    # a limit met on the boundary and a missing TPOT count; a failure never does
    assert att == {"0.25": 0.25, "1": 0.5, "2": 0.75}
    assert ds.attainment_by_scale([], SLO(ttft_s=2.0), [1]) == {"1": 0.0}
    points = [{"rate": 1.0, "runs": [{"attainment_by_slo_scale": {"0.5": 0.95, "1": 1.0}},
                                     {"attainment_by_slo_scale": {"0.5": 0.8, "1": 1.0}}]},
              {"rate": 2.0, "runs": [{"attainment_by_slo_scale": {"0.5": 0.5, "1": 0.95}}, {}]}]
    assert ds.goodput_by_scale(points, [0.5, 1, 4], 0.9) == {
        "0.5": {"goodput": None, "at_highest": False},  # mean 0.875 at the lowest rate
        "1": {"goodput": 2.0, "at_highest": True}, "4": {"goodput": None, "at_highest": False}}


def test_itl_by_gap_splits_first_middle_and_last():
    # streams: 4 tokens (gaps 0.1, 0.2, 0.9), 2 tokens (gap 0.3), 1 token (no gap)
    got = ds.itl_by_gap([[0.0, 0.1, 0.3, 1.2], [5.0, 5.3], [7.0]])
    assert got["first_gap_p99_ms"] == pytest.approx(np.percentile([100.0, 300.0], 99))
    assert got["middle_gap_p99_ms"] == pytest.approx(200.0)
    assert got["last_gap_p99_ms"] == pytest.approx(900.0)
    assert ds.itl_by_gap([[1.0], [2.0, 2.5]]) == {"first_gap_p99_ms": pytest.approx(500.0),
                                                  "middle_gap_p99_ms": None, "last_gap_p99_ms": None}


def test_smoke_end_to_end(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "disagg_vs_colocated.py"), "--modes", "colocated",
           "--workloads", "conversation", "--rates", "1", "--repetitions", "2", "--num-requests", "4",
           "--warmup-requests", "2", "--max-load", "100", "--baseline-window-s", "1", "--load-poll-s", "1",
           "--run-duration", "60", "--drain-timeout", "60", "--results-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "disagg_vs_colocated.json").read_text())
    assert (tmp_path / "disagg_vs_colocated.png").is_file()
    assert "### Profile (conversation)" in (tmp_path / "disagg_vs_colocated.md").read_text()
    assert res["config"]["repetitions"] == 2 and res["config"]["num_requests"] == 4
    mode = res["modes"]["colocated"]
    assert mode["up_args"] == {"conversation": ["--colocated", "--workers", "2"]}
    cluster = mode["clusters"]["conversation"]
    assert "skipped" not in cluster and cluster["warmup"]["requests"] == 2 and cluster["idle_baseline"]["measured"]
    assert cluster["idle_baseline"]["cores"] >= 0
    w = res["workloads"]["conversation"]
    [point] = w["modes"]["colocated"]["points"]
    assert point["rate"] == 1.0 and len(point["runs"]) == 2 and point["skipped_runs"] == []
    for run in point["runs"]:
        assert run["sent"] == 4 and run["completed"] + run["failed"] <= 4 and run["load_1m_before"] >= 0
        assert 0 < run["cluster_cpu_cores"] <= os.cpu_count() + 0.5
        prof = run["profile"]  # read from the cluster's own /metrics: both phases of the colocated workers
        assert prof["ttft_mean_ms"] > 0 and prof["prefill_step_mean_ms"] > 0 and prof["prefill_tokens_per_s"] > 0
        assert 0 < prof["prefill_busy"] < 2.5 and 0 < prof["decode_busy"] < 2.5 and prof["decode_batch_mean"] >= 1
    assert {run["rep"] for run in point["runs"]} == {0, 1}
    assert set(point["stats"]) == set(ds.COMPARED + ds.GAPS) and point["stats"]["goodput"]["n"] == 2
    assert all(run["middle_gap_p99_ms"] is None or run["middle_gap_p99_ms"] > 0 for run in point["runs"])
    assert w["targets"]["goodput"]["met"] is None  # disaggregated not run
    assert (tmp_path / "runs" / "conversation" / "colocated" / "rate_1" / "rep_1" / "summary.json").is_file()
    left = live_session_members(cluster["ray_head_pid"], timeout_s=20.0)  # the cluster is down
    assert not left, f"processes of the Ray head's session still running after the bench ended: {left}"


def _record(index: int, token_times_s: list[float], status: str = "OK"):
    """A loadtest request record sent at 0 s whose tokens arrived at ``token_times_s``."""
    from loadtest.records import RequestRecord

    return RequestRecord(index=index, request_id=f"r{index}", scheduled_s=0.0, arrival_s=0.0, input_tokens=8,
                         expected_output_tokens=len(token_times_s), token_times_s=token_times_s, status=status)


def _fake_summary(rate: float, attainment: float = 1.0, itl_p99_ms: float = 30.0) -> dict:
    """A loadtest summary of 4 requests at ``rate``, as the fake replays of the sweep tests return."""
    return {"model": "m", "sent": 4, "completed": 4, "failed": 0, "duration_s": 4.0, "request_throughput": 1.0,
            "output_throughput": 16.0, "slo_attainment": attainment, "goodput": attainment * rate,
            "ttft_ms": {"p50": 10.0, "p99": 20.0}, "itl_ms": {"p99": itl_p99_ms}, "tpot_ms": {"mean": 5.0, "p99": 6.0}}


def test_sweep_stops_with_colocated_and_disaggregated_follows(tmp_path, monkeypatch):
    """The sweep's control flow with fake clusters: colocated stops after the first rate whose
    mean attainment is < 0.9, disaggregated runs exactly colocated's rates, each mode warms
    up once (unrecorded), and a run whose load gate stays shut is skipped, not recorded."""
    import contextlib

    import _disagg_cluster as dc
    import disagg_vs_colocated as bench

    calls, loads = [], iter([0.5, 0.5, 9.0] + [0.5] * 20)  # the third gated run (rate 2, rep 0) sees load 9
    attainment = {"colocated": {1.0: 1.0, 2.0: 0.5, 4.0: 0.0}, "disaggregated": {1.0: 1.0, 2.0: 0.95}}

    @contextlib.contextmanager
    def fake_cluster(mode, workload):
        yield {"mode": mode, "router_address": "x", "ray_head_pid": None}, ""

    def fake_replay(state, workload, args, out):
        calls.append((state["mode"], workload.rate, workload.num_requests, out is not None))
        att = attainment[state["mode"]][workload.rate]
        return _fake_summary(workload.rate, att, itl_p99_ms=100.0 if state["mode"] == "colocated" else 30.0)

    monkeypatch.setattr(dc, "cluster", fake_cluster)
    monkeypatch.setattr(dc, "replay", fake_replay)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    assert bench.main(["--workloads", "code", "--rates", "1,2,4", "--repetitions", "2", "--num-requests", "4",
                       "--warmup-requests", "3", "--stop-below-attainment", "0.9", "--idle-baseline", "0.2",
                       "--load-wait-s", "0", "--results-dir", str(tmp_path)]) == 0
    warm = [c for c in calls if not c[3]]
    assert warm == [("colocated", 1.0, 3, False), ("disaggregated", 1.0, 3, False)]
    assert [c[:2] for c in calls if c[3]] == [("colocated", 1.0), ("colocated", 1.0), ("colocated", 2.0),
                                              ("disaggregated", 1.0), ("disaggregated", 1.0),
                                              ("disaggregated", 2.0), ("disaggregated", 2.0)]
    res = json.loads((tmp_path / "disagg_vs_colocated.json").read_text())
    colo = res["workloads"]["code"]["modes"]["colocated"]
    assert [p["rate"] for p in colo["points"]] == [1.0, 2.0] and len(colo["points"][1]["runs"]) == 1
    assert colo["points"][1]["stats"]["slo_attainment"]["n"] == 1 and colo["points"][1]["runs"][0]["rep"] == 1
    [skipped] = colo["points"][1]["skipped_runs"]
    assert skipped == {"rep": 0, "ok": False, "load_1m": 9.0, "gate_value": pytest.approx(8.8),
                       "waited_s": pytest.approx(0, abs=1)}
    disagg = res["workloads"]["code"]["modes"]["disaggregated"]
    assert colo["distserve_goodput"] == 1.0 and disagg["distserve_goodput"] == 2.0
    t = res["workloads"]["code"]["targets"]
    assert t["itl"]["rate"] == 2.0 and t["itl"]["ratio"] == pytest.approx(0.3) and t["itl"]["met"] is True
    assert t["goodput"]["met"] is True
    assert res["modes"]["colocated"]["clusters"]["code"]["idle_baseline"] == {"cores": 0.2, "measured": False}
    md = (tmp_path / "disagg_vs_colocated.md").read_text()
    assert "rep 0: 9.00" in md and "**met**" in md


def test_resume_keeps_runs_recorded_with_the_same_settings(tmp_path, monkeypatch):
    """``--resume``: a second invocation runs only what the first did not record, and a run recorded
    with other settings (here another --num-requests) is run again."""
    import contextlib

    import _disagg_cluster as dc
    import disagg_vs_colocated as bench

    calls = []

    @contextlib.contextmanager
    def fake_cluster(mode, workload):
        yield {"mode": mode, "router_address": "x", "ray_head_pid": None}, ""

    def fake_replay(state, workload, args, out):
        if out is not None:
            calls.append((state["mode"], workload.rate, workload.num_requests))
        return _fake_summary(workload.rate)

    monkeypatch.setattr(dc, "cluster", fake_cluster)
    monkeypatch.setattr(dc, "replay", fake_replay)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    common = ["--workloads", "code", "--modes", "colocated", "--repetitions", "2", "--warmup-requests", "0",
              "--idle-baseline", "0", "--results-dir", str(tmp_path)]
    assert bench.main([*common, "--rates", "1", "--num-requests", "4"]) == 0
    assert calls == [("colocated", 1.0, 4)] * 2
    calls.clear()
    assert bench.main([*common, "--rates", "1,2", "--num-requests", "4", "--resume"]) == 0
    assert calls == [("colocated", 2.0, 4)] * 2  # rate 1 kept from the first invocation
    res = json.loads((tmp_path / "disagg_vs_colocated.json").read_text())
    points = res["workloads"]["code"]["modes"]["colocated"]["points"]
    assert [len(p["runs"]) for p in points] == [2, 2] and all(r.get("resumed") for r in points[0]["runs"])
    calls.clear()
    run_dir = tmp_path / "runs" / "code" / "colocated" / "rate_2" / "rep_1"
    streamed = [k / 1024 for k in range(64)] + [63 / 1024 + 2.0]  # a 2 s last gap; TTFT 0, TPOT 32 ms
    (run_dir / "requests.jsonl").write_text("\n".join(json.dumps(r.as_dict()) for r in (
        _record(0, streamed), _record(1, [0.0, 9.0], status="UNAVAILABLE"))) + "\n")
    monkeypatch.setattr(dc, "cluster", None)  # --report-only brings nothing up
    assert bench.main([*common, "--rates", "1,2,4", "--num-requests", "4", "--report-only"]) == 0
    assert calls == []
    res = json.loads((tmp_path / "disagg_vs_colocated.json").read_text())
    points = res["workloads"]["code"]["modes"]["colocated"]["points"]
    assert [(p["rate"], len(p["runs"])) for p in points] == [(1.0, 2), (2.0, 2)]  # never run at 4: left out
    assert res["modes"]["colocated"]["report_only"] and res["model"] is None
    assert points[1]["runs"][1]["last_gap_p99_ms"] == pytest.approx(2000.0)  # from its requests.jsonl, ok only
    assert points[1]["runs"][1]["attainment_by_slo_scale"] == {"0.25": 0.5, "0.5": 0.5, "1": 0.5, "2": 0.5}
    assert "Built from recorded runs" in (tmp_path / "disagg_vs_colocated.md").read_text()
    monkeypatch.setattr(dc, "cluster", fake_cluster)
    assert bench.main([*common, "--rates", "1", "--num-requests", "3", "--resume"]) == 0
    assert calls == [("colocated", 1.0, 3)] * 2  # other settings: run again


def test_each_mode_and_workload_gets_its_own_cluster(tmp_path, monkeypatch):
    """A cluster per (mode, workload), brought up with that workload's arguments and warmed up with
    that workload; the disaggregated arguments differ per workload (measured: _disagg_cluster)."""
    import contextlib

    import _disagg_cluster as dc
    import disagg_vs_colocated as bench

    ups, warm = [], []

    @contextlib.contextmanager
    def fake_cluster(mode, workload):
        ups.append((mode, workload, dc.mode_args(mode, workload)))
        yield {"mode": mode, "router_address": "x", "ray_head_pid": None}, ""

    def fake_replay(state, workload, args, out):
        if out is None:
            warm.append((state["mode"], workload.source))
        return _fake_summary(workload.rate)

    monkeypatch.setattr(dc, "cluster", fake_cluster)
    monkeypatch.setattr(dc, "replay", fake_replay)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    assert bench.main(["--workloads", "conversation,code", "--rates", "1", "--repetitions", "1", "--num-requests", "4",
                       "--warmup-requests", "2", "--idle-baseline", "0", "--results-dir", str(tmp_path)]) == 0
    assert [u[:2] for u in ups] == [("colocated", "conversation"), ("colocated", "code"),
                                    ("disaggregated", "conversation"), ("disaggregated", "code")]
    assert ups[2][2] != ups[3][2] and "--prefill-threads" in ups[3][2]
    assert warm == [("colocated", "azure-conv"), ("colocated", "azure-code"),
                    ("disaggregated", "azure-conv"), ("disaggregated", "azure-code")]
    res = json.loads((tmp_path / "disagg_vs_colocated.json").read_text())
    assert res["modes"]["disaggregated"]["up_args"] == {"conversation": ups[2][2], "code": ups[3][2]}
    md = (tmp_path / "disagg_vs_colocated.md").read_text()
    assert f"### disaggregated (`{' '.join(ups[3][2])}`)" in md

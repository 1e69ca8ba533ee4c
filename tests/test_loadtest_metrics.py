"""Load-test metrics on small hand-computed traces (no cluster)."""

from __future__ import annotations

import json

import pytest

from loadtest.metrics import (
    SLO,
    InvariantError,
    latency_stats_ms,
    max_rate_meeting,
    parse_duration_s,
    parse_slo,
    pooled_itls_s,
    summarize,
)
from loadtest.records import RequestRecord
from loadtest.report import summary_table, write_markdown, write_summary


def rec(index, arrival, times, status="OK", expected=None):
    return RequestRecord(index, f"r{index}", arrival, arrival, 10, expected if expected is not None else len(times),
                         list(times), (times[-1] if times else arrival + 0.1), status)


@pytest.fixture
def records():
    return [
        rec(0, 0.0, [0.5, 0.7, 1.0]),  # TTFT 0.5, E2E 1.0, TPOT 0.25, ITL 0.2 0.3
        rec(1, 1.0, [1.8]),  # one token: TTFT = E2E = 0.8, no TPOT, no ITL
        rec(2, 2.0, [2.1, 2.1, 2.6]),  # a 2-token chunk: ITL 0.0 0.5, TPOT 0.25
        rec(3, 3.0, [], status="UNAVAILABLE", expected=5),
    ]


def test_per_request_definitions(records):
    a, b, c, d = records
    assert a.ttft_s == pytest.approx(0.5) and a.e2e_s == pytest.approx(1.0) and a.tpot_s == pytest.approx(0.25)
    assert a.itls_s == pytest.approx([0.2, 0.3])
    assert b.ttft_s == pytest.approx(0.8) and b.e2e_s == pytest.approx(0.8)
    assert b.tpot_s is None and b.itls_s == []
    assert c.itls_s == pytest.approx([0.0, 0.5]) and c.tpot_s == pytest.approx(0.25)
    assert d.ttft_s is None and d.e2e_s is None and d.tpot_s is None and not d.ok


def test_itl_pooling_over_completed_requests(records):
    assert sorted(pooled_itls_s(records)) == pytest.approx([0.0, 0.2, 0.3, 0.5])
    s = summarize(records, sent=4, duration_s=4.0)
    assert s["itl_ms"]["mean"] == pytest.approx(250.0)
    assert s["itl_ms"]["p50"] == pytest.approx(250.0)  # linear interpolation of 200 and 300
    assert s["itl_ms"]["p99"] == pytest.approx(300 + 0.97 * 200)


def test_summary_aggregates(records):
    s = summarize(records, sent=4, duration_s=4.0)
    assert (s["sent"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"UNAVAILABLE": 1}
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(7 / 4.0)
    assert s["ttft_ms"]["mean"] == pytest.approx((500 + 800 + 100) / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(500)
    assert s["tpot_ms"]["mean"] == pytest.approx(250)  # the one-token request has no TPOT
    assert s["e2e_ms"]["p50"] == pytest.approx(800)
    assert s["output_token_mismatches"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"mean", "p50", "p90", "p95", "p99"}
    assert "goodput" not in s and "slo_attainment" not in s
    json.dumps(s)  # JSON-ready


def test_goodput_with_mixed_slo_misses(records):
    # ttft <= 600 ms and tpot <= 300 ms: r0 meets, r1 misses TTFT (800), r2 meets, r3 failed
    s = summarize(records, sent=4, duration_s=4.0, slo=parse_slo("ttft=600ms,tpot=300ms"))
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo"] == {"ttft_ms": 600.0, "tpot_ms": 300.0}
    # tpot <= 200 ms: r0 and r2 miss (250 ms); the one-token r1 has no TPOT and meets it (as in vLLM)
    s = summarize(records, sent=4, duration_s=4.0, slo=SLO(tpot_s=0.2))
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["goodput"] == pytest.approx(0.25)
    # e2e <= 0.9 s: r1 (0.8) and r2 (0.6) meet, r0 (1.0) misses
    assert summarize(records, 4, 4.0, parse_slo("e2e=0.9s"))["slo_attainment"] == pytest.approx(0.5)


def test_tpot_with_one_output_token_only():
    s = summarize([rec(0, 0.0, [0.3]), rec(1, 0.0, [0.4])], sent=2, duration_s=1.0)
    assert s["tpot_ms"] == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    assert s["itl_ms"]["mean"] is None
    assert s["ttft_ms"]["mean"] == pytest.approx(350)


def test_invariant_completed_plus_failed_equals_sent(records):
    with pytest.raises(InvariantError, match="1 request"):
        summarize(records, sent=5, duration_s=4.0)


def test_output_token_mismatch_counted():
    s = summarize([rec(0, 0.0, [0.1, 0.2], expected=3)], sent=1, duration_s=1.0)
    assert s["output_token_mismatches"] == 1


def test_latency_stats_percentiles():
    st = latency_stats_ms([1.0, 2.0, 3.0, 4.0])
    assert st == pytest.approx({"mean": 2500, "p50": 2500, "p90": 3700, "p95": 3850, "p99": 3970})


def test_records_round_trip_their_jsonl_form(records):
    back = [RequestRecord.from_dict(json.loads(json.dumps(r.as_dict()))) for r in records]
    assert back == records and [b.as_dict() for b in back] == [r.as_dict() for r in records]


def test_slo_scaled_multiplies_every_given_objective(records):
    slo = SLO(ttft_s=2.0, tpot_s=0.2)
    assert slo.scaled(0.25) == SLO(ttft_s=0.5, tpot_s=0.05) and slo.scaled(1) == slo
    assert [slo.scaled(2.4).met_by(r) for r in records] == [True, True, True, False]
    # at 0.25: TPOT over 50 ms (a, c), TTFT over 0.5 s (b), failed (d)
    assert [slo.scaled(0.25).met_by(r) for r in records] == [False, False, False, False]
    with pytest.raises(ValueError):
        slo.scaled(0)


def test_parse_slo_and_durations():
    assert parse_duration_s("2s") == 2.0 and parse_duration_s("200ms") == pytest.approx(0.2)
    assert parse_slo("ttft=2s,tpot=200ms") == SLO(ttft_s=2.0, tpot_s=0.2)
    assert parse_slo("e2e=1.5s") == SLO(e2e_s=1.5)
    for bad in ("ttft=2", "itl=2s", "ttft=2s,ttft=1s", "ttft", "ttft=-1s"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_max_rate_meeting_distserve_goodput():
    assert max_rate_meeting([1, 2, 4], [0.99, 0.95, 0.5]) == 2
    assert max_rate_meeting([4, 1, 2], [0.5, 0.99, 0.95]) == 2  # order-independent
    assert max_rate_meeting([1, 2, 4], [0.99, 0.8, 0.95]) == 1  # stops at the first miss
    assert max_rate_meeting([1, 2], [0.5, 0.4]) is None
    assert max_rate_meeting([1, 2], [0.85, 0.85], target=0.8) == 2
    with pytest.raises(ValueError):
        max_rate_meeting([1], [0.9, 0.8])


def test_reports_render(records, tmp_path):
    from rich.console import Console

    s = summarize(records, sent=4, duration_s=4.0, slo=parse_slo("ttft=600ms"))
    write_summary(tmp_path / "summary.json", s)
    assert json.loads((tmp_path / "summary.json").read_text())["slo_attainment"] == pytest.approx(0.5)
    write_markdown(tmp_path / "report.md", s, config={"workload.source": "azure-conv"})
    md = (tmp_path / "report.md").read_text()
    assert "| TTFT |" in md and "goodput" in md and "UNAVAILABLE: 1" in md
    console = Console(record=True, width=120)
    console.print(summary_table(s))
    out = console.export_text()
    assert "SLO attainment" in out and "50.0 %" in out and "TPOT" in out

"""``bench/stream_fanout.py``'s summary: per-round ratios against the no-stream floor, medians over rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import stream_fanout  # noqa: E402


def _round(none: float, sync_q: float, sync_sq: float, aio: float) -> list[dict]:
    times = dict(zip(stream_fanout.VARIANTS, (none, sync_q, sync_sq, aio)))
    return [{"variant": v, "step_ms_median": t, "load_avg_1m_before": 1.0} for v, t in times.items()]


def test_ratios_pair_each_variant_with_the_floor_of_its_own_round():
    rounds = [_round(100.0, 125.0, 110.0, 120.0), _round(80.0, 100.0, 80.0, 100.0), _round(90.0, 100.0, 95.0, 90.0)]
    s = stream_fanout.summarize(rounds)
    assert s["none"]["rate_vs_none"] == 1.0
    assert s["sync_queue"]["rate_vs_none_per_round"] == pytest.approx([0.8, 0.8, 0.9])
    assert s["sync_queue"]["rate_vs_none"] == pytest.approx(0.8)
    assert s["aio"]["rate_vs_none"] == pytest.approx(100 / 120)  # median of 0.833, 0.8, 1.0 paired per round
    assert s["sync_simplequeue"]["step_ms_median"] == 95.0


def test_markdown_lists_every_variant():
    rounds = [_round(100.0, 125.0, 110.0, 120.0)]
    res = {"cpu": "c", "streams": 32, "steps": 10, "linears_per_step": 240, "rounds": rounds,
           "summary": stream_fanout.summarize(rounds)}
    text = stream_fanout.markdown(res)
    for v in stream_fanout.VARIANTS:
        assert f"| `{v}` |" in text
    assert "0.800" in text

"""``bench/cluster_overhead.py``'s steady-state rate: tokens/s while every stream is decoding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import cluster_overhead  # noqa: E402


def test_steady_rate_counts_the_window_where_every_stream_decodes():
    # stream a starts at 0 and ends at 10; stream b (after its prefill) from 4 to 12: window (4, 10]
    a = [float(t) for t in range(0, 11)]
    b = [float(t) for t in range(4, 13)]
    r = cluster_overhead.steady_rate([a, b])
    assert r["steady_window_s"] == 6.0
    assert r["tokens_per_s_steady"] == pytest.approx((6 + 6) / 6.0)  # a: 5..10, b: 5..10


def test_steady_rate_without_a_common_window():
    r = cluster_overhead.steady_rate([[0.0, 1.0], [2.0, 3.0]])
    assert r == {"tokens_per_s_steady": None, "steady_window_s": 0.0}

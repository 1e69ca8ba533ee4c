"""``bench/overload.py``'s parts on a small burst: the slim client against the floor peer (a
real gRPC server on loopback), the per-burst figures and the report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import overload  # noqa: E402


def test_a_burst_against_the_floor_peer_is_measured_and_reported():
    peer = subprocess.Popen([sys.executable, str(ROOT / "bench" / "_burst_peer.py"), "4"], stdout=subprocess.PIPE,
                            text=True)
    try:
        address = f"127.0.0.1:{peer.stdout.readline().strip()}"
        runs = [overload.one_burst(address, 24) for _ in range(2)]
    finally:
        peer.kill()
        peer.wait()
    for r in runs:
        assert (r["accepted"], r["refused"], r["other_codes"]) == (4, 20, [])
        assert 0 < r["refusal_ms_p50"] <= r["refusal_ms_p99"] <= r["refusal_ms_max"] < r["accepted_ms_p50"]
    res = {"cpu": "test", "requests": 24, "capacity": 4, "reps": 2, "router": {"runs": runs, "summary": overload.summary(runs)},
           "peer": {"runs": runs, "summary": overload.summary(runs)}, "ratio_max_to_peer": 1.0}
    text = overload.markdown(res)
    assert "| router | 2 |" in text and "| peer | 2 |" in text and "**1.00x**" in text


def test_the_burst_must_exceed_the_capacity():
    with pytest.raises(SystemExit):
        overload.parse_args(["--requests", str(overload.CAPACITY)])

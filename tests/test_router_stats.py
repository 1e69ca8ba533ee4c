"""``router.stats.RequestStats``: the per-request phases a finished request records (vLLM's
queue / prefill / decode / inference times), on a real prometheus-client registry."""

from __future__ import annotations

import time

import pytest

from router.stats import RequestStats, RouterGauges
from serving.metrics import PREFIX, ProcessMetrics

LABELS = {"role": "router", "worker_id": "router", "model_name": "m"}


def _sample(m: ProcessMetrics, name: str) -> float:
    return m.registry.get_sample_value(PREFIX + name, LABELS) or 0.0


def test_a_finished_requests_phases_add_up_to_its_inference_time():
    m = ProcessMetrics("router", "router", "m")
    stats = RequestStats(m, RouterGauges(m), num_prompt_tokens=5, max_tokens=7)
    time.sleep(0.01)
    stats.reserved()
    time.sleep(0.02)
    stats.tokens(1)
    time.sleep(0.02)
    stats.tokens(2)
    stats.finished("length")
    queue, prefill, decode, inference = (_sample(m, f"request_{p}_time_seconds_sum")
                                         for p in ("queue", "prefill", "decode", "inference"))
    assert queue >= 0.01 and prefill >= 0.02 and decode >= 0.02
    assert prefill + decode == pytest.approx(inference, abs=1e-9)
    assert inference + queue <= _sample(m, "e2e_request_latency_seconds_sum")
    assert _sample(m, "request_params_max_tokens_sum") == 7
    for phase in ("prefill", "decode", "inference"):
        assert _sample(m, f"request_{phase}_time_seconds_count") == 1


def test_a_failed_request_records_no_phases():
    m = ProcessMetrics("router", "router", "m")
    stats = RequestStats(m, RouterGauges(m), num_prompt_tokens=5, max_tokens=7)
    stats.reserved()
    stats.tokens(1)
    stats.failed("UNAVAILABLE")
    stats.finished("stop")  # after the outcome: nothing more
    assert _sample(m, "request_inference_time_seconds_count") == 0
    assert _sample(m, "request_params_max_tokens_count") == 0

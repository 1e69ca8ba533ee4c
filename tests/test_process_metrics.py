"""A process' metrics (:class:`serving.metrics.ProcessMetrics`): the child series it caches per
label set stay the registry's series, also across :meth:`ProcessMetrics.clear`."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from serving.metrics import ProcessMetrics


def _lines(metrics: ProcessMetrics, name: str) -> list[str]:
    return [line for line in generate_latest(metrics.registry).decode().splitlines()
            if line.startswith(f"pdcluster:{name}")]


def test_a_label_set_is_one_series_and_bad_labels_are_refused_every_time():
    m = ProcessMetrics("router", "router-0", "m")
    assert m.get("request_errors", code="INTERNAL") is m.get("request_errors", code="INTERNAL")
    m.inc("request_errors", code="INTERNAL")
    m.inc("request_errors", code="INTERNAL")
    assert any(line.endswith(" 2.0") and 'code="INTERNAL"' in line for line in _lines(m, "request_errors_total"))
    for _ in range(2):
        with pytest.raises(ValueError):
            m.get("request_errors", nonsense="x")
        with pytest.raises(KeyError, match="not exported"):
            m.get("no_such_metric")


def test_a_cleared_series_comes_back_when_set_again():
    m = ProcessMetrics("router", "router-0", "m")
    m.set("worker_restarts", 3, target_worker="decode-0")
    m.clear("worker_restarts")
    assert not any("decode-0" in line for line in _lines(m, "worker_restarts"))
    m.set("worker_restarts", 5, target_worker="decode-0")
    assert [line for line in _lines(m, "worker_restarts") if "decode-0" in line][0].endswith(" 5.0")

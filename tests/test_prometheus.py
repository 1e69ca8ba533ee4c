"""A real Prometheus scraping a real 1P+2D cluster through the router's service discovery:
every target up, TTFT/ITL quantiles, the TTFT count equal to the requests completed by a
short loadtest, each finished request's phases (prefill + decode = inference) and max_tokens,
the recording rules evaluating, every Grafana panel's PromQL returning data, and an OpenAI
request's n. The config and rules are the shipped ones (``deploy/prometheus``), also checked by
``promtool``."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import openai
import pytest

from deploy.prometheus_server import PROMETHEUS_DIR, PrometheusServer, find_prometheus
from pdcluster.cli import main as cli_main
from pdcluster.top import scrape

from cluster_utils import assert_no_leak, router_client, running_cluster

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "pdcluster.json"
NUM_REQUESTS = 12

pytestmark = pytest.mark.skipif(find_prometheus() is None, reason="Debian's prometheus package is not installed "
                                "(scripts/install.sh installs it when run as root where apt-get exists)")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_shipped_config_and_rules():
    assert shutil.which("promtool")
    rules = _promtool("check", "rules", str(PROMETHEUS_DIR / "pdcluster.rules.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = _promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """A 1P+2D cluster that served a short loadtest, and a Prometheus that scraped it."""
    tmp = tmp_path_factory.mktemp("prom")
    with running_cluster(tmp / "state", "--decode", "2", "--max-model-len", "512", "--num-kv-blocks", "300",
                         "--heartbeat-s", "0.5") as state:
        with router_client(state):
            pass
        prom = PrometheusServer(state["router_http_address"], tmp / "prometheus").start()
        try:
            _wait_for_targets(prom, 4)  # every series is scraped before the load: rate() sees its increase
            rc = cli_main(["loadtest", "--address", state["router_address"], "--workload", "synthetic",
                           "--num-requests", str(NUM_REQUESTS), "--rate", "4", "--input-len", "64",
                           "--output-len", "12", "--output-dir", str(tmp / "lt"), "--no-plots", "--no-progress",
                           "--duration", "120"])
            summary = json.loads((tmp / "lt" / "summary.json").read_text())
            assert rc == 0 and summary["completed"] == NUM_REQUESTS, summary
            _wait_for(prom, "sum(pdcluster:time_to_first_token_seconds_count)", NUM_REQUESTS)
            _wait_for(prom, "count(pdcluster:prefill_decode_time_ratio:rate1m)", 1)
            yield state, prom, summary
        finally:
            prom.stop()
        assert_no_leak(state)


def _wait_for_targets(prom: PrometheusServer, n: int, timeout_s: float = 60.0) -> None:
    """Wait until Prometheus has discovered and scraped ``n`` targets successfully."""
    deadline = time.monotonic() + timeout_s
    while True:
        active = prom.api("targets")["activeTargets"]
        if len(active) == n and all(t["health"] == "up" for t in active):
            return
        assert time.monotonic() < deadline, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in active]
        time.sleep(0.5)


def _value(prom: PrometheusServer, promql: str) -> float | None:
    res = prom.query(promql)
    return float(res[0]["value"][1]) if res else None


def _wait_for(prom: PrometheusServer, promql: str, want: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := _value(prom, promql)) != want:
        assert time.monotonic() < deadline, f"{promql} = {got}, want {want}"
        time.sleep(0.5)


def test_every_target_is_up(observed):
    _, prom, _ = observed
    active = prom.api("targets")["activeTargets"]
    roles = sorted(t["labels"]["role"] for t in active)
    assert roles == ["decode", "decode", "prefill", "router"], active
    assert all(t["health"] == "up" for t in active), [(t["scrapeUrl"], t["lastError"]) for t in active]


def test_latency_quantiles_and_counts(observed):
    _, prom, summary = observed
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        q = _value(prom, f"histogram_quantile(0.99, sum by (le) (rate(pdcluster:{metric}_bucket[1m])))")
        assert q is not None and q > 0, metric
    assert _value(prom, "sum(pdcluster:time_to_first_token_seconds_count)") == summary["completed"]
    _wait_for(prom, "sum(pdcluster:request_success_total)", summary["completed"], timeout_s=10)
    prompt = _value(prom, "sum(pdcluster:prompt_tokens_total)")
    assert prompt > 0
    # the prefill workers' last scrape may precede the router's: wait for it to catch up
    _wait_for(prom, "sum(pdcluster:prefix_cache_queries_total)", prompt, timeout_s=10)
    # every byte sent was received; the two sides' last scrapes may be a scrape interval apart
    _wait_for(prom, "sum(pdcluster:kv_transfer_bytes_total) - sum(pdcluster:kv_received_bytes_total)", 0, timeout_s=10)
    # each finished request's phases (vLLM's): prefill + decode = inference, and its max_tokens
    for phase in ("prefill", "decode", "inference"):
        assert _value(prom, f"sum(pdcluster:request_{phase}_time_seconds_count)") == summary["completed"], phase
    sums = [f"sum(pdcluster:request_{phase}_time_seconds_sum)" for phase in ("prefill", "decode", "inference")]
    phases = _value(prom, f"{sums[0]} + {sums[1]} - {sums[2]}")
    assert abs(phases) < 1e-6
    assert _value(prom, "sum(pdcluster:request_params_max_tokens_sum)") == 12 * summary["completed"]  # --output-len


def test_recording_rules_evaluate(observed):
    _, prom, _ = observed
    ratio = _value(prom, "pdcluster:prefill_decode_time_ratio:rate1m")
    assert ratio is not None and ratio > 0
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 8 and all(r["health"] == "ok" for r in rules), rules


def test_every_dashboard_panel_returns_data(observed):
    _, prom, _ = observed
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len(panels) >= 12
    empty = []
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            if not prom.query(expr):
                empty.append(f"{panel['title']}: {expr}")
    assert not empty, empty


def test_an_openai_requests_n_is_recorded(observed):
    """Last in the file: it adds a request to those the tests above count."""
    state, _, _ = observed
    client = openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused")
    before = scrape(state["router_http_address"], {})
    client.completions.create(model=client.models.list().data[0].id, prompt="Count to three.", n=3, max_tokens=2)
    after = scrape(state["router_http_address"], {})
    assert [after.total(k) - before.total(k) for k in ("request_params_n_count", "request_params_n_sum")] == [1, 3]

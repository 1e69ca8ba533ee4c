"""Several routers behind one address (``pdcluster up --routers 2``) on a real local 1P+1D
cluster (real Ray, Redis, processes, ``kill -9``):

- both routers bind the one gRPC and the one HTTP port (SO_REUSEPORT): many clients, each on
  its own connection, are spread over both (each router's private ``/metrics`` counts its
  requests), and every answer is token-exact;
- Prometheus service discovery lists each router's own ``/metrics``; ``status`` shows 2/2 routers;
- one router killed with ``kill -9`` mid-traffic: new connections to the same address succeed
  at once (the other router takes them), Ray restarts the killed one in place (new pid, same
  ports) and it serves again; no KV block leaks;
- a router actor killed for good (no Ray restart) is created again by the cluster controller;
- a paused router (SIGSTOP: its record expires, its actor does not answer) is killed and
  restarted by the cluster controller after ``--hung-after-s`` (8 s here), on the same
  address, with the reason in ``status`` meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy import status as cluster_status
from pdcluster import cli
from pdcluster import client as client_module
from pdcluster.client import PdclusterClient
from serving.registry import WorkerRegistry

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy, running_cluster

PROMPT = [1, 504, 3458, 314, 260, 1345, 28, 216]
TOKENS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("state")
    with running_cluster(state_dir, "--routers", "2", "--max-model-len", "256", "--num-kv-blocks", "100",
                         "--heartbeat-s", "0.5", "--hung-after-s", "8") as state:
        yield {**state, "state_dir": str(state_dir)}


@pytest.fixture(scope="module")
def reference(hf_model):
    return hf_greedy(hf_model, PROMPT, TOKENS)


@pytest.fixture(autouse=True)
def own_connections(monkeypatch):
    """Every client opens its own TCP connection (gRPC shares one between channels to one
    address by default): connections, not requests, are what the kernel spreads over routers."""
    monkeypatch.setattr(client_module, "_CHANNEL_OPTIONS",
                        (*client_module._CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)))


def _routers(cluster: dict) -> dict:
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    try:
        return {r.index: r for r in reg.live_routers()}
    finally:
        reg.close()


def _served(metrics_address: str) -> float:
    """Requests a router finished, from its own ``/metrics``."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdcluster:e2e_request_latency_seconds_count")


def _served_by(cluster: dict) -> dict[int, float]:
    return {i: _served(r.metrics_address) for i, r in _routers(cluster).items()}


def _generate(cluster: dict) -> list[int]:
    """One greedy request on a new connection."""
    with PdclusterClient(cluster["router_address"], timeout_s=60) as client:
        return list(client.generate(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True).token_ids)


def _http_completion(cluster: dict) -> list[int]:
    """One greedy OpenAI completion on a new HTTP connection; returns its token count."""
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": PROMPT, "max_tokens": TOKENS,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{cluster['router_http_address']}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def _wait(cond, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(poll_s)
    return value


def test_status_and_discovery_show_both_routers(cluster, capsys):
    _wait(lambda: len(_routers(cluster)) == 2, 10, "both routers' records")
    assert [r["index"] for r in cluster["routers"]] == [0, 1]
    assert cli.main(["status", "--state-dir", cluster["state_dir"]]) == 0
    assert "2/2 routers" in capsys.readouterr().out
    with urllib.request.urlopen(f"http://{cluster['router_http_address']}/v1/prometheus/targets", timeout=10) as r:
        groups = json.loads(r.read())
    routers = {g["labels"]["worker_id"]: g["targets"][0] for g in groups if g["labels"]["role"] == "router"}
    assert routers == {r.router_id: r.metrics_address for r in _routers(cluster).values()}, groups


def test_connections_are_spread_over_both_routers(cluster, reference):
    ref, gaps = reference
    before = _served_by(cluster)
    outputs = [None] * 16
    threads = [threading.Thread(target=lambda i=i: outputs.__setitem__(i, _generate(cluster))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, out in enumerate(outputs):
        assert_greedy_matches(out, ref, gaps, f"client {i}")
    assert all(_http_completion(cluster) == TOKENS for _ in range(8))
    after = _served_by(cluster)
    served = {i: after[i] - before[i] for i in after}
    assert sum(served.values()) == 24 and all(n > 0 for n in served.values()), served
    assert_no_leak(cluster)


class Traffic:
    """Greedy requests one after another, each on a new connection; records (start, outcome)."""

    def __init__(self, cluster: dict) -> None:
        self.cluster = cluster
        self.outcomes: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.outcomes.append((t, len(_generate(self.cluster))))
            except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                self.outcomes.append((t, repr(e)))

    def __enter__(self) -> "Traffic":
        self._thread.start()
        _wait(lambda: self.outcomes, 60, "first request of the background traffic")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(90)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_killed_router_the_other_serves_and_it_comes_back(cluster, reference):
    ref, gaps = reference
    victim = _routers(cluster)[1]
    with Traffic(cluster) as traffic:
        time.sleep(1.0)
        os.kill(victim.pid, 9)
        _wait(lambda: _gone(victim.pid), 10, "the killed router's process gone", 0.01)
        t_gone = time.monotonic()
        for i in range(6):  # new connections right away: the other router takes them
            assert_greedy_matches(_generate(cluster), ref, gaps, f"new connection {i} after the kill")
        back = _wait(lambda: (r := _routers(cluster).get(1)) and r.pid != victim.pid and r, 60,
                     "router-1 restarted by Ray", 0.5)
        time.sleep(1.0)
    after_kill = [out for t, out in traffic.outcomes if t >= t_gone]
    assert after_kill and all(out == TOKENS for out in after_kill), after_kill
    assert back.address == victim.address and back.metrics_address != victim.metrics_address
    served = _served(back.metrics_address)
    _wait(lambda: _generate(cluster) and _served(back.metrics_address) > served, 60, "the restarted router serving")
    st = cluster_status.collect(cluster)
    assert sorted(r["index"] for r in st["routers"]["live"]) == [0, 1] and st["routers"]["desired"] == 2
    assert_no_leak(cluster)


def test_router_actor_gone_for_good_is_recreated_by_the_controller(cluster):
    import ray

    from deploy.cluster import NAMESPACE, router_actor_name

    old = _wait(lambda: _routers(cluster).get(1), 30, "router-1 live")
    ray.init(address=cluster["ray_address"], namespace=NAMESPACE, logging_level="WARNING")
    try:
        ray.kill(ray.get_actor(router_actor_name(cluster["cluster"], 1), namespace=NAMESPACE), no_restart=True)
    finally:
        ray.shutdown()
    new = _wait(lambda: (r := _routers(cluster).get(1)) and r.pid != old.pid and r, 60,
                "router-1 recreated by the controller", 0.5)
    assert new.address == old.address
    with PdclusterClient(cluster["router_address"], timeout_s=60) as client:
        assert len(client.generate(PROMPT, max_tokens=2, temperature=0, ignore_eos=True).token_ids) == 2
    assert_no_leak(cluster)


def test_paused_router_is_restarted_by_the_controller(cluster):
    old = _wait(lambda: _routers(cluster).get(1), 30, "router-1 live")
    os.kill(old.pid, signal.SIGSTOP)
    try:
        _wait(lambda: any(m["worker_id"] == "router-1" and "not answering" in m["reason"]
                          for m in cluster_status.collect(cluster)["missing"]), 30,
              "status naming the silent router-1 with the controller's reason", 0.5)
        new = _wait(lambda: (r := _routers(cluster).get(1)) and r.pid != old.pid and r, 60,
                    "router-1 restarted by the controller", 0.5)
    finally:
        if not _gone(old.pid):
            os.kill(old.pid, signal.SIGCONT)
    assert new.address == old.address and _gone(old.pid)
    with PdclusterClient(cluster["router_address"], timeout_s=60) as client:
        assert len(client.generate(PROMPT, max_tokens=2, temperature=0, ignore_eos=True).token_ids) == 2
    assert_no_leak(cluster)

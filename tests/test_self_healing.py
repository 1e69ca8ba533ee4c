"""Self-healing on a real local 1P+1D cluster (real Ray, Redis, processes, ``kill -9``):

- the only decode worker killed mid-stream: ``pdcluster status`` shows the gap, a replacement
  (next generation, same id) comes up and the stream, migrated onto it, finishes token-exact;
- a worker paused with SIGSTOP (alive, no heartbeats) is restarted by the controller, after
  ``--hung-after-s`` (8 s here, default 20);
- the router killed mid-traffic: new connections succeed on the same address within 30 s;
- Redis killed mid-traffic: no request fails, Redis is back within 10 s (not as a child of the
  controller actor, which Ray would take it down with), workers re-registered;
- ``pdcluster scale`` adds a decode worker on this 2-core machine without a restart and
  removes it again, reporting live against desired counts.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from deploy import status as cluster_status
from deploy.redis_control import is_answering
from deploy.state import with_secrets, without_secrets
from pdcluster import cli
from serving.registry import CONTROLLER_REPORT_KEY, WorkerRegistry

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy, router_client, running_cluster

HEARTBEAT_S = 0.5
HUNG_AFTER_S = 8.0
PROMPT = [1, 504, 3458, 314, 260, 1345, 28, 216]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("state")
    with running_cluster(state_dir, "--prefill", "1", "--decode", "1", "--max-model-len", "512",
                         "--num-kv-blocks", "200", "--heartbeat-s", str(HEARTBEAT_S),
                         "--hung-after-s", str(HUNG_AFTER_S)) as state:
        yield {**state, "state_dir": str(state_dir)}


def _report(cluster: dict) -> dict:
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    try:
        return reg.get_state(CONTROLLER_REPORT_KEY) or {"workers": []}
    finally:
        reg.close()


def _live(cluster: dict) -> dict:
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    try:
        return {info.worker_id: info for info, _ in reg.live_workers()}
    finally:
        reg.close()


def _wait(cond, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(poll_s)


class Traffic:
    """Greedy requests sent one after another on a thread; records each outcome."""

    def __init__(self, cluster: dict) -> None:
        self.cluster = cluster
        self.outcomes: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with router_client(self.cluster, timeout_s=60) as client:
            while not self._stop.is_set():
                try:
                    res = client.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
                    self.outcomes.append((time.monotonic(), res.usage.completion_tokens))
                except grpc.RpcError as e:
                    self.outcomes.append((time.monotonic(), (e.code(), e.details())))
                    time.sleep(0.2)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        _wait(lambda: self.outcomes, 60, "first request of the background traffic")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def test_killed_decode_worker_is_replaced(cluster, hf_model):
    """The only decode worker dies mid-stream: the stream waits for its replacement and
    finishes token-exact (migration), ``status`` shows the gap, the replacement serves."""
    ref, gaps = hf_greedy(hf_model, PROMPT, 96)
    before = _live(cluster)["decode-0"]
    with router_client(cluster, timeout_s=120) as client:
        it = iter(client.stream(PROMPT, max_tokens=96, temperature=0, ignore_eos=True))
        streamed = list(next(it).token_ids)
        t_kill = time.monotonic()
        os.kill(before.pid, signal.SIGKILL)
        gap = _wait(lambda: cluster_status.collect(cluster)["missing"], 10, "status showing the dead worker", 0.05)
        assert gap[0]["worker_id"] == "decode-0"
        for msg in it:
            streamed.extend(msg.token_ids)
    assert time.monotonic() - t_kill < 60
    assert_greedy_matches(streamed, ref, gaps, "stream across the decode worker's death")
    after = _live(cluster)["decode-0"]
    assert after.pid != before.pid and after.generation > before.generation
    with router_client(cluster, timeout_s=60) as client:
        res = client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert_greedy_matches(list(res.token_ids), ref[:12], gaps, "after the replacement")
    st = cluster_status.collect(cluster)
    assert not st["missing"] and st["live"] == st["desired"] == {"prefill": 1, "decode": 1, "colocated": 0}
    _wait(lambda: [w for w in _report(cluster)["workers"] if w["worker_id"] == "decode-0"
                   and w["restarts"] >= after.generation - before.generation], 10,
          "the controller's report counting Ray's restart (worker_restarts)", 0.2)
    assert_no_leak(cluster)


def test_paused_worker_is_restarted_by_the_controller(cluster):
    before = _live(cluster)["prefill-0"]
    os.kill(before.pid, signal.SIGSTOP)
    t_pause = time.monotonic()
    try:
        missing = _wait(lambda: [m for m in cluster_status.collect(cluster)["missing"] if "not answering" in m["reason"]],
                        10, "the paused worker reported missing, not answering")
        assert missing[0]["worker_id"] == "prefill-0", missing
        after = _wait(lambda: (w := _live(cluster).get("prefill-0")) and w.pid != before.pid and w, 90,
                      "the controller restarting the paused worker", 0.5)
        assert time.monotonic() - t_pause >= HUNG_AFTER_S  # silent that long before it was acted on
    finally:
        try:
            os.kill(before.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed by the controller, as it should be
    assert after.generation > before.generation
    with router_client(cluster, timeout_s=60) as client:
        assert client.generate(PROMPT, max_tokens=3, temperature=0, ignore_eos=True).usage.completion_tokens == 3
    assert_no_leak(cluster)


def test_killed_router_comes_back_on_the_same_address(cluster):
    with Traffic(cluster) as traffic:
        time.sleep(1.0)
        t_kill = time.monotonic()
        os.kill(cluster["router_pid"], signal.SIGKILL)
        _wait(lambda: any(t > t_kill + 0.5 and out == 4 for t, out in traffic.outcomes), 30,
              "a request served by the restarted router")
    failures = [out for _, out in traffic.outcomes if out != 4]
    assert all(code == grpc.StatusCode.UNAVAILABLE for code, _ in failures), failures
    assert_no_leak(cluster)


def test_killed_redis_is_restarted_and_nothing_fails(cluster):
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    pid = reg.server_pid()
    reg.close()
    with Traffic(cluster) as traffic:
        time.sleep(1.0)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        _wait(lambda: is_answering(cluster["redis_url"]), 10, "Redis restarted by the controller")
        back = time.monotonic()
        _wait(lambda: set(_live(cluster)) == {"prefill-0", "decode-0"}, 2 * HEARTBEAT_S + 2.0,
              "workers re-registered")
        time.sleep(1.0)
    assert back - t_kill < 10.0
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    new = reg.server_pid()
    reg.close()
    parent = Path(f"/proc/{new}/stat").read_text().rsplit(")", 1)[1].split()[1]
    # not a child of the controller actor (titled ray::...): Ray kills an exiting worker's children
    assert "ray::" not in Path(f"/proc/{parent}/cmdline").read_text(errors="replace")
    outcomes = [out for t, out in traffic.outcomes if t > t_kill]
    assert outcomes and all(out == 4 for _, out in traffic.outcomes), [o for _, o in traffic.outcomes if o != 4]
    assert_no_leak(cluster)


def _controller_pids() -> list[int]:
    return [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline")
            if _read(p).startswith("ray::ControllerActor")]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:  # exited meanwhile
        return ""


def test_desired_state_in_redis_holds_no_secret_and_a_restarted_controller_keeps_them(cluster):
    """Anyone with the Redis password could read the cluster secret (and the Ray token, the CA key)
    in the controller's copy of the desired state. A controller restarted by Ray reads that copy
    and takes the secrets from its arguments: the scale test after this one adds a worker with them."""
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    try:
        stored = reg.get_state("desired")
        assert stored and cluster["cluster_secret"] not in str(stored) and stored["worker_template"]["security"] == {}
        assert cluster.get("ray_auth_token") is None or cluster["ray_auth_token"] not in str(stored)
        [pid] = _controller_pids()
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: [p for p in _controller_pids() if p != pid], 60, "the controller restarted by Ray")
        since = time.time()
        _wait(lambda: _report(cluster).get("updated_at", 0) > since, 30, "a report of the restarted controller")
        assert cluster["cluster_secret"] not in str(reg.get_state("desired"))
    finally:
        reg.close()
    assert with_secrets(without_secrets(cluster), cluster) == cluster


def test_scale_up_and_down_on_a_small_machine(cluster, capsys):
    assert cli.main(["scale", "--decode", "2", "--state-dir", cluster["state_dir"]]) == 0
    assert "2/2 decode live" in capsys.readouterr().out
    assert set(_live(cluster)) == {"prefill-0", "decode-0", "decode-1"}
    with router_client(cluster, timeout_s=60) as client:
        assert all(client.generate(f"Say {i}.", max_tokens=2, temperature=0).usage.completion_tokens == 2
                   for i in range(4))
    assert cli.main(["scale", "--decode", "1", "--state-dir", cluster["state_dir"]]) == 0
    assert "1/1 decode live" in capsys.readouterr().out
    assert cli.main(["status", "--state-dir", cluster["state_dir"]]) == 0
    out = capsys.readouterr().out
    assert "live/desired: 1/1 prefill, 1/1 decode" in out and "controller: last report" in out
    logs = Path(cluster["ray_session_dir"]) / "logs"
    assert f"logs: {logs} on each node" in out.replace("\n", "")
    pids = [w["pid"] for w in cluster_status.collect(cluster)["workers"]]
    assert all(list(logs.glob(f"worker-*-{pid}.err")) for pid in pids), pids  # each worker's lines, by its pid
    assert_no_leak(cluster)

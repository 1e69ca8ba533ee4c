"""A node leaves a running cluster. Two hosts on one machine (network namespaces joined by a veth
pair, a Ray node in each, started with the on-premises YAML's own commands: see
``test_two_host.py``); ``pdcluster up --ray-address --placement spread`` puts the prefill worker of
1P+1D on one host and the decode worker on the other. Every process of the decode host is then
killed (``kill -9``: raylet, object store, the worker): Ray declares the node dead, moves the lost
placement-group bundle to the remaining host and restarts the worker's actor there; it comes back
under the same id and the next generation, on the remaining host, and requests are served
token-exact again, with ``pdcluster status`` showing every desired worker live.

Needs root (network namespaces); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from cluster_utils import assert_greedy_matches, hf_greedy
from test_two_host import HOST_A, HOST_B, REPO, TwoHosts, _env, _pdcluster, _run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces and a veth pair")

MAX_NEW = 8
REPLACED_WITHIN_S = 150  # Ray's node death detection (health checks, ~30 s) + rescheduling + model load

# Runs inside namespace A: one greedy request through the router; the live workers' hosts and generations.
CLIENT = r"""
import json, sys
from pdcluster.client import PdclusterClient
from serving.registry import WorkerRegistry
state, prompt, max_new = json.load(open(sys.argv[1])), json.loads(sys.argv[2]), int(sys.argv[3])
reg = WorkerRegistry(state["redis_url"], state["cluster"])
live = {i.worker_id: [i.address.rsplit(":", 1)[0], i.generation] for i, _ in reg.live_workers()}
out = {"live": live}
if max_new:
    with PdclusterClient(state["router_address"], timeout_s=120) as c:
        c.wait_ready(60)
        out["token_ids"] = list(c.generate(prompt, max_tokens=max_new, temperature=0, ignore_eos=True).token_ids)
print("RESULT " + json.dumps(out))
"""


def _client(hosts: TwoHosts, state_file, prompt: list[int], max_new: int) -> dict:
    res = _run(hosts.exec("a", sys.executable, "-c", CLIENT, str(state_file), json.dumps(prompt), str(max_new)),
               timeout_s=300, cwd=REPO, env=_env())
    return json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _kill_host(hosts: TwoHosts, host: str) -> int:
    """``kill -9`` every process in ``host``'s namespace (the node is gone); returns how many."""
    pids = [int(p) for p in _run(["ip", "netns", "pids", hosts.ns[host]]).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def test_the_workers_of_a_node_that_leaves_are_replaced_on_the_remaining_one(tmp_path, hf_model, tokenizer):
    prompt = tokenizer.encode("List three uses of copper.")
    ref, gaps = hf_greedy(hf_model, prompt, MAX_NEW)
    hosts = TwoHosts(tmp_path)
    state_dir = tmp_path / "state"
    state_file = state_dir / "cluster.json"
    try:
        hosts.create()
        hosts.start_ray()
        up = _pdcluster(hosts, "up", "--ray-address", hosts.ray_address, "--prefill", "1", "--decode", "1",
                        "--placement", "spread", "--worker-cpus", "1", "--port", "0", "--http-port", "0",
                        "--num-kv-blocks", "100", "--max-model-len", "256", "--heartbeat-s", "0.5",
                        "--placement-timeout-s", "120", "--state-dir", str(state_dir), timeout_s=420)
        assert up.returncode == 0, f"pdcluster up failed:\n{up.stdout[-3000:]}\n{up.stderr[-5000:]}"
        state = json.loads(state_file.read_text())
        landed = {w["node_ip"] for w in state["workers"]}
        assert landed == {HOST_A, HOST_B}, state["workers"]
        lost = next(w["worker_id"] for w in state["workers"] if w["node_ip"] == HOST_B)
        before = _client(hosts, state_file, prompt, MAX_NEW)
        assert_greedy_matches(before["token_ids"], ref, gaps, "before the node left")

        assert _kill_host(hosts, "b") > 0
        t0 = time.monotonic()
        while True:
            live = _client(hosts, state_file, prompt, 0)["live"]
            if lost in live and live[lost][1] > before["live"][lost][1]:
                break
            if time.monotonic() - t0 >= REPLACED_WITHIN_S:  # why, from the controller's report, for the log
                why = _pdcluster(hosts, "status", "--json", "--state-dir", str(state_dir), timeout_s=60)
                pytest.fail(f"{lost} not back within {REPLACED_WITHIN_S}s: {live}\nstatus: {why.stdout[-3000:]}")
            time.sleep(2)
        assert live[lost][0] == HOST_A, live  # re-placed on the remaining node
        after = _client(hosts, state_file, prompt, MAX_NEW)
        assert_greedy_matches(after["token_ids"], ref, gaps, f"after the node left ({time.monotonic() - t0:.0f}s)")
        status = _pdcluster(hosts, "status", "--state-dir", str(state_dir), timeout_s=60)
        assert status.returncode == 0, f"status says a desired worker is missing:\n{status.stdout}\n{status.stderr}"
    finally:
        if state_file.exists():
            _pdcluster(hosts, "down", "--state-dir", str(state_dir), timeout_s=120)
        hosts.destroy()

"""Two hosts on one machine: two network namespaces joined by a veth pair, a Ray head in
one and a Ray worker node in the other, started with the on-premises YAML's own
``ray start`` commands; ``pdcluster up --ray-address`` pins prefill to host A and
decode to host B. Outputs are token-exact against HF, and the KV crossed the link
(the decode worker received it over the veth: its byte counters grew by at least the
prompts' KV size, and a direct Prefill reports the bytes it sent).

Needs root (network namespaces); skipped otherwise. Everything it starts runs inside
its own namespaces and is killed, and the namespaces deleted, even when it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from cluster_utils import assert_greedy_matches, hf_greedy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces and a veth pair")

REPO = Path(__file__).resolve().parents[1]
ONPREM_YAML = REPO / "deploy" / "clusters" / "onprem.yaml"
HOST_A, HOST_B = "10.200.0.1", "10.200.0.2"
RAY_PORT = 6379  # the YAML's port; free inside our own namespace
MAX_NEW = 12

# Runs inside namespace A (where the router is): greedy requests through the router, then
# one Reserve + Prefill straight to the workers, whose PrefillResponse says what was sent.
CLIENT = r"""
import json, sys, uuid
from pdcluster.client import PdclusterClient
from serving.registry import WorkerRegistry
from serving.security import SecurityConfig, internal_channel
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc

state, prompts, max_new = json.load(open(sys.argv[1])), json.loads(sys.argv[2]), int(sys.argv[3])
security = SecurityConfig(cluster_secret=state["cluster_secret"])
out = {"router": []}
with PdclusterClient(state["router_address"], timeout_s=300) as c:
    c.wait_ready(60)
    for ids in prompts:
        r = c.generate(ids, max_tokens=max_new, temperature=0)
        out["router"].append({"token_ids": list(r.token_ids), "prompt_tokens": r.usage.prompt_tokens})
live = {i.role: i for i, _ in WorkerRegistry(state["redis_url"], state["cluster"]).live_workers()}
req = worker_pb2.WorkerRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompts[-1], sampling=common_pb2.SamplingParams(
    max_tokens=max_new, temperature=0.0, top_p=1.0))
tid = uuid.uuid4().hex
events = worker_pb2_grpc.DecodeWorkerStub(internal_channel(security, live["decode"].address)).Reserve(
    worker_pb2.ReserveRequest(request=req, transfer_id=tid), timeout=300)
first = next(events)
resp = worker_pb2_grpc.PrefillWorkerStub(internal_channel(security, live["prefill"].address)).Prefill(
    worker_pb2.PrefillRequest(request=req, transfer_id=tid, destination=first.reservation), timeout=300)
tokens = [t for ev in events for t in ev.tokens.token_ids]
out["direct"] = {"kv_bytes_sent": resp.kv_bytes_sent, "token_ids": tokens,
                 "addresses": {r: i.address for r, i in live.items()}}
print("RESULT " + json.dumps(out))
"""


def _run(cmd: list[str], timeout_s: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def _env() -> dict:
    """This environment for multi-node Ray: the loopback-only flag removed, this Python first on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def yaml_ray_start(commands: list[str], resources_file: Path) -> str:
    """The YAML's ``ray start`` line, without the launcher-only autoscaling config, reading
    this node's resources from ``resources_file`` (the YAML reads ~/.pdcluster/ray-resources.json)."""
    line = next(c for c in commands if "ray start" in c)
    line = re.sub(r"\s--autoscaling-config=\S+", "", line)
    return line.replace("~/.pdcluster/ray-resources.json", str(resources_file))


class TwoHosts:
    """Namespaces ``a`` and ``b`` joined by a veth pair (HOST_A / HOST_B), a Ray node in each."""

    def __init__(self, workdir: Path) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = {"a": f"pdc2ha{tag}", "b": f"pdc2hb{tag}"}
        self.veth = {"a": f"pdcva{tag}", "b": f"pdcvb{tag}"}
        self.workdir = workdir
        self.ray_procs: list[subprocess.Popen] = []
        self.ray_address = f"{HOST_A}:{RAY_PORT}"

    def exec(self, host: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *cmd]

    def create(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        for ns in (a, b):
            _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"]])
        for host, ip in (("a", HOST_A), ("b", HOST_B)):
            ns, dev = self.ns[host], self.veth[host]
            _run(["ip", "link", "set", dev, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Ray finds a node's own address through its default route; the namespaces do
            # not forward, so nothing leaves them.
            _run(["ip", "-n", ns, "route", "add", "default", "dev", dev])

    def start_ray(self) -> None:
        cfg = yaml.safe_load(ONPREM_YAML.read_text())
        tmp = Path(tempfile.gettempdir()) / f"pdc2h{os.getpid() % 100000}"  # short: Ray's socket paths must fit
        tmp.mkdir(exist_ok=True)
        self.ray_tmp = tmp
        for host, ip, cmds, res, extra in (
            ("a", HOST_A, cfg["head_start_ray_commands"], {"prefill_node": 1}, "--include-dashboard=false"),
            ("b", HOST_B, cfg["worker_start_ray_commands"], {"decode_node": 1}, ""),
        ):
            res_file = self.workdir / f"ray-resources-{host}.json"
            res_file.write_text(json.dumps(res))
            line = (f"{yaml_ray_start(cmds, res_file)} --block --node-ip-address={ip} --num-cpus=2 "
                    f"--temp-dir={tmp / host} {extra}")
            log = open(self.workdir / f"ray-{host}.log", "w")
            proc = subprocess.Popen(self.exec(host, "bash", "-c", line), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**_env(), "RAY_HEAD_IP": HOST_A})
            self.ray_procs.append(proc)
            deadline = time.monotonic() + 120
            while "Ray runtime started" not in (self.workdir / f"ray-{host}.log").read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray start in namespace {host} failed:\n"
                                       f"{(self.workdir / f'ray-{host}.log').read_text()[-3000:]}")
                time.sleep(0.3)

    def tx_bytes(self, host: str) -> int:
        """Bytes sent so far by ``host``'s end of the veth pair."""
        out = _run(["ip", "-n", self.ns[host], "-s", "-j", "link", "show", "dev", self.veth[host]]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def destroy(self) -> None:
        """Kill every process in both namespaces, delete them (the veth pair goes with them)."""
        for proc in self.ray_procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in self.ns.values():
            for _ in range(50):
                res = _run(["ip", "netns", "pids", ns], check=False)
                pids = [int(p) for p in res.stdout.split()] if res.returncode == 0 else []
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            _run(["ip", "netns", "del", ns], check=False)
        for proc in self.ray_procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if getattr(self, "ray_tmp", None):
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


def _pdcluster(hosts: TwoHosts, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return _run(hosts.exec("a", sys.executable, "-m", "pdcluster.cli", *args), timeout_s=timeout_s, check=False,
                cwd=REPO, env=_env())


def test_prefill_on_one_host_decode_on_the_other(tmp_path, hf_model, tokenizer, model_config):
    texts = ["The capital of France is", "List three uses of copper.",
             " ".join(["Rivers carry water from mountains to the sea, shaping valleys as they go."] * 12)]
    prompts = [tokenizer.encode(t) for t in texts]
    refs = [hf_greedy(hf_model, ids, MAX_NEW) for ids in prompts]  # before the cluster takes the CPUs
    hosts = TwoHosts(tmp_path)
    state_dir = tmp_path / "state"
    try:
        hosts.create()
        hosts.start_ray()
        up = _pdcluster(hosts, "up", "--ray-address", hosts.ray_address, "--prefill", "1", "--decode", "1",
                        "--prefill-resource", "prefill_node", "--decode-resource", "decode_node",
                        "--worker-cpus", "1", "--port", "0", "--http-port", "0", "--num-kv-blocks", "200", "--max-model-len", "512",
                        "--heartbeat-s", "0.5", "--placement-timeout-s", "120", "--state-dir", str(state_dir),
                        timeout_s=420)
        assert up.returncode == 0, f"pdcluster up failed:\n{up.stdout[-3000:]}\n{up.stderr[-5000:]}"
        state = json.loads((state_dir / "cluster.json").read_text())
        landed = {w["role"]: w["node_ip"] for w in state["workers"]}
        assert landed == {"prefill": HOST_A, "decode": HOST_B}, state["workers"]
        redis_url = urlparse(state["redis_url"])  # on the head, reachable from host B, with a password
        assert redis_url.hostname == HOST_A and redis_url.password, state["redis_url"]

        before = hosts.tx_bytes("a"), hosts.tx_bytes("b")
        res = _run(hosts.exec("a", sys.executable, "-c", CLIENT, str(state_dir / "cluster.json"), json.dumps(prompts),
                              str(MAX_NEW)), timeout_s=420, cwd=REPO, env=_env())
        after = hosts.tx_bytes("a"), hosts.tx_bytes("b")
        out = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])

        for ids, got, (ref, gaps) in zip(prompts, out["router"], refs):
            assert got["prompt_tokens"] == len(ids)
            assert_greedy_matches(got["token_ids"], ref, gaps, label=f"two-host prompt of {len(ids)} tokens")
        ref, gaps = refs[-1]
        assert_greedy_matches(out["direct"]["token_ids"], ref, gaps, label="direct Reserve+Prefill")

        per_token = model_config.kv_bytes_per_token(4)  # float32 KV on CPU
        kv_direct = out["direct"]["kv_bytes_sent"]
        assert kv_direct >= len(prompts[-1]) * per_token, (kv_direct, len(prompts[-1]) * per_token)
        kv_total = sum(len(p) for p in prompts) * per_token + kv_direct
        crossed = after[0] - before[0]  # host A (prefill) -> host B (decode)
        assert crossed >= kv_total, f"only {crossed} bytes left host A, the KV alone is {kv_total}"
        assert out["direct"]["addresses"]["decode"].startswith(f"{HOST_B}:")
    finally:
        if (state_dir / "cluster.json").exists():
            _pdcluster(hosts, "down", "--state-dir", str(state_dir), timeout_s=120)
        hosts.destroy()
    assert not any(ns in _run(["ip", "netns", "list"]).stdout for ns in hosts.ns.values())

"""Placement on a real local Ray cluster: strategies and pinning resources reach Ray's
placement groups, each worker lands in the bundle (and on the node) that advertises its
role's resource, colocated workers deploy, and ``up`` with resources the cluster cannot
offer fails within its placement timeout, saying what is missing and pointing at
``ray status``.

One Ray head (custom resources standing in for two node kinds) serves the tests that
join it with ``up --ray-address``; the impossible-resources case with ``--ray-resources``
starts (and stops) its own head through ``up --local``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import ray

from deploy import local, ray_node
from deploy.placement import PIN_AMOUNT, PlacementError, diagnose
from deploy.state import state_path
from pdcluster.cli import build_parser
from pdcluster.client import PdclusterClient
from pdcluster.v1 import worker_pb2, worker_pb2_grpc

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy, worker_channel

HEAD_RESOURCES = {"CPU": 4, "prefill_node": 1, "decode_node": 1}
COMMON = ["--worker-cpus", "1", "--num-kv-blocks", "200", "--max-model-len", "512", "--heartbeat-s", "0.5"]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    address, pid = ray_node.start_ray_head(tmp_path_factory.mktemp("ray"), resources=HEAD_RESOURCES)
    try:
        yield address
    finally:
        ray_node.stop_ray_head(pid)


@contextmanager
def cluster_on(ray_address: str, state_dir, *extra: str):
    """``pdcluster up --ray-address`` (the CLI's own parser), then ``down`` at exit."""
    args = build_parser().parse_args(["up", "--ray-address", ray_address, "--port", "0", "--http-port", "0", "--state-dir",
                                      str(state_dir), *COMMON, *extra])
    state = local.up(args)
    try:
        yield state
    finally:
        local.down(state_dir)


def _placement_table(state: dict) -> dict[str, tuple[dict, str, str]]:
    """worker id -> (its bundle, the bundle's node id, the group's strategy), from Ray itself."""
    ray.init(address=state["ray_address"], namespace="pdcluster", logging_level="WARNING")
    try:
        out = {}
        for w in state["workers"]:
            table = ray.util.placement_group_table(ray.util.get_placement_group(w["placement_group"]))
            i = w["bundle_index"]
            out[w["worker_id"]] = (table["bundles"][i], table["bundles_to_node_id"][i], table["strategy"])
        return out
    finally:
        ray.shutdown()


def _greedy_check(state: dict, hf_model, tokenizer, text: str, max_new: int = 8) -> None:
    ids = tokenizer.encode(text)
    with PdclusterClient(state["router_address"], timeout_s=120) as c:
        c.wait_ready(30)
        got = c.generate(ids, max_tokens=max_new, temperature=0)
    ref, gaps = hf_greedy(hf_model, ids, max_new)
    assert_greedy_matches(list(got.token_ids), ref, gaps, label=text)


def test_pinned_roles_land_in_bundles_of_their_node_kind(ray_head, tmp_path, hf_model, tokenizer):
    with cluster_on(ray_head, tmp_path, "--prefill", "1", "--decode", "1", "--placement", "spread",
                    "--prefill-resource", "prefill_node", "--decode-resource", "decode_node") as state:
        table = _placement_table(state)
        roles = {w["worker_id"]: w for w in state["workers"]}
        assert set(roles) == {"prefill-0", "decode-0"}
        for wid, (bundle, node, strategy) in table.items():
            pin = {"prefill": "prefill_node", "decode": "decode_node"}[roles[wid]["role"]]
            other = {"prefill_node", "decode_node"} - {pin}
            assert strategy == "SPREAD"
            assert bundle.get(pin) == pytest.approx(PIN_AMOUNT) and not other & set(bundle), bundle
            assert bundle.get("CPU") == pytest.approx(1.0) and "GPU" not in bundle
            assert node == roles[wid]["node_id"], "the worker runs on the node holding its bundle"
            assert roles[wid]["address"].startswith(roles[wid]["node_ip"] + ":")
        _greedy_check(state, hf_model, tokenizer, "The three primary colors are")
        assert_no_leak(state)


def test_colocated_workers_deploy_and_serve(ray_head, tmp_path, hf_model, tokenizer):
    with cluster_on(ray_head, tmp_path, "--colocated", "--workers", "1", "--placement", "strict-pack") as state:
        assert [(w["worker_id"], w["role"]) for w in state["workers"]] == [("colocated-0", "colocated")]
        (bundle, node, strategy), = _placement_table(state).values()
        assert strategy == "STRICT_PACK" and node == state["workers"][0]["node_id"]
        _greedy_check(state, hf_model, tokenizer, "Water boils at")
        assert_no_leak(state)
        decode_side = worker_pb2_grpc.DecodeWorkerStub(  # the pool that holds a colocated worker's KV
            worker_channel(state, state["workers"][0]["address"])).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert decode_side.num_free_blocks == decode_side.num_total_blocks and not decode_side.num_running


@pytest.mark.parametrize("extra, missing", [
    (["--prefill-resource", "h100_node"], "no node has resource 'h100_node'"),
    (["--placement", "strict-spread"], "STRICT_SPREAD needs 2 nodes, the cluster has 1"),
    (["--prefill", "3", "--decode", "3"], "the workers need 6 CPU in total, the cluster has 4"),
])
def test_up_with_impossible_resources_fails_in_time(ray_head, tmp_path, extra, missing):
    args = build_parser().parse_args(["up", "--ray-address", ray_head, "--port", "0", "--http-port", "0", "--state-dir", str(tmp_path),
                                      *COMMON, "--placement-timeout-s", "3", *extra])
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as exc:
        local.up(args)
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"up took {elapsed:.1f}s to fail with a 3 s placement timeout"
    assert missing in str(exc.value) and "ray status" in str(exc.value), str(exc.value)
    assert "within 3s" in str(exc.value)
    assert not state_path(tmp_path).exists()


def test_local_head_advertises_ray_resources(tmp_path):
    """``--ray-resources`` reaches the head ``up --local`` starts: it advertises
    ``decode_node`` but not ``prefill_node``, so only the prefill pin is reported missing
    (and the head and Redis ``up`` started are stopped again)."""
    args = build_parser().parse_args([
        "up", "--local", "--port", "0", "--http-port", "0", "--state-dir", str(tmp_path), *COMMON, "--placement-timeout-s", "3",
        "--ray-resources", '{"CPU": 4, "decode_node": 1}', "--prefill-resource", "prefill_node",
        "--decode-resource", "decode_node"])
    with pytest.raises(PlacementError) as exc:
        local.up(args)
    assert "no node has resource 'prefill_node'" in str(exc.value)
    assert "'decode_node'" not in str(exc.value).split("Bundles asked for")[0], str(exc.value)
    assert not state_path(tmp_path).exists()


def test_diagnose_names_what_is_missing():
    nodes = [{"CPU": 8.0, "GPU": 1.0, "decode_node": 1.0}, {"CPU": 8.0}]
    gpu = {"CPU": 1.0, "GPU": 1.0}
    assert diagnose([gpu, gpu], "PACK", nodes, {}) == ["the workers need 2 GPU in total, the cluster has 1"]
    assert diagnose([{"CPU": 1.0, "GPU": 2.0}], "PACK", nodes, {}) == [
        "a worker needs 2 GPU but the largest node has 1"]
    assert diagnose([{"CPU": 1.0}] * 3, "STRICT_SPREAD", nodes, {}) == [
        "STRICT_SPREAD needs 3 nodes, the cluster has 2"]
    assert diagnose([{"CPU": 6.0}] * 2, "STRICT_PACK", nodes, {}) == [
        "STRICT_PACK needs one node holding every bundle, and none does"]
    [busy] = diagnose([{"CPU": 1.0}], "PACK", nodes, {"CPU": 0.0})
    assert "in use" in busy
    for bad in ({"CPU": 1.5}, {"x": 0.5}, {"x": -1}, {"x": "1"}):
        with pytest.raises(ValueError):
            ray_node.ray_start_flags(bad)
    assert ray_node.ray_start_flags({"CPU": 2, "GPU": 0, "x": 1.0}) == [
        "--num-cpus=2", "--num-gpus=0", '--resources={"x": 1}']


def test_ray_head_ports_avoid_rays_defaults(monkeypatch):
    """CI once drew the client server's port on 52365, the dashboard agent's default, and
    ``ray start`` refused to start: drawn ports are distinct and never one of Ray's defaults."""
    drawn = iter([52365, 40000, 8265, 40000, 10001, 6379, 40001, 40002])
    monkeypatch.setattr(ray_node, "free_port", lambda: next(drawn))
    assert ray_node.ray_node_ports() == [40000, 40001, 40002]


def test_worker_gpus_lets_workers_share_a_gpu():
    from common.model_config import ConfigError
    from deploy.placement import PlacementConfig, decide_shape
    from deploy.spec import spec_from_args

    one_gpu = {"CPU": 16.0, "GPU": 1.0}
    shape = decide_shape(one_gpu, 2, "auto", None, 0.5)
    assert (shape.device, shape.gpus) == ("cuda", 0.5)
    assert shape.bundle("decode", PlacementConfig(worker_gpus=0.5)) == {"CPU": 1.0, "GPU": 0.5}
    assert decide_shape(one_gpu, 2, "auto", None).gpus == 1.0  # a whole GPU each by default
    assert decide_shape({"CPU": 2.0}, 2, "auto", None, 0.5).device == "cpu"
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="worker_gpus must be in"):
            PlacementConfig(worker_gpus=bad)

    def spec(*flags):
        return spec_from_args(build_parser().parse_args(["up", "--local", *flags]), "redis://127.0.0.1:1")

    assert spec("--worker-gpus", "0.5").placement.worker_gpus == 0.5
    with pytest.raises(ConfigError, match="--worker-gpus 0.5 .* torch_dist"):
        spec("--worker-gpus", "0.5", "--kv-transport", "torch_dist")


def test_role_threads_override_the_cpu_share():
    """``--prefill-threads`` / ``--decode-threads``: a role's torch threads, bundles unchanged;
    a replacement worker (built from the saved state) gets the same."""
    from dataclasses import asdict

    from deploy.cluster import worker_config
    from deploy.placement import PlacementConfig, decide_shape
    from deploy.spec import spec_from_args

    def spec(*flags):
        return spec_from_args(build_parser().parse_args(["up", "--local", *flags]), "redis://127.0.0.1:1")

    s = spec("--prefill-threads", "2")
    shape = decide_shape({"CPU": 2.0}, 2, "cpu", None)
    assert shape.threads == 1
    threads = {role: worker_config(s.worker, shape, s.placement, role, f"{role}-0").num_threads
               for role in ("prefill", "decode", "colocated")}
    assert threads == {"prefill": 2, "decode": 1, "colocated": 1}
    assert shape.bundle("prefill", s.placement) == shape.bundle("decode", s.placement) == {"CPU": 0.5}
    saved = PlacementConfig(**asdict(s.placement))  # what recreate_worker rebuilds from the state
    assert saved.threads("prefill", shape) == 2 and saved.threads("decode", shape) == 1
    assert spec("--decode-threads", "3").placement.threads("decode", shape) == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_threads must be an integer >= 1"):
            PlacementConfig(prefill_threads=bad)
    assert PlacementConfig(**{k: v for k, v in asdict(PlacementConfig()).items()
                              if k not in ("prefill_threads", "decode_threads")}).threads("prefill", shape) == 1


@ray.remote(num_cpus=0)
class _SlowToStop:
    def stop(self) -> None:  # as an actor whose stop() waits on a paused Redis
        time.sleep(60)

    def ping(self) -> str:
        return "pong"


def test_kill_actors_shares_one_stop_timeout_and_kills_the_hung_ones(ray_head, caplog):
    """``down`` with the cluster's Redis paused: every actor's ``stop()`` hung in turn for its own 10 s
    (30 s and Ray's raw ``Get timed out`` for a 1P+1D cluster, helper finding). Now the actors are asked
    at once, share the timeout, and each one that did not stop is named and killed."""
    from deploy.cluster import NAMESPACE, kill_actors

    ray.init(address=ray_head, namespace=NAMESPACE, logging_level="WARNING")
    try:
        names = ["slow-stop-a", "slow-stop-b", "slow-stop-c"]
        actors = [_SlowToStop.options(name=n, lifetime="detached").remote() for n in names]
        assert ray.get([a.ping.remote() for a in actors], timeout=60) == ["pong"] * 3
        start = time.monotonic()
        kill_actors(names + ["never-created"], stop_timeout_s=2.0)
        assert time.monotonic() - start < 5.0  # one shared 2 s, not 2 s each
        for n in names:
            assert f"stopping {n}: it did not stop within 2 s; killing it" in caplog.text
            with pytest.raises(ValueError):  # gone for good (no restart)
                for _ in range(50):
                    ray.get_actor(n, namespace=NAMESPACE)
                    time.sleep(0.2)
    finally:
        ray.shutdown()

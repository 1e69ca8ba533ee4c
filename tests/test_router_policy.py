"""Worker choice through the one ``Policy`` interface, the load tracker, the placement
step, and the ``--router-policy`` flag (no Redis, no workers)."""

from __future__ import annotations

import pytest

from common.prefix_hash import block_hashes
from deploy.spec import spec_from_args
from router.load import LoadTracker
from router.placement import POLICIES, Placer, make_policy
from router.policy import NoWorkerError, RequestContext, Signals
from router.policy_names import CACHE_AWARE, DEFAULT_POLICY, LEAST_LOADED, POLICY_NAMES, ROUND_ROBIN
from router.server import RouterConfig
from serving.registry import WorkerInfo, WorkerLoadSnapshot

from cli_helpers import parse_up

PROMPT = list(range(200, 328))  # 8 blocks of 16
REQUEST = RequestContext("r", PROMPT)


def _cand(wid: str, role: str = "decode", draining: bool = False, waiting: int = 0, free: int = 10):
    return (WorkerInfo(worker_id=wid, role=role, address=f"127.0.0.1:{len(wid)}"),
            WorkerLoadSnapshot(num_waiting=waiting, num_free_blocks=free, num_total_blocks=10, draining=draining))


def _policy(name: str, index: dict | None = None, load: LoadTracker | None = None):
    """The registered policy; ``index`` stands in for the CacheIndexView (same ``get``)."""
    return make_policy(name, Signals(load or LoadTracker(), {} if index is None else index))


def _ids(choices) -> list[str]:
    return [c.worker.worker_id for c in choices]


def test_registry_holds_every_name_and_the_default():
    assert sorted(POLICIES) == sorted(POLICY_NAMES) and DEFAULT_POLICY == CACHE_AWARE
    with pytest.raises(ValueError, match="registered: cache_aware, least_loaded, round_robin"):
        make_policy("fastest", Signals(LoadTracker()))
    with pytest.raises(ValueError, match="cache index"):
        make_policy(CACHE_AWARE, Signals(LoadTracker()))


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_every_policy_skips_draining_and_reports_no_worker(name, role):
    policy = _policy(name)
    # w-0 would win on load, free blocks and id, but it is draining
    cands = [_cand("w-0", role, draining=True, free=99), _cand("w-1", role, waiting=5), _cand("w-2", role, True)]
    assert {c.worker.worker_id for c in (policy.choose(role, cands, REQUEST) for _ in range(4))} == {"w-1"}
    with pytest.raises(NoWorkerError, match=f"no live {role} worker \\(2 draining\\)"):
        policy.choose(role, [_cand("a", role, True), _cand("b", role, True)], REQUEST)
    with pytest.raises(NoWorkerError, match=f"^no live {role} worker$"):
        policy.choose(role, [], REQUEST)


def test_least_loaded_counts_router_in_flight_and_worker_queue_then_free_blocks():
    load = LoadTracker()
    policy = _policy(LEAST_LOADED, load=load)
    cands = [_cand("d-0", free=5), _cand("d-1", free=8), _cand("d-2", waiting=1, free=50)]
    assert policy.choose("decode", cands, REQUEST).worker.worker_id == "d-1"  # ties on load: most free blocks
    lease = load.begin("p-0", "d-1", len(PROMPT))
    assert policy.choose("decode", cands, REQUEST).worker.worker_id == "d-0"
    lease.end()
    assert policy.choose("decode", cands, REQUEST).worker.worker_id == "d-1"


def test_round_robin_takes_each_worker_in_id_order_per_role():
    policy = _policy(ROUND_ROBIN)
    decode = [_cand("d-1"), _cand("d-0"), _cand("d-2")]
    prefill = [_cand("p-1", "prefill"), _cand("p-0", "prefill")]
    picked = []
    for _ in range(4):  # the roles' turns are independent even when asked alternately
        picked.append((policy.choose("decode", decode, REQUEST).worker.worker_id,
                       policy.choose("prefill", prefill, REQUEST).worker.worker_id))
    assert picked == [("d-0", "p-0"), ("d-1", "p-1"), ("d-2", "p-0"), ("d-0", "p-1")]


def test_cache_aware_scores_expected_prefill_work_and_decode_as_least_loaded():
    hashes = block_hashes(PROMPT, 16, "m")
    index = {"warm": ({"model_id": "m", "block_size": 16}, set(hashes[:6]))}
    load = LoadTracker()
    policy = _policy(CACHE_AWARE, index, load)
    cands = [_cand("cold", "prefill", free=50), _cand("warm", "prefill", free=5)]
    choice = policy.choose("prefill", cands, REQUEST)
    assert (choice.worker.worker_id, choice.cached_tokens) == ("warm", 96)  # 32 uncached < 128
    lease = load.begin("warm", "d-0", 100)  # 32 + 100 queued > 128 + 0
    choice = policy.choose("prefill", cands, REQUEST)
    assert (choice.worker.worker_id, choice.cached_tokens) == ("cold", 0)
    lease.prefill_finished()
    assert policy.choose("prefill", cands, REQUEST).worker.worker_id == "warm"
    even = [_cand("a", "prefill", free=5), _cand("b", "prefill", free=9)]
    assert policy.choose("prefill", even, REQUEST).worker.worker_id == "b"  # equal work: most free blocks
    # the decode role ignores caches and token queues: fewest in flight (d-0 holds the lease)
    assert policy.choose("decode", [_cand("d-0", free=99), _cand("d-1")], REQUEST).worker.worker_id == "d-1"
    lease.end()


def test_load_tracker_counts_return_to_zero():
    load = LoadTracker()
    a = load.begin("p-0", "d-0", 40)
    b = load.begin("p-0", "d-1", 10)
    colo = load.begin("c-0", "c-0", 7)  # a colocated worker serves both roles
    assert [load.in_flight(w) for w in ("p-0", "d-0", "d-1", "c-0")] == [2, 1, 1, 2]
    assert (load.queued_tokens("p-0"), load.queued_tokens("c-0"), load.queued_tokens("d-0")) == (50, 7, 0)
    a.prefill_finished()
    a.prefill_finished()  # a second report changes nothing
    assert (load.queued_tokens("p-0"), load.in_flight("p-0")) == (10, 2)
    for lease in (a, b, colo, a, colo):  # ending twice changes nothing either
        lease.end()
    assert all(load.in_flight(w) == 0 and load.queued_tokens(w) == 0 for w in ("p-0", "d-0", "d-1", "c-0"))


class _View:
    """Stands in for the RegistryView: fixed workers by role."""

    def __init__(self, *cands) -> None:
        self.cands = cands

    def workers(self, role: str):
        return [c for c in self.cands if c[0].role == role]

    workers_now = workers


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_placement_uses_colocated_workers_for_both_halves(name):
    view = _View(_cand("c-0", "colocated", waiting=3), _cand("c-1", "colocated"))
    placement = Placer(view, _policy(name)).place(REQUEST)
    assert placement.prefill is placement.decode and placement.decode.role == "colocated"
    with pytest.raises(NoWorkerError, match="no live colocated worker \\(1 draining\\)"):
        Placer(_View(_cand("c-0", "colocated", draining=True)), _policy(name)).place(REQUEST)


def test_placement_chooses_a_decode_and_a_prefill_worker():
    placer = Placer(_View(_cand("p-0", "prefill"), _cand("d-0"), _cand("d-1", waiting=2)), _policy(LEAST_LOADED))
    placement = placer.place(REQUEST)
    assert (placement.prefill.worker_id, placement.decode.worker_id) == ("p-0", "d-0")
    with pytest.raises(NoWorkerError, match="^no live prefill worker$"):
        Placer(_View(_cand("d-0")), _policy(LEAST_LOADED)).place(REQUEST)



def test_router_policy_flag_and_config(capsys):
    assert parse_up().router_policy == DEFAULT_POLICY
    args = parse_up("--router-policy", "round_robin")
    assert spec_from_args(args, "redis://127.0.0.1:1").router.policy == ROUND_ROBIN
    with pytest.raises(SystemExit):
        parse_up("--router-policy", "fastest")
    assert "invalid choice" in capsys.readouterr().err
    assert RouterConfig(model="m", model_path="/m", redis_url="redis://x").policy == CACHE_AWARE
    with pytest.raises(ValueError, match="unknown router policy 'fastest'; registered: cache_aware, least_loaded"):
        RouterConfig(model="m", model_path="/m", redis_url="redis://x", policy="fastest")

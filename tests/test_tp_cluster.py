"""The transfer matrix of tensor parallelism through a real local cluster (Ray, Redis, router,
one prefill and one decode worker, gRPC KV transfer): prefill TP x decode TP in
{(1, 2), (2, 1), (2, 2)}, token-exact vs HF ``transformers`` (a near tie allowed by the
margin rule); one cell streams the KV layer by layer, one moves it by ``torch_dist``, one
corrupts a chunk (the same failure contract as without TP: refused, then recomputed). Each cell serves a tiny random model (HF's method, ``tests/family_models.py``;
the SmolLM2 vocabulary) whose heads split: 2 KV heads (one per rank) or 1 KV head
(replicated on both ranks). The KV transfer re-shards heads between the sides' layouts:
a TP=2 prefill worker's rank 0 reads both ranks' shares, a TP=2 decode worker writes
each rank's heads into its share. Every cell ends with a leak check, and after ``down``
the ranks (processes of the worker actors) are gone. In one cell a rank is killed: its worker is
started again (new ranks, next generation) and serves token-exact.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from family_models import build_tiny, hf_model
from kv_helpers import FAULTY_MODULE

from cluster_utils import (
    assert_greedy_matches,
    assert_no_leak,
    children,
    hf_greedy,
    router_client,
    running_cluster,
    worker_loads,
)

from serving.registry import WorkerRegistry

# (prefill TP, decode TP) -> (family, KV heads, more `up` flags): the TP=2 prefill worker of (2, 1)
# streams layer by layer (layer l leaves once both ranks wrote it), (2, 2) moves its KV by torch_dist
# and (1, 2) corrupts the first transfer's first chunk: refused before any rank's share is
# written, the TP=2 decode worker recomputes that prompt's KV itself (--kv-failure-policy recompute)
CORRUPT_FIRST = ("--kv-transport", "faulty", "--kv-transport-module", FAULTY_MODULE, "--kv-transport-option",
                 "fault=corrupt", "--kv-transport-option", "chunk=0", "--kv-transport-option", "transfers=1",
                 "--kv-failure-policy", "recompute")
CELLS = {(1, 2): ("llama3", 1, CORRUPT_FIRST), (2, 1): ("qwen3", 2, ("--kv-layerwise",)),
         (2, 2): ("llama3", 2, ("--kv-transport", "torch_dist"))}
LENGTHS = (5, 12, 27)
NEW_TOKENS = 10


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module", params=list(CELLS), ids=lambda c: f"P{c[0]}-D{c[1]}")
def cell(request, tmp_path_factory, model_dir):
    p_tp, d_tp = request.param
    family, kv_heads, flags = CELLS[request.param]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    folder = build_tiny(family, tmp_path_factory.mktemp("tpmodel"), vocab_size=vocab, tokenizer_dir=model_dir,
                        num_key_value_heads=kv_heads)
    with running_cluster(tmp_path_factory.mktemp("state"), "--model", str(folder), "--block-size", "4",
                         "--num-kv-blocks", "128", "--max-model-len", "128", "--heartbeat-s", "0.5",
                         "--prefill-tp", str(p_tp), "--decode-tp", str(d_tp), *flags) as state:
        ranks = {w["role"]: children(w["pid"]) for w in state["workers"]}
        yield dict(state=state, folder=folder, tp={"prefill": p_tp, "decode": d_tp}, ranks=ranks, flags=flags)
    deadline = time.monotonic() + 15
    while any(_alive(p) for pids in ranks.values() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for pids in ranks.values() for p in pids if _alive(p)], "tensor-parallel ranks outlived `down`"


def test_tp_cell_token_exact_vs_hf(cell):
    state, tp = cell["state"], cell["tp"]
    for role, n in tp.items():  # a TP=2 worker's actor spawned its rank 1 (and spawn's resource tracker)
        assert bool(cell["ranks"][role]) == (n > 1), (role, cell["ranks"])
    reference = hf_model(cell["folder"])
    base = list(range(300, 300 + max(LENGTHS) * 7, 7))
    prompts = [base[:n] for n in LENGTHS]
    with router_client(state) as client:
        assert len(client.model_info().model_name) > 0
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.generate(p, max_tokens=NEW_TOKENS, temperature=0), prompts))
    for p, res in zip(prompts, results):
        ref, gaps = hf_greedy(reference, p, NEW_TOKENS)
        assert_greedy_matches(res.token_ids, ref, gaps, label=f"P TP={tp['prefill']} D TP={tp['decode']} {len(p)} tokens")
    assert_no_leak(state)
    if "fault=corrupt" in cell["flags"]:
        decode = [w for w in worker_loads(state) if w.worker_id.startswith("decode")]
        assert [(w.num_failed_transfers, w.num_kv_recomputes) for w in decode] == [(1, 1)]


def _rank_processes(pid: int) -> list[int]:
    """The tensor-parallel ranks a worker process spawned (not spawn's resource tracker)."""
    return [c for c in children(pid) if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def test_a_worker_whose_rank_dies_is_started_again(cell):
    """A TP=2 decode worker whose rank 1 is killed leaves the registry and ends its process (it
    would fail every step while it kept beating); Ray starts it again with new ranks, under the
    next generation, and it serves token-exact. One cell: the others' workers are the same code."""
    if cell["tp"] != {"prefill": 1, "decode": 2}:
        pytest.skip("run on the P1-D2 cell")
    state = cell["state"]
    reg = WorkerRegistry(state["redis_url"], state["cluster"])
    (before, _), = reg.live_workers("decode")
    ranks = _rank_processes(before.pid)
    assert len(ranks) == 1, ranks
    os.kill(ranks[0], signal.SIGKILL)
    deadline, after = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        live = [w for w, _ in reg.live_workers("decode")]
        if live and live[0].generation > before.generation:
            after = live[0]
            break
        time.sleep(0.5)
    assert after is not None, f"the decode worker was not started again within 120 s (live: {live})"
    assert after.pid != before.pid and not _alive(before.pid) and not _alive(ranks[0])
    assert len(_rank_processes(after.pid)) == 1
    reference = hf_model(cell["folder"])
    prompt = list(range(300, 300 + 12 * 7, 7))
    with router_client(state) as client:
        res = client.generate(prompt, max_tokens=NEW_TOKENS, temperature=0)
    ref, gaps = hf_greedy(reference, prompt, NEW_TOKENS)
    assert_greedy_matches(res.token_ids, ref, gaps, label="after the decode worker's rank died")
    assert_no_leak(state)

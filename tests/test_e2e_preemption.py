"""Decode admission under memory pressure through the whole cluster: a KV pool far too
small for all requests at once forces preemption; every output stays token-exact
against HF and the pools return to baseline."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_e2e import _mt_bench_first_turns

from pdcluster.client import PdclusterClient

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy, render_chat, running_cluster, worker_loads

NUM_BLOCKS = 40  # 39 usable blocks of 16 tokens; 20 requests need ~6 each


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", "512", "--block-size", "16",
                         "--num-kv-blocks", str(NUM_BLOCKS), "--heartbeat-s", "0.5") as state:
        yield state


def test_twenty_requests_over_a_small_pool_preempt_and_stay_exact(cluster, hf_model, tokenizer):
    prompts = _mt_bench_first_turns(40)[20:40]
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    total_blocks = sum(-(-(len(render_chat(tokenizer, m)) + 24) // 16) for m in msgs)
    assert total_blocks > 2 * NUM_BLOCKS  # the pool holds well under half of them at once
    with PdclusterClient(cluster["router_address"], timeout_s=600) as client:
        client.wait_ready(30)
        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(lambda m: client.generate(m, max_tokens=24, temperature=0), msgs))
    for m, res in zip(msgs, results):
        ids = render_chat(tokenizer, m)
        ref, gaps = hf_greedy(hf_model, ids, 24)
        assert_greedy_matches(res.token_ids, ref, gaps, label=m[0]["content"][:40])
    decode = [w for w in worker_loads(cluster) if w.role == "decode"]
    assert decode and decode[0].num_preemptions > 0, "the pool was small enough to force preemption"
    assert_no_leak(cluster)

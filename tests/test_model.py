"""Our paged-KV decoder (``engine.model.decoder.CausalLM``) against HF transformers on the same weights.

SmolLM2-135M (Llama architecture, GQA 9/3, tied embeddings) for batched varlen
prefill, decode through :class:`ModelRunner` and chunked prefill; a tiny random
Qwen2 (q/k/v biases, untied LM head) for the bias path.
"""

from __future__ import annotations

import pytest
import torch

from common.model_config import ModelConfig
from engine.attention import SeqSlice, build_attention_metadata
from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import build_unloaded, load_model
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan

CPU = torch.device("cpu")
BLOCK = 16
GREEDY = SamplingOptions(temperature=0.0)

PROMPTS = [
    "The capital of France is",
    "Here is a short list of fruits: apple, banana, cherry, and",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
    "woodcutter who every morning",
]


@pytest.fixture(scope="module")
def model(model_config):
    return load_model(model_config, CPU, torch.float32)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(x) for x in ids}) == 3  # three different lengths: a real varlen batch
    return ids


def _runner(model, model_config, num_blocks=32):
    kv = allocate_kv_cache(model_config, CacheConfig(block_size=BLOCK, num_blocks=num_blocks), CPU)
    return ModelRunner(model, kv, BLOCK)


@torch.inference_mode()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain argmax continuation through HF's own KV cache (no generation-config logits processors)."""
    out = hf(torch.tensor([ids]), use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    while len(toks) < n:
        out = hf(torch.tensor([[toks[-1]]]), cache=out.cache, use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


def _forward_logits(model, kv_cache, slices: list[SeqSlice], tokens: list[int]) -> torch.Tensor:
    """All-position logits ``[T, vocab]`` of one step run straight through the model."""
    meta = build_attention_metadata(slices, BLOCK)
    hidden = model(torch.tensor(tokens), meta, kv_cache)
    return model.compute_logits(hidden)


def test_batched_prefill_then_decode_matches_hf(model, model_config, hf_model, prompt_ids):
    runner = _runner(model, model_config)
    # non-contiguous, interleaved tables with room for the decode steps
    tables = [[7, 2], [5, 11, 1], [9, 3, 14, 6]]
    slices = [SeqSlice(0, len(ids), t) for ids, t in zip(prompt_ids, tables)]
    flat = [t for ids in prompt_ids for t in ids]
    logits = _forward_logits(model, runner.kv_cache, slices, flat)
    assert logits.shape == (len(flat), model_config.vocab_size)
    assert logits.dtype == torch.float32

    starts = [0]
    for ids in prompt_ids:
        starts.append(starts[-1] + len(ids))
    for i, ids in enumerate(prompt_ids):
        ref = _hf_logits(hf_model, ids)
        torch.testing.assert_close(logits[starts[i]:starts[i + 1]], ref, atol=1e-3, rtol=0)

    # decode: the prompts' KV is already in the cache; feed the last sampled token each step
    steps = 4
    generated = [[int(logits[starts[i + 1] - 1].argmax())] for i in range(3)]
    for _ in range(steps):
        plan = StepPlan([
            ScheduledSeq(f"r{i}", [generated[i][-1]], len(ids) + len(generated[i]) - 1, tables[i], True, GREEDY)
            for i, ids in enumerate(prompt_ids)
        ])
        out = runner.execute(plan)
        assert out.request_ids == ["r0", "r1", "r2"]
        assert out.logprobs == [None, None, None]
        for i, tok in enumerate(out.token_ids):
            generated[i].append(tok)
    for i, ids in enumerate(prompt_ids):
        assert generated[i] == _hf_greedy(hf_model, ids, steps + 1), f"prompt {i}"


def test_chunked_prefill_equals_unchunked(model, model_config, prompt_ids):
    ids = prompt_ids[2]
    n = len(ids)
    cuts = [0, n // 3, 2 * n // 3, n]
    opts = SamplingOptions(temperature=0.0, logprobs=3)

    # unchunked, through the runner and straight through the model
    whole = _runner(model, model_config)
    table_a = [4, 1, 8]
    ref = whole.execute(StepPlan([ScheduledSeq("a", ids, 0, table_a, True, opts)]))
    ref_logits = _forward_logits(model, _runner(model, model_config).kv_cache, [SeqSlice(0, n, table_a)], ids)

    # three chunks over three steps, sampling only after the last one
    chunked = _runner(model, model_config)
    table_b = [6, 2, 10]
    outs = []
    for j in range(3):
        lo, hi = cuts[j], cuts[j + 1]
        outs.append(chunked.execute(StepPlan([ScheduledSeq("b", ids[lo:hi], lo, table_b, j == 2, opts)])))
    assert [o.token_ids for o in outs[:2]] == [[], []]
    assert outs[2].token_ids == ref.token_ids
    assert outs[2].token_ids[0] == int(ref_logits[-1].argmax())
    lp_ref, lp_chunk = ref.logprobs[0], outs[2].logprobs[0]
    assert lp_chunk.logprob == pytest.approx(lp_ref.logprob, abs=1e-4)
    assert [t for t, _ in lp_chunk.top] == [t for t, _ in lp_ref.top]
    assert [lp for _, lp in lp_chunk.top] == pytest.approx([lp for _, lp in lp_ref.top], abs=1e-4)

    # the chunks' logits (each chunk attending to the cached earlier ones) equal unchunked
    kv = _runner(model, model_config).kv_cache
    parts = [
        _forward_logits(model, kv, [SeqSlice(cuts[j], cuts[j + 1] - cuts[j], table_b)], ids[cuts[j]:cuts[j + 1]])
        for j in range(3)
    ]
    torch.testing.assert_close(torch.cat(parts), ref_logits, atol=1e-4, rtol=0)
    # and the KV the chunks wrote equals the unchunked KV, slot for slot
    torch.testing.assert_close(chunked.kv_cache[:, :, table_b], whole.kv_cache[:, :, table_a], atol=1e-4, rtol=0)


# ---- Qwen2: q/k/v biases --------------------------------------------------------------

def _tiny_qwen2(tmp_path):
    """A tiny random Qwen2 saved as an HF folder (every weight and bias random: HF
    initializes biases to zero), our model loaded from it and HF's."""
    from family_models import build_tiny, hf_model

    folder = build_tiny("qwen2", tmp_path / "qwen2", vocab_size=128, hidden_size=96, intermediate_size=160,
                        num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2, use_sliding_window=False,
                        tie_word_embeddings=False)
    cfg = ModelConfig.from_hf_folder(folder)
    return cfg, load_model(cfg, CPU, torch.float32, attention_backend="torch", linear_backend="torch"), hf_model(folder)


def test_qwen2_attention_bias_matches_hf(tmp_path):
    cfg, ours, hf = _tiny_qwen2(tmp_path)
    attn = ours.model.layers[1].self_attn  # q/k/v merged (engine.model.fuse): [q | k | v] biases
    q_size, kv_size = attn.qkv_sizes[:2]
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert ours.lm_head is not None
    assert float(attn.qkv_proj.bias[q_size:q_size + kv_size].abs().sum()) > 1.0  # k's bias

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 19, 3)]
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=4, num_blocks=24), CPU)
    tables = [[3, 9], [1, 12, 5, 20, 7], [15]]
    slices = [SeqSlice(0, len(p), t) for p, t in zip(prompts, tables)]
    meta = build_attention_metadata(slices, 4)
    logits = ours.compute_logits(ours(torch.tensor([t for p in prompts for t in p]), meta, kv))
    start = 0
    with torch.inference_mode():
        for p in prompts:
            ref = hf(torch.tensor([p])).logits[0]
            torch.testing.assert_close(logits[start:start + len(p)], ref, atol=1e-4, rtol=0)
            start += len(p)

    # one decode step of the first prompt over its cached KV equals HF on the extended prompt
    nxt = int(logits[len(prompts[0]) - 1].argmax())
    runner = ModelRunner(ours, kv, 4)
    plan = StepPlan([ScheduledSeq("q", [nxt], len(prompts[0]), tables[0], True,
                                  SamplingOptions(temperature=0.0, logprobs=1))])
    out = runner.execute(plan)
    with torch.inference_mode():
        ref_last = hf(torch.tensor([prompts[0] + [nxt]])).logits[0, -1]
    assert out.token_ids == [int(ref_last.argmax())]
    assert out.logprobs[0].logprob == pytest.approx(float(ref_last.log_softmax(-1).max()), abs=1e-4)


def test_the_model_is_built_without_random_initialisation():
    """``load_model`` builds the layers with their random initialisation skipped (the checkpoint
    writes every parameter): no draw from torch's generator while they are built, and the
    generator works as usual after."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    layers = build_unloaded(lambda: torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8)),
                            CPU, torch.float32)
    assert torch.equal(torch.rand(4), expected)
    assert not any(p.requires_grad for p in layers.parameters())
    assert torch.nn.Linear(8, 8).weight.abs().sum() > 0  # random initialisation is back outside the builder

"""The ``"batch-invariant"`` attention backend (:func:`engine.attention.torch_backend.paged_attention_batch_invariant`):
a row's attention, and so its K/V and logits, is computed the same way whatever the step holds.

Through :class:`ModelRunner` on the bundled SmolLM2 (float32 and int8): a prompt prefilled whole, after a
cached prefix (1, 2 or 17 rows left to compute), in chunks, and batched with another prompt gives
bit-identical logits and KV; a request decoded token by token and then recomputed by one prefill of its
prompt + outputs (what a preempted or migrated request does) writes bit-identical KV and picks the same next
token from bit-identical logits. The ``"torch"`` backend's SDPA path does not: under int8 its ~1e-6
rounding differences become logit changes of ~0.1-1 (found by a helper's trial: a prefix-cache hit changed
a greedy int8 stream). Quantized models take this backend by default on CPU.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import default_attention_backend, load_model
from engine.model_loader import DEFAULT_MODEL, resolve_model_source
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan

CPU = torch.device("cpu")
BS = 16
GREEDY = SamplingOptions(temperature=0.0)
PROMPT = [(i * 7919) % 20000 + 100 for i in range(49)]  # 49 tokens: 3 full blocks + 1


@pytest.fixture(scope="module", params=["none", "int8"])
def runner(request, model_config):
    _, gguf = resolve_model_source(DEFAULT_MODEL)
    model = load_model(model_config, CPU, torch.float32, attention_backend="batch-invariant",
                       quantization=request.param, gguf_path=gguf)
    kv = allocate_kv_cache(model_config, CacheConfig(block_size=BS, num_blocks=48), CPU)
    return ModelRunner(model, kv, BS)


def _blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BS)))


def _logits(runner: ModelRunner, seqs: list[ScheduledSeq]) -> torch.Tensor:
    logits, _, _ = runner.forward_logits(StepPlan(seqs))
    return logits


def _kv(runner: ModelRunner, table: list[int], tokens: int) -> torch.Tensor:
    """``[layers, 2, tokens, kv_heads, head_dim]``: the KV of a sequence's first ``tokens`` positions."""
    kv = runner.kv_cache[:, :, table]
    return kv.reshape(kv.shape[0], 2, -1, *kv.shape[-2:])[:, :, :tokens].clone()


@pytest.mark.parametrize("length", [17, 18, 33, 49])
def test_a_prompt_gives_the_same_logits_and_kv_however_its_rows_are_computed(runner, length):
    prompt = PROMPT[:length]
    whole = _blocks(1, length)
    ref = _logits(runner, [ScheduledSeq("whole", prompt, 0, whole, True, GREEDY)])
    ref_kv = _kv(runner, whole, length)

    cached = (length - 1) // BS * BS  # a prefix-cache hit: the full blocks reused, the rest computed
    hit = _blocks(10, length)
    for src, dst in zip(whole[:cached // BS], hit):
        runner.kv_cache[:, :, dst] = runner.kv_cache[:, :, src]
    assert torch.equal(_logits(runner, [ScheduledSeq("hit", prompt[cached:], cached, hit, True, GREEDY)]), ref)
    assert torch.equal(_kv(runner, hit, length), ref_kv)

    chunked = _blocks(20, length)  # chunked prefill: 5 tokens, then the rest
    _logits(runner, [ScheduledSeq("chunk", prompt[:5], 0, chunked, False, GREEDY)])
    assert torch.equal(_logits(runner, [ScheduledSeq("chunk", prompt[5:], 5, chunked, True, GREEDY)]), ref)
    assert torch.equal(_kv(runner, chunked, length), ref_kv)

    batched, other = _blocks(30, length), _blocks(40, 7)  # batched with another prompt, second in the batch
    out = _logits(runner, [ScheduledSeq("other", PROMPT[20:27], 0, other, True, GREEDY),
                           ScheduledSeq("batched", prompt, 0, batched, True, GREEDY)])
    assert torch.equal(out[1:], ref)
    assert torch.equal(_kv(runner, batched, length), ref_kv)


def test_a_recompute_of_decoded_tokens_writes_the_kv_the_decode_steps_wrote(runner):
    """What a preempted request (recomputed by its decode worker) or a migrated one (prefilled again with
    its streamed tokens) relies on: the decode steps' KV and the one-prefill recompute's are bit-identical,
    and so are the next token's logits."""
    prompt, steps = PROMPT[:20], 14
    table = _blocks(1, len(prompt) + steps + 1)
    assert runner.decode_plan is not None and runner.decode_plan.native is not None  # the C++ layer loop
    token = int(_logits(runner, [ScheduledSeq("d", prompt, 0, table, True, GREEDY)]).argmax())
    out = [token]
    for i in range(steps):  # one-token steps: the runner's decode plan, as a decode worker runs them
        logits = _logits(runner, [ScheduledSeq("d", [out[-1]], len(prompt) + i, table, True, GREEDY)])
        out.append(int(logits.argmax()))
    total = len(prompt) + steps  # the last output token has no KV yet
    decoded_kv = _kv(runner, table, total)

    again = _blocks(10, total + 1)
    logits = _logits(runner, [ScheduledSeq("r", prompt + out[:-1], 0, again, True, GREEDY)])
    assert torch.equal(_kv(runner, again, total), decoded_kv)
    assert int(logits.argmax()) == out[-1]


def test_quantized_models_take_the_batch_invariant_backend_on_cpu():
    assert default_attention_backend(CPU, "int8") == default_attention_backend(CPU, "q4") == "batch-invariant"
    assert default_attention_backend(CPU) == "torch"
    # the kernel is float32-only: quantized weights in bfloat16 keep "torch" (which runs SDPA in bfloat16)
    assert default_attention_backend(CPU, "int8", torch.bfloat16) == "torch"
    assert default_attention_backend(torch.device("cuda"), "int8") == "triton"

"""vLLM's ``prompt_logprobs`` on a real prefill scheduler: each prompt token's logprob, rank and top
alternatives equal HF ``transformers`` float32's (log_softmax of its logits), whatever the chunking;
a migrated request's outputs add none; the prefix cache is not used for such a request (every
position needs its logits) and still serves the others. End to end: ``tests/test_e2e_sampling.py``."""

from __future__ import annotations

import pytest
import torch

from engine.prompt_logprobs import SLICE_ROWS, compute_prompt_logprobs, prompt_next_ids
from pdcluster.v1 import common_pb2, worker_pb2
from serving.convert import request_from_proto

from sched_helpers import CPU, _no_leak, _prefill_sched, _pump, model, text_ids  # noqa: F401 - fixtures

TOP = 3


def _prefill(model, model_config, prompt, budget, outputs=(), prompt_logprobs=TOP, sched=None):
    """Prefill ``prompt`` (+ ``outputs``) on a prefill scheduler (one is made unless ``sched`` is given);
    returns the scheduler's result and the scheduler."""
    if sched is None:
        _, sched = _prefill_sched(model, model_config, budget=budget, num_blocks=32, prefix_caching=True)
    sampling = common_pb2.SamplingParams(max_tokens=len(outputs) + 2, temperature=0.0, top_p=1.0,
                                         repetition_penalty=1.0, prompt_logprobs=prompt_logprobs)
    if prompt_logprobs is None:
        sampling.ClearField("prompt_logprobs")
    rid = f"r{len(prompt)}-{budget}-{len(outputs)}-{prompt_logprobs}-{id(sched) % 1000}"
    wreq = worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                    output_token_ids=list(outputs))

    def send(r, progress) -> int:
        progress.wait_finished(timeout_s=30)
        return 0

    fut = sched.submit(request_from_proto(wreq, f"x-{rid}", CPU), send)
    _pump(sched, fut.done, timeout=120)
    return fut.result(), sched


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, text_ids):
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([text_ids[:50]])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("budget", [2048, 16, 7])
def test_prompt_logprobs_equal_hf_whatever_the_chunking(model, model_config, text_ids, hf_logprobs, budget):
    prompt = text_ids[:50]
    res, sched = _prefill(model, model_config, prompt, budget)
    assert len(res.prompt_logprobs) == len(prompt) - 1
    for i, lp in enumerate(res.prompt_logprobs):
        ref = hf_logprobs[i]
        token = prompt[i + 1]
        assert abs(lp.logprob - float(ref[token])) < 1e-3, (i, lp.logprob, float(ref[token]))
        assert abs(lp.rank - (int((ref > ref[token]).sum()) + 1)) <= 1, i  # a near tie may swap neighbours
        assert [t for t, _ in lp.top][0] == int(ref.argmax()) and len(lp.top) == TOP
        assert all(abs(v - float(ref[t])) < 1e-3 for t, v in lp.top)
    _no_leak(sched)
    sched.shutdown()


def test_outputs_of_a_migrated_request_add_none_and_the_cache_is_bypassed(model, model_config, text_ids,
                                                                          hf_logprobs):
    prompt = text_ids[:40]
    plain, sched = _prefill(model, model_config, prompt, 2048, prompt_logprobs=None)
    assert plain.prompt_logprobs == [] and plain.cached_tokens == 0
    again, _ = _prefill(model, model_config, prompt, 2048, prompt_logprobs=None, sched=sched)
    assert again.cached_tokens > 0  # the cache works for a request without prompt logprobs
    res, _ = _prefill(model, model_config, prompt, 16, outputs=text_ids[40:45], prompt_logprobs=0, sched=sched)
    assert res.cached_tokens == 0 and len(res.prompt_logprobs) == len(prompt) - 1
    assert all(lp.top == [] for lp in res.prompt_logprobs)
    assert abs(res.prompt_logprobs[-1].logprob - float(hf_logprobs[38][prompt[39]])) < 1e-3
    _no_leak(sched)
    sched.shutdown()


def test_chunk_positions_and_slices():
    assert prompt_next_ids([5, 6, 7, 8], 0, 4) == [6, 7, 8]  # the last position precedes no prompt token
    assert prompt_next_ids([5, 6, 7, 8], 1, 2) == [7, 8]
    assert prompt_next_ids([5, 6, 7, 8], 3, 3) == []  # a migrated request's outputs
    hidden = torch.randn(SLICE_ROWS + 5, 8, generator=torch.Generator().manual_seed(0))
    head = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    ids = [i % 40 for i in range(SLICE_ROWS + 5)]
    out = compute_prompt_logprobs(lambda h: h @ head, hidden, ids, 2)
    ref = torch.log_softmax(hidden @ head, dim=-1)
    assert len(out) == len(ids) and out[-1].rank == int((ref[-1] > ref[-1, ids[-1]]).sum()) + 1
    assert abs(out[SLICE_ROWS].logprob - float(ref[SLICE_ROWS, ids[SLICE_ROWS]])) < 1e-5

"""Resuming a migrated request on fresh workers (``WorkerRequest.output_token_ids``).

A request whose decode worker failed after streaming ``k`` tokens is sent again with
those ``k`` tokens as ``output_token_ids``: a prefill worker computes the KV of prompt +
outputs and samples output ``k``, and a decode worker continues from there (or rebuilds
that KV itself under the KV failure policy "recompute"). The continuation must equal
what an uninterrupted run produces from position ``k`` on: greedy, and a seeded sampled
request with repetition / presence / frequency penalties (its generator skips ``k``
draws; the penalties see the earlier tokens as outputs), and one under a structured output
(its grammar replays the earlier tokens). Real model, real prefill and
decode schedulers stepped by hand; no cluster.
"""

from __future__ import annotations

import re

import pytest

from engine.block_pool import blocks_needed
from pdcluster.v1 import common_pb2, worker_pb2
from engine.structured_output import grammar_compiler
from serving.convert import request_from_proto

from sched_helpers import (  # noqa: F401 - fixtures
    BS,
    CPU,
    _collect_tokens,
    _decode_sched,
    _deliver,
    _no_decode_leak,
    _no_leak,
    _prefill_sched,
    _pump,
    _reserve,
    model,
    text_ids,
)

N = 24  # tokens of the uninterrupted run
STEP_TIMEOUT_S = 120.0  # a run takes ~1 s; generous for a machine shared by other test runs
GREEDY = common_pb2.SamplingParams(max_tokens=N, temperature=0.0, top_p=1.0, ignore_eos=True,
                                   repetition_penalty=1.0)
SAMPLED = common_pb2.SamplingParams(max_tokens=N, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                                    ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.6,
                                    frequency_penalty=0.4)


# what may come next depends on the position (letters, then digits), and nothing ends within N tokens
PAIRS = common_pb2.StructuredOutputs(regex="([a-z]{2}[0-9]{2}){100}")
IN_PAIRS = re.compile(r"([a-z]{2}[0-9]{2})*([a-z]{1,2}|[a-z]{2}[0-9])?")


def _wreq(rid: str, prompt: list[int], sampling, outputs: list[int] = (),
          structured: common_pb2.StructuredOutputs | None = None) -> worker_pb2.WorkerRequest:
    return worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                    output_token_ids=list(outputs), structured_outputs=structured)


@pytest.fixture(scope="module")
def grammars(model_config):
    return grammar_compiler(model_config)


def _prefill(model, model_config, wreq, grammars=None):
    """Run ``wreq`` through a real prefill scheduler; returns the KV it would send
    ``[L, 2, blocks, BS, kh, d]`` and its first token."""
    runner, sched = _prefill_sched(model, model_config, budget=32, num_blocks=16, prefix_caching=True)
    req = request_from_proto(wreq, f"xfer-{wreq.request_id}", CPU, grammars=grammars)
    sent = {}

    def send(r, progress) -> int:
        progress.wait_finished(timeout_s=10)
        sent["kv"] = runner.kv_cache[:, :, list(r.block_table)].clone()
        return 0

    fut = sched.submit(req, send)
    _pump(sched, fut.done, timeout=STEP_TIMEOUT_S)
    assert sent["kv"].shape[2] == blocks_needed(len(wreq.prompt_token_ids) + len(wreq.output_token_ids), BS)
    _no_leak(sched)
    sched.shutdown()
    return sent["kv"], fut.result().first_token_id


def _run(model, model_config, wreq, policy: str = "error", grammars=None) -> list[int]:
    """The tokens a decode worker streams for ``wreq``: the KV from a prefill worker, or
    (``policy="recompute"``) rebuilt on the decode worker after its transfer failed."""
    _, sched = _decode_sched(model, model_config, kv_failure_policy=policy, max_num_batched_tokens=32)
    stream, res = _reserve(sched, request_from_proto(wreq, f"xfer-{wreq.request_id}", CPU, grammars=grammars))
    if policy == "recompute":
        sched.submit_fail_transfer(wreq.request_id, res.transfer_id, "prefill worker p0: UNAVAILABLE: Socket closed")
    else:
        kv, first = _prefill(model, model_config, wreq, grammars)
        _deliver(sched, res, kv, first)
    events = _collect_tokens(sched, stream, timeout=STEP_TIMEOUT_S)
    assert events[-1].finish_reason == "length"
    _no_decode_leak(sched)
    return [t for ev in events for t in ev.token_ids]


@pytest.fixture(scope="module")
def references(model, model_config, text_ids):
    prompt = text_ids[:37]
    return {name: (prompt, _run(model, model_config, _wreq(name, prompt, sampling)))
            for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED))}


@pytest.mark.parametrize("name,sampling", [("greedy", GREEDY), ("sampled", SAMPLED)])
@pytest.mark.parametrize("k", [1, 11, N - 1])
def test_resume_through_prefill_equals_the_uninterrupted_run(model, model_config, references, name, sampling, k):
    prompt, ref = references[name]
    assert len(ref) == N
    resumed = _run(model, model_config, _wreq(f"{name}-{k}", prompt, sampling, ref[:k]))
    assert resumed == ref[k:], f"{name} resumed at {k}: {resumed} != {ref[k:]}"


@pytest.mark.parametrize("name,sampling", [("greedy", GREEDY), ("sampled", SAMPLED)])
def test_resume_by_recompute_on_decode_equals_the_uninterrupted_run(model, model_config, references, name,
                                                                    sampling):
    prompt, ref = references[name]
    k = 7
    resumed = _run(model, model_config, _wreq(f"{name}-r{k}", prompt, sampling, ref[:k]), policy="recompute")
    assert resumed == ref[k:]


def test_sampled_reference_uses_its_penalties(model, model_config, references):
    """The seeded reference differs from the same seed without penalties, so the resumed runs
    above check that the penalties see the earlier tokens."""
    prompt, ref = references["sampled"]
    plain = common_pb2.SamplingParams()
    plain.CopyFrom(SAMPLED)
    plain.repetition_penalty, plain.presence_penalty, plain.frequency_penalty = 1.0, 0.0, 0.0
    assert _run(model, model_config, _wreq("plain", prompt, plain)) != ref


@pytest.mark.parametrize("k,policy", [(11, "error"), (7, "recompute")])
def test_a_constrained_request_resumes_in_its_grammar(model, model_config, text_ids, tokenizer, grammars, k, policy):
    """A seeded sampled request under a structured output, resumed after ``k`` tokens (through a
    prefill worker, or rebuilt on decode): the grammar replays the earlier outputs, and the
    continuation equals the uninterrupted run, every token in the grammar's language."""
    prompt = text_ids[:21]
    ref = _run(model, model_config, _wreq("so", prompt, SAMPLED, structured=PAIRS), grammars=grammars)
    assert IN_PAIRS.fullmatch(tokenizer.decode(ref)), tokenizer.decode(ref)
    resumed = _run(model, model_config, _wreq(f"so-{k}", prompt, SAMPLED, ref[:k], PAIRS), policy, grammars)
    assert resumed == ref[k:]


def test_output_token_ids_must_leave_something_to_generate():
    wreq = _wreq("full", [1, 2, 3], GREEDY, [5] * N)
    with pytest.raises(ValueError, match=r"output_token_ids has 24 tokens.*max_tokens \(24\)"):
        request_from_proto(wreq, "x", CPU)

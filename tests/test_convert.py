"""The worker servers' wire <-> engine conversions (:mod:`serving.convert`)."""

from __future__ import annotations

import pytest
import torch

from engine.step import TokenLogprobs
from pdcluster.v1 import common_pb2, worker_pb2
from serving.convert import logprobs_from_dict, logprobs_to_dict, logprobs_to_proto, request_from_proto

CPU = torch.device("cpu")


def test_request_from_proto_maps_every_field():
    sampling = common_pb2.SamplingParams(
        max_tokens=5, temperature=0.5, top_p=0.9, top_k=7, seed=11, stop=["x"], stop_token_ids=[3, 4],
        ignore_eos=True, logprobs=2, min_p=0.25, repetition_penalty=1.5, presence_penalty=-1.0,
        frequency_penalty=0.5, logit_bias={9: 1.0, 2: -3.0})
    msg = worker_pb2.WorkerRequest(request_id="r", prompt_token_ids=[1, 2], sampling=sampling)
    req = request_from_proto(msg, "tid", CPU)
    p, s = req.params, req.params.sampling
    assert (req.request_id, req.prompt_token_ids, req.transfer_id) == ("r", [1, 2], "tid")
    assert (p.max_tokens, p.stop_token_ids, p.ignore_eos) == (5, (3, 4), True)
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.logprobs) == (0.5, pytest.approx(0.9), 7, 11, 2)
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0.25, 1.5, -1.0, 0.5)
    assert s.logit_bias == ((2, -3.0), (9, 1.0))
    expected = torch.Generator().manual_seed(11)
    assert torch.equal(torch.rand(3, generator=req.generator), torch.rand(3, generator=expected))


def test_request_from_proto_unset_fields_take_the_declared_defaults():
    msg = worker_pb2.WorkerRequest(request_id="r", prompt_token_ids=[1],
                                   sampling=common_pb2.SamplingParams(max_tokens=2))
    req = request_from_proto(msg, "", CPU)
    s = req.params.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty, s.seed) == (1.0, 1.0, 1.0, None)
    assert req.generator is None and req.params.stop_token_ids == () and not req.params.ignore_eos


def test_request_from_proto_refuses_out_of_range():
    msg = worker_pb2.WorkerRequest(request_id="r", prompt_token_ids=[1],
                                   sampling=common_pb2.SamplingParams(max_tokens=2, top_p=1.5))
    with pytest.raises(ValueError, match="top_p"):
        request_from_proto(msg, "", CPU)


def test_logprobs_conversions():
    lp = TokenLogprobs(-0.25, [(5, -0.25), (7, -2.0)])
    assert logprobs_from_dict(logprobs_to_dict(lp)) == lp
    assert logprobs_to_dict(None) is None and logprobs_from_dict(None) is None
    msg = logprobs_to_proto(5, lp)
    assert (msg.token_id, msg.logprob) == (5, -0.25)
    assert [(t.token_id, t.logprob) for t in msg.top] == [(5, -0.25), (7, -2.0)]
    assert logprobs_to_proto(3, None) == common_pb2.TokenLogprob(token_id=3)


def test_request_from_proto_guards_the_internal_plane():
    """What the router never sends, a caller with the cluster secret could: refused as INVALID_ARGUMENT
    (a ValueError at the server) before anything reaches a model step."""
    ok = common_pb2.SamplingParams(max_tokens=2)
    cases = [(worker_pb2.WorkerRequest(request_id="", prompt_token_ids=[1], sampling=ok), "request_id is empty"),
             (worker_pb2.WorkerRequest(request_id="r", sampling=ok), "prompt_token_ids is empty"),
             (worker_pb2.WorkerRequest(request_id="r", prompt_token_ids=[1, 100], sampling=ok),
              r"prompt_token_ids\[1\] = 100 is outside the vocabulary \[0, 100\)"),
             (worker_pb2.WorkerRequest(request_id="r", prompt_token_ids=[1], output_token_ids=[4_000_000_000],
                                       sampling=common_pb2.SamplingParams(max_tokens=3)),
              r"output_token_ids\[0\] = 4000000000")]
    for msg, match in cases:
        with pytest.raises(ValueError, match=match):
            request_from_proto(msg, "t", CPU, vocab_size=100)
    assert request_from_proto(cases[2][0], "t", CPU).prompt_token_ids == [1, 100]  # no vocabulary given: unchecked

"""vLLM's ``allowed_token_ids`` in :class:`engine.sampling.Sampler` (step 0 of its order): only the
allowed ids can be sampled, greedy and sampled, whatever the bias; logprobs stay raw; ``min_tokens``
never leaves a row with nothing to sample; other rows of the batch are untouched; and the router
checks the ids against the vocabulary (message naming the field)."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import Sampler, SamplingOptions, make_generator
from pdcluster.client import build_request
from router.limits import Limits
from router.validation import InvalidRequest, RequestValidator
from serving.convert import request_from_proto

VOCAB = 64


def _logits(num_seqs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_seqs, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_greedy_picks_the_best_allowed_id_and_bias_cannot_bring_another_back():
    logits = _logits(3)
    allowed = (5, 9, 40)
    opts = [SamplingOptions(temperature=0.0, allowed_token_ids=allowed),
            SamplingOptions(temperature=0.0, allowed_token_ids=allowed, logit_bias={0: 100.0}),
            SamplingOptions(temperature=0.0)]
    out = Sampler().sample(logits, opts, [None] * 3)
    best = allowed[int(logits[0, list(allowed)].argmax())]
    assert out.token_ids.tolist() == [best, best, int(logits[2].argmax())]


def test_sampled_rows_draw_only_allowed_ids_with_raw_logprobs():
    logits = _logits(1, seed=3)
    opt = SamplingOptions(temperature=1.5, seed=7, allowed_token_ids=[33, 2, 17, 2], logprobs=2)
    assert opt.allowed_token_ids == (2, 17, 33)  # sorted, unique
    g = make_generator(opt.seed, logits.device)
    seen = set()
    for _ in range(200):
        out = Sampler().sample(logits, [opt], [g])
        seen.add(int(out.token_ids[0]))
    assert seen <= {2, 17, 33} and len(seen) > 1
    raw = torch.log_softmax(logits[0], dim=-1)
    assert torch.allclose(out.logprobs[0], raw[out.token_ids[0]])
    assert out.top_ids[0].tolist() == raw.topk(2).indices.tolist()  # the raw distribution's top-2


def test_min_tokens_never_bans_every_allowed_id():
    """Allowed ids that all end the request: the ``min_tokens`` ban is skipped (the request may
    only end) instead of leaving a row of ``-inf``; with one non-stop id allowed, that id wins."""
    logits = _logits(2, seed=5)
    only_stops = SamplingOptions(temperature=0.7, seed=1, allowed_token_ids=(2, 3), min_tokens=4)
    one_more = SamplingOptions(temperature=0.0, allowed_token_ids=(2, 3, 50), min_tokens=4)
    out = Sampler().sample(logits, [only_stops, one_more], [make_generator(1, logits.device), None],
                           histories=[([1], []), ([1], [])], stop_ids=[(2, 3), (2, 3)])
    assert out.token_ids.tolist()[0] in (2, 3) and out.token_ids.tolist()[1] == 50


def test_an_id_past_the_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="allowed token id 64 >= vocab 64"):
        Sampler().sample(_logits(1), [SamplingOptions(allowed_token_ids=(1, 64))], [None])


def test_router_checks_and_workers_receive_the_ids(tokenizer):
    v = RequestValidator(tokenizer, Limits(max_model_len=128, vocab_size=len(tokenizer)))
    prepared = v.prepare(build_request("hi", allowed_token_ids=[7, 3]))
    worker = request_from_proto(prepared.worker_request, "t", torch.device("cpu"))
    assert worker.params.sampling.allowed_token_ids == (3, 7)
    with pytest.raises(InvalidRequest, match=f"sampling.allowed_token_ids: token id {len(tokenizer)} >= vocab_size"):
        v.prepare(build_request("hi", allowed_token_ids=[len(tokenizer)]))
    with pytest.raises(InvalidRequest, match="sampling.allowed_token_ids has 16385 entries; at most 16384"):
        v.prepare(build_request("hi", allowed_token_ids=list(range(16385))))

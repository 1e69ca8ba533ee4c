"""vLLM's ``bad_words``: the ban rule (:func:`engine.bad_words.banned_next`, output tokens only), the
sampler's ban, the router's tokenization (as written and after a space) and, end to end, greedy output
equal to HF float32 greedy under the same rule (``tests/test_e2e_sampling.py``)."""

from __future__ import annotations

import pytest
import torch

from engine.bad_words import banned_next
from engine.sampling import Sampler, SamplingOptions
from pdcluster.client import build_request
from router.limits import Limits
from router.validation import InvalidRequest, RequestValidator
from serving.convert import request_from_proto


def test_a_word_is_banned_where_the_output_ends_with_its_other_tokens():
    words = [(7,), (1, 2, 3), (4, 5)]
    assert banned_next(words, []) == (7,)  # a longer word needs its prefix in the output
    assert banned_next(words, [9, 1, 2]) == (3, 7)
    assert banned_next(words, [1, 2, 4]) == (5, 7)
    assert banned_next(words, [2, 1]) == (7,)


def test_the_sampler_never_picks_a_banned_id_and_other_rows_are_untouched():
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    best = int(logits[0].argmax())
    out = Sampler().sample(logits, [SamplingOptions(temperature=0.0)] * 2, [None, None], banned=[(best,), ()])
    assert int(out.token_ids[0]) != best and int(out.token_ids[1]) == int(logits[1].argmax())
    assert torch.isfinite(logits).all()  # the model's logits are not modified


def test_bans_never_leave_a_row_with_nothing_to_sample():
    """Every allowed id banned: that row samples without its bans (the other row keeps them)."""
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    opts = [SamplingOptions(temperature=0.0, allowed_token_ids=(3,)), SamplingOptions(temperature=0.0)]
    best = int(logits[1].argmax())
    out = Sampler().sample(logits, opts, [None, None], banned=[(3,), (best,)])
    assert out.token_ids.tolist()[0] == 3 and out.token_ids.tolist()[1] != best


def test_the_router_tokenizes_each_word_as_written_and_after_a_space(tokenizer):
    v = RequestValidator(tokenizer, Limits(max_model_len=128, vocab_size=len(tokenizer)))
    prepared = v.prepare(build_request("hi", bad_words=["  dragon", "Paris"]))
    got = [list(s.ids) for s in prepared.worker_request.bad_words_token_ids]
    for word in ("dragon", "Paris"):
        assert tokenizer.encode(word, add_special_tokens=False) in got
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        assert (spaced in got) == (len(spaced) == len(tokenizer.encode(word, add_special_tokens=False)))
    worker = request_from_proto(prepared.worker_request, "t", torch.device("cpu"), len(tokenizer))
    assert worker.bad_words == tuple(tuple(ids) for ids in got)
    with pytest.raises(InvalidRequest, match=r"sampling.bad_words\[1\] is only whitespace"):
        v.prepare(build_request("hi", bad_words=["x", " \n"]))
    with pytest.raises(InvalidRequest, match="sampling.bad_words has 129 entries; at most 128"):
        v.prepare(build_request("hi", bad_words=["x"] * 129))
    prepared.worker_request.bad_words_token_ids.add()  # an empty sequence from a caller of the internal plane
    with pytest.raises(ValueError, match=r"bad_words_token_ids\[\d+\] must be 1 or more token ids"):
        request_from_proto(prepared.worker_request, "t", torch.device("cpu"), len(tokenizer))

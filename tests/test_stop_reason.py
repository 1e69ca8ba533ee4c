"""vLLM's ``stop_reason`` and finish order: the length limit is checked before the stop tokens (a stop
token sampled as the last token allowed ends by length, as vLLM v1's ``check_stop``), and the tokenizer's
EOS ends a request without a ``stop_reason`` even when ``stop_token_ids`` lists it (EOS is checked first
there too), unless the request ignores EOS; ``skip_special_tokens`` false keeps special tokens in the text
but the one that ended the request."""

from __future__ import annotations

import pytest

from common.tokenizer import load_tokenizer
from engine.request import Request, RequestParams
from engine.sampling import SamplingOptions
from engine.stop_check import LENGTH, STOP, check_finish
from pdcluster.v1 import common_pb2, worker_pb2
from router.output import OutputAssembler


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _finish(output: list[int], max_tokens: int, stop_ids=(), eos=(2,)) -> str | None:
    params = RequestParams(max_tokens=max_tokens, sampling=SamplingOptions(temperature=0.0),
                           stop_token_ids=tuple(stop_ids))
    req = Request("r", [1, 1, 1], params)
    req.output_token_ids = list(output)
    return check_finish(req, eos, max_model_len=64)


def test_length_is_checked_before_the_stop_tokens():
    assert _finish([5, 30], max_tokens=2, stop_ids=[30]) == LENGTH
    assert _finish([5, 2], max_tokens=2) == LENGTH  # EOS as the last token allowed, too
    assert _finish([5, 30], max_tokens=3, stop_ids=[30]) == STOP
    assert _finish([5, 2], max_tokens=3) == STOP and _finish([5, 6], max_tokens=3) is None


def _last(tokenizer, stop_ids, ignore_eos: bool, token: int):
    out = OutputAssembler(tokenizer, "r", tokenizer.encode("Say:"), [], stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    return out.add(worker_pb2.TokenDelta(token_ids=[token], finish_reason=common_pb2.FINISH_REASON_STOP))


def test_eos_names_no_stop_reason_unless_eos_is_ignored(tokenizer):
    eos, other = tokenizer.eos_token_id, 30
    assert _last(tokenizer, [eos, other], False, eos).WhichOneof("stop_reason") is None
    assert _last(tokenizer, [eos, other], True, eos).stop_token_id == eos
    assert _last(tokenizer, [eos, other], False, other).stop_token_id == other
    assert _last(tokenizer, [], False, eos).WhichOneof("stop_reason") is None


def _text(tokenizer, deltas, **kwargs) -> str:
    out = OutputAssembler(tokenizer, "r", tokenizer.encode("Say:"), [], **kwargs)
    return "".join(out.add(worker_pb2.TokenDelta(token_ids=ids, finish_reason=reason)).text for ids, reason in deltas)


def test_skip_special_tokens_false_shows_them_but_not_the_token_that_ended_it(tokenizer):
    """vLLM v1: special tokens are text with ``skip_special_tokens`` false; the token that ended the
    request on the worker (EOS, a stop token id) stays out of the text unless ``include_stop``."""
    start, eos = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.eos_token_id
    hi = tokenizer.encode(" hi", add_special_tokens=False)
    deltas = [(hi + [start], common_pb2.FINISH_REASON_UNSPECIFIED), ([eos], common_pb2.FINISH_REASON_STOP)]
    assert _text(tokenizer, deltas) == " hi"
    assert _text(tokenizer, deltas, skip_special_tokens=False) == " hi<|im_start|>"
    assert _text(tokenizer, deltas, skip_special_tokens=False, include_stop=True) == " hi<|im_start|><|im_end|>"
    by_id = [(hi, common_pb2.FINISH_REASON_UNSPECIFIED), (hi, common_pb2.FINISH_REASON_STOP)]  # a stop token id
    assert _text(tokenizer, by_id, stop_token_ids=hi) == " hi"
    assert _text(tokenizer, by_id, stop_token_ids=hi, include_stop=True) == " hi hi"

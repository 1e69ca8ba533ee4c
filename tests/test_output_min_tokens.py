"""The router's output assembler under vLLM's ``min_tokens``: a stop string ends generation only
where it ends in the text of a token after the first ``min_tokens`` (it may begin earlier, in their
text), whichever way the tokens are split into deltas (vLLM's detokenizer, PR 22014)."""

from __future__ import annotations

import pytest

from common.tokenizer import load_tokenizer
from pdcluster.v1 import common_pb2, worker_pb2
from router.output import OutputAssembler


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _run(tokenizer, words: list[str], split: int, **kwargs) -> tuple[str, int]:
    """``words`` (one token each) in deltas of ``split`` tokens; returns the text and the finish reason."""
    ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    assert tokenizer.decode(ids) == "".join(words)
    out = OutputAssembler(tokenizer, "r", tokenizer.encode("Say:"), **kwargs)
    text = []
    for i in range(0, len(ids), split):
        last = i + split >= len(ids)
        delta = worker_pb2.TokenDelta(token_ids=ids[i:i + split], finish_reason=common_pb2.FINISH_REASON_LENGTH
                                      if last else common_pb2.FINISH_REASON_UNSPECIFIED)
        text.append(out.add(delta).text)
        if out.finished:
            break
    assert "".join(text) == out.whole().text
    return out.whole().text, out.finish_reason


WORDS = ["a", " b", " c", " b", " d", " c", " d"]


@pytest.mark.parametrize("split", [1, 2, 3, len(WORDS)])
def test_a_stop_string_within_the_first_min_tokens_is_text(tokenizer, split):
    assert _run(tokenizer, WORDS, split, stop=[" b"], min_tokens=0) == ("a", common_pb2.FINISH_REASON_STOP)
    # the 2nd token's " b" is text (2 tokens do not exceed min_tokens=2), the 4th's ends it
    assert _run(tokenizer, WORDS, split, stop=[" b"], min_tokens=2) == ("a b c", common_pb2.FINISH_REASON_STOP)
    assert _run(tokenizer, WORDS, split, stop=[" b"], min_tokens=4) == ("a b c b d c d",
                                                                         common_pb2.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("split", [1, 2, 3, len(WORDS)])
def test_a_stop_string_may_begin_in_the_first_min_tokens(tokenizer, split):
    # " c d" begins in the 3rd token's text (one of the first 3) and ends in the 5th's
    assert _run(tokenizer, WORDS, split, stop=[" b d"], min_tokens=3) == ("a b c", common_pb2.FINISH_REASON_STOP)
    assert _run(tokenizer, WORDS, split, stop=[" c b"], min_tokens=3) == ("a b", common_pb2.FINISH_REASON_STOP)
    # ends in the 4th token's text: the first 4 cannot end it, the next occurrence does
    assert _run(tokenizer, WORDS, split, stop=[" c b"], min_tokens=4) == ("a b c b d c d",
                                                                           common_pb2.FINISH_REASON_LENGTH)
    assert _run(tokenizer, WORDS, split, stop=[" d c"], min_tokens=4, include_stop=True) == (
        "a b c b d c", common_pb2.FINISH_REASON_STOP)

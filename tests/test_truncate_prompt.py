"""vLLM's ``truncate_prompt_tokens`` in the router's validator: the prompt's last k tokens are kept
(text, token ids and rendered chats alike) before the length checks; ``-1`` keeps what leaves room for
``max_tokens``; 0, below -1 and ``> max_model_len`` are refused naming the field (as vLLM); workers never
see it; a text prompt over ``max_prompt_bytes`` is still refused before tokenization."""

from __future__ import annotations

import pytest

from pdcluster.client import build_request
from router.limits import Limits
from router.validation import InvalidRequest, RequestValidator

MAX_MODEL_LEN = 64
LONG = " ".join(f"word{i}" for i in range(200))


@pytest.fixture(scope="module")
def validator(tokenizer):
    return RequestValidator(tokenizer, Limits(max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer)))


def test_the_last_k_tokens_are_kept(validator, tokenizer):
    ids = tokenizer.encode(LONG)
    assert len(ids) > MAX_MODEL_LEN
    text = validator.prepare(build_request(LONG, truncate_prompt_tokens=20, max_tokens=4))
    assert text.prompt_token_ids == ids[-20:] and list(text.worker_request.prompt_token_ids) == ids[-20:]
    assert not text.worker_request.sampling.HasField("truncate_prompt_tokens")  # the router's alone
    tokens = validator.prepare(build_request(ids, truncate_prompt_tokens=20, max_tokens=4))
    assert tokens.prompt_token_ids == ids[-20:]
    short = validator.prepare(build_request("hello", truncate_prompt_tokens=20))
    assert short.prompt_token_ids == tokenizer.encode("hello")  # shorter prompts are kept whole
    chat = validator.prepare(build_request([{"role": "user", "content": LONG}], truncate_prompt_tokens=30))
    assert len(chat.prompt_token_ids) == 30 and chat.worker_request.sampling.max_tokens == MAX_MODEL_LEN - 30


def test_minus_one_leaves_room_for_max_tokens(validator, tokenizer):
    ids = tokenizer.encode(LONG)
    fit = validator.prepare(build_request(LONG, truncate_prompt_tokens=-1, max_tokens=10))
    assert fit.prompt_token_ids == ids[-(MAX_MODEL_LEN - 10):] and fit.worker_request.sampling.max_tokens == 10
    unset = validator.prepare(build_request(LONG, truncate_prompt_tokens=-1))
    assert len(unset.prompt_token_ids) == MAX_MODEL_LEN - 1 and unset.worker_request.sampling.max_tokens == 1


@pytest.mark.parametrize(("k", "needle"), [
    (0, "sampling.truncate_prompt_tokens must be >= 1 or -1, got 0"),
    (-2, "sampling.truncate_prompt_tokens must be >= 1 or -1, got -2"),
    (MAX_MODEL_LEN + 1, f"sampling.truncate_prompt_tokens ({MAX_MODEL_LEN + 1}) must be <= max_model_len"),
    (MAX_MODEL_LEN, "prompt has 64 tokens; max_model_len is 64"),  # allowed, as vLLM; the prompt is too long
])
def test_bad_values_are_refused_naming_the_field(validator, k, needle):
    with pytest.raises(InvalidRequest) as e:
        validator.prepare(build_request(LONG, truncate_prompt_tokens=k))
    assert str(e.value).startswith(needle), str(e.value)


def test_a_short_prompt_under_k_equal_to_max_model_len_is_served(validator, tokenizer):
    assert validator.prepare(build_request("Hi", truncate_prompt_tokens=MAX_MODEL_LEN)).prompt_token_ids == \
        tokenizer.encode("Hi")


def test_without_it_a_long_prompt_is_still_refused(validator):
    with pytest.raises(InvalidRequest, match="prompt has .* tokens; max_model_len is 64"):
        validator.prepare(build_request(LONG))
    with pytest.raises(InvalidRequest, match="sampling.max_tokens \\(30\\) \\+ prompt \\(40 tokens\\)"):
        validator.prepare(build_request(LONG, truncate_prompt_tokens=40, max_tokens=30))

"""vLLM's chat options (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``):
rendered as HF's ``apply_chat_template`` renders them, checked by the router's validator on the gRPC
``MessageList``, and served on ``/tokenize`` and ``/v1/chat/completions`` (the served model's real
tokenizer; no cluster: the refusals come before any worker, and ``/tokenize`` runs no request)."""

from __future__ import annotations

import copy
import json
import re
import types

import pytest
from fastapi.testclient import TestClient

from pdcluster.v1 import common_pb2, router_pb2
from router.chat import ChatOptions, render_chat
from router.limits import Limits
from router.openai.app import FrontDoorState, build_app
from router.validation import InvalidRequest, RequestValidator

ANSWER_START = [{"role": "user", "content": "Name three rivers."},
                {"role": "assistant", "content": "The three rivers are"}]
SHOUT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper if shout else m['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def _hf(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def shouting(tokenizer):
    """The served tokenizer with a template that reads a variable of its own (``shout``)."""
    t = copy.deepcopy(tokenizer)
    t.chat_template = SHOUT_TEMPLATE
    return t


def test_options_render_as_hf_does(tokenizer, shouting):
    assert render_chat(tokenizer, ANSWER_START[:1], ChatOptions(add_generation_prompt=False)) == \
        _hf(tokenizer, ANSWER_START[:1], add_generation_prompt=False)
    continuing = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    continued = render_chat(tokenizer, ANSWER_START, continuing)
    assert continued == _hf(tokenizer, ANSWER_START, continue_final_message=True)
    assert tokenizer.decode(continued).endswith("The three rivers are")  # left open: no end of turn
    assert render_chat(tokenizer, ANSWER_START) != continued
    loud = render_chat(shouting, ANSWER_START[:1], ChatOptions(template_kwargs={"shout": True}))
    assert loud == _hf(shouting, ANSWER_START[:1], add_generation_prompt=True, shout=True)
    assert "NAME THREE RIVERS." in shouting.decode(loud)


def test_a_continued_message_holding_a_control_string_stays_text(tokenizer):
    """The marked path (a content holding a special token's string) continues the final message too."""
    messages = [ANSWER_START[0], {"role": "assistant", "content": "It ends with <|im_end|> and"}]
    ids = render_chat(tokenizer, messages, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    tail = tokenizer.encode(messages[1]["content"], add_special_tokens=False, split_special_tokens=True)
    assert ids[-len(tail):] == tail
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids[-len(tail):]


def test_both_flags_true_is_refused():
    with pytest.raises(ValueError, match="cannot both be true"):
        ChatOptions(add_generation_prompt=True, continue_final_message=True)


def _validator(tokenizer, max_prompt_bytes=4000) -> RequestValidator:
    return RequestValidator(tokenizer, Limits(max_model_len=512, vocab_size=len(tokenizer),
                                              max_prompt_bytes=max_prompt_bytes))


def _chat(messages=ANSWER_START, **options) -> router_pb2.GenerateRequest:
    chat = router_pb2.MessageList(messages=[common_pb2.ChatMessage(**m) for m in messages], **options)
    return router_pb2.GenerateRequest(messages=chat)


def test_the_validator_reads_the_options_from_the_wire(tokenizer, shouting):
    v = _validator(tokenizer)
    assert v.tokenize(_chat()) == render_chat(tokenizer, ANSWER_START)  # unset: generation prompt added
    assert v.tokenize(_chat(add_generation_prompt=False)) == _hf(tokenizer, ANSWER_START, add_generation_prompt=False)
    continued = _hf(tokenizer, ANSWER_START, continue_final_message=True)
    assert v.tokenize(_chat(add_generation_prompt=False, continue_final_message=True)) == continued
    # as in vLLM, the flags may also come inside chat_template_kwargs, and override the fields
    inside = json.dumps({"add_generation_prompt": False, "continue_final_message": True})
    assert v.tokenize(_chat(chat_template_kwargs=inside)) == continued
    loud = _validator(shouting).tokenize(_chat(ANSWER_START[:1], chat_template_kwargs='{"shout": true}'))
    assert "NAME THREE RIVERS." in shouting.decode(loud)
    prepared = v.prepare(_chat(add_generation_prompt=False, continue_final_message=True))
    assert prepared.prompt_token_ids == continued
    assert prepared.worker_request.sampling.max_tokens == 512 - len(continued)


@pytest.mark.parametrize(("options", "needle"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    ({"continue_final_message": True}, "cannot both be true"),  # unset add_generation_prompt is true
    ({"chat_template_kwargs": "{"}, "chat_template_kwargs is not valid JSON"),
    ({"chat_template_kwargs": "[1]"}, "chat_template_kwargs must be a JSON object, got list"),
    ({"chat_template_kwargs": '{"tokenize": true}'}, "chat_template_kwargs.tokenize: an argument of the chat"),
    ({"chat_template_kwargs": '{"messages": []}'}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": '{"chat_template": "x"}'}, "chat_template_kwargs.chat_template"),
    ({"chat_template_kwargs": '{"add_generation_prompt": 1}'}, "add_generation_prompt must be a boolean, got int"),
    ({"chat_template_kwargs": '{"a": ' + "[" * 500 + "]" * 500 + "}"}, "nests deeper than 16 levels"),
    ({"chat_template_kwargs": '{"date_string": ["x<|im_start|>system"]}'}, "holds a control token of the model"),
    ({"chat_template_kwargs": '{"b": "' + "é" * 3000 + '"}'}, "chat_template_kwargs (with the messages) is 6060 "
                                                              "bytes; max_prompt_bytes is 4000"),
    ({"chat_template_kwargs": "[" * 100000 + "]" * 100000}, "max_prompt_bytes"),
])
def test_the_validator_refuses_bad_options_naming_them(tokenizer, options, needle):
    with pytest.raises(InvalidRequest, match=re.escape(needle)):
        _validator(tokenizer, max_prompt_bytes=300_000 if "max_prompt" not in needle else 4000).prepare(
            _chat(**options))


def test_deep_json_and_a_template_that_cannot_continue_are_refused(tokenizer, shouting):
    v = _validator(tokenizer, max_prompt_bytes=300_000)
    with pytest.raises(InvalidRequest, match="chat_template_kwargs"):
        v.prepare(_chat(chat_template_kwargs="[" * 100000 + "]" * 100000))
    blank = copy.deepcopy(tokenizer)
    blank.chat_template = "{% for m in messages %}{{ m['role'] }}\n{% endfor %}"  # writes no content
    with pytest.raises(InvalidRequest, match="chat template refused them"):
        _validator(blank).prepare(_chat(add_generation_prompt=False, continue_final_message=True))


@pytest.fixture(scope="module")
def http(tokenizer):
    validator = _validator(tokenizer)
    state = FrontDoorState(core=types.SimpleNamespace(validator=validator, admission=None), model_name="m",
                           tokenizer=tokenizer, health=lambda: (True, ""), targets=list, metrics_registry=None,
                           accepts_api_key=lambda key: True, max_model_len=512)
    return TestClient(build_app(state), raise_server_exceptions=False)


def test_tokenize_takes_the_chat_options(http, tokenizer):
    body = {"messages": ANSWER_START, "add_generation_prompt": False, "continue_final_message": True}
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == _hf(tokenizer, ANSWER_START, continue_final_message=True)
    r = http.post("/tokenize", json={"messages": ANSWER_START, "chat_template_kwargs": {"unused_by_template": [1, 2]}})
    assert r.json()["tokens"] == render_chat(tokenizer, ANSWER_START)


SHAPES = [({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "chat_template_kwargs"),
          ({"add_generation_prompt": "no"}, "add_generation_prompt", "add_generation_prompt")]
CHECKS = [({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
          ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "an argument of the chat template")]


@pytest.mark.parametrize(("path", "extra", "param", "needle"),
                         [("/tokenize", *case) for case in SHAPES + CHECKS]
                         + [("/v1/chat/completions", *case) for case in SHAPES])  # CHECKS: test_e2e_sampling
def test_bad_chat_options_get_400_naming_the_field(http, path, extra, param, needle):
    r = http.post(path, json={"model": "m", "messages": ANSWER_START, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error

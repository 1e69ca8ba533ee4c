"""Request limits and clean refusals without a cluster: the router's validator (prompt bytes
before tokenization, chat count / roles / size, request id, token ids) and the HTTP front door
(413 over ``max_request_bytes``, 400 for strings protobuf cannot carry, token ids out of range,
too many choices); the gRPC front door's are in ``test_grpc_refusals.py``."""

from __future__ import annotations

import re
import types

import grpc
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError

from pdcluster.client import build_request
from pdcluster.v1 import router_pb2
from router.errors import RouterError
from router.limits import CHAT_ROLES, MAX_CHAT_MESSAGES, MAX_CHOICES, MAX_REQUEST_ID_CHARS, Limits
from router.openai.app import FrontDoorState, build_app
from router.validation import InvalidRequest, RequestValidator, prompt_byte_cap

from test_grpc_refusals import FakeCore


class NoTokenizer:
    """Fails the test if anything is tokenized."""

    def encode(self, *a, **k):
        raise AssertionError("tokenized a prompt that should have been refused first")

    apply_chat_template = encode


def _refused(validator: RequestValidator, prompt, message: str, **kwargs) -> None:
    with pytest.raises(InvalidRequest, match=f"^{re.escape(message)}"):
        validator.prepare(build_request(prompt, **kwargs))


# ---- the validator ------------------------------------------------------------------------------------------


def test_prompt_bytes_are_refused_before_tokenization():
    v = RequestValidator(NoTokenizer(), Limits(max_model_len=64, vocab_size=1000, max_prompt_bytes=100))
    _refused(v, "é" * 51, "prompt: text is 102 bytes; max_prompt_bytes is 100 (checked before tokenization)")
    chat = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "y" * 55}]
    _refused(v, chat, "messages is 105 bytes; max_prompt_bytes is 100")


def test_chat_count_and_roles():
    v = RequestValidator(NoTokenizer(), Limits(max_model_len=64, vocab_size=1000))
    _refused(v, [{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1), "messages has 257 entries; at most 256")
    _refused(v, [{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}],
             "messages[1].role 'robot' is not a chat role; one of system, user, assistant, tool, developer")
    _refused(v, [{"role": "", "content": "x"}], "messages[0].role '' is not a chat role")
    empty = router_pb2.GenerateRequest(messages=router_pb2.MessageList())
    with pytest.raises(InvalidRequest, match="messages is empty"):
        v.prepare(empty)


def test_every_chat_role_renders_with_the_model_template(tokenizer):
    v = RequestValidator(tokenizer, Limits(max_model_len=512, vocab_size=len(tokenizer)))
    chat = [{"role": role, "content": f"a {role} message"} for role in CHAT_ROLES]
    assert len(v.prepare(build_request(chat)).prompt_token_ids) > 10


def test_a_chat_too_long_names_messages(tokenizer):
    """A chat has no ``prompt`` field: its length refusal names ``messages`` (and so does the HTTP
    error's ``param``; helper finding)."""
    from router.openai.errors import router_error_response
    v = RequestValidator(tokenizer, Limits(max_model_len=32, vocab_size=len(tokenizer)))
    with pytest.raises(InvalidRequest, match=r"^messages: the rendered chat has \d+ tokens; max_model_len is 32") as e:
        v.prepare(build_request([{"role": "user", "content": "hello " * 40}]))
    body = router_error_response(RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e.value)), body_only=True)
    assert body["error"]["param"] == "messages"


def test_a_template_refusal_is_an_invalid_request():
    def refuse(*a, **k):
        raise TemplateError("Conversation roles must alternate user/assistant")

    tok = types.SimpleNamespace(apply_chat_template=refuse, chat_template="{{ messages }}")
    v = RequestValidator(tok, Limits(max_model_len=64, vocab_size=1000))
    _refused(v, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
             "messages: the model's chat template refused them: 'Conversation roles must alternate")


def test_a_model_without_a_chat_template_refuses_chats():
    """A base model (Gemma 3 270M's GGUF) has no template: HF raises a ValueError, which reached the
    client as a 500 / UNKNOWN (helper finding); it is a refusal naming what to send instead."""
    bare = types.SimpleNamespace(chat_template=None, apply_chat_template=NoTokenizer().encode)
    v = RequestValidator(bare, Limits(max_model_len=64, vocab_size=1000))
    _refused(v, [{"role": "user", "content": "hi"}], "messages: this model has no chat template, so it serves no chat")


def test_request_id_and_token_ids():
    v = RequestValidator(NoTokenizer(), Limits(max_model_len=64, vocab_size=1000))
    _refused(v, [1], "request_id must be at most 256 printable ASCII characters: character 3 ('é') is not one "
             "(got 'café\\n')",
             request_id="café\n")
    _refused(v, [1], "request_id must be at most 256 printable ASCII characters: it has 257 (got 'xxx",
             request_id="x" * (MAX_REQUEST_ID_CHARS + 1))
    assert v.prepare(build_request([1], request_id="~" * MAX_REQUEST_ID_CHARS)).request_id == "~" * 256
    _refused(v, [5] * 1_000_000, "prompt has 1000000 tokens; max_model_len is 64")
    _refused(v, [5, 1000], "prompt: token_ids: id 1000 >= vocab_size 1000")
    with pytest.raises(InvalidRequest, match="^prompt: token_ids is empty$"):
        v.prepare(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(exclude_categories=("Cc", "Cs"), include_characters="\n\t"), min_size=1,
                   max_size=400))
def test_the_byte_cap_never_refuses_a_prompt_that_fits(tokenizer, text):
    """``prompt_byte_cap``: a text of more bytes than ``tokens x longest token`` cannot exist
    (control characters aside: the vocabulary drops a few, so a text of them shrinks)."""
    tokens = len(tokenizer.encode(text, add_special_tokens=True))
    assert len(text.encode()) <= prompt_byte_cap(tokenizer, tokens)


# ---- the HTTP front door ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http():
    state = FrontDoorState(core=FakeCore(), model_name="m", tokenizer=None, health=lambda: (True, ""),
                           targets=list, metrics_registry=None, accepts_api_key=lambda key: True,
                           max_request_bytes=2000)
    return TestClient(build_app(state), raise_server_exceptions=False)


def _post(http, body: bytes, path: str = "/v1/completions"):
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    return r.status_code, r.json() if r.headers.get("content-type") == "application/json" else r.text


def test_http_bodies_over_max_request_bytes_are_413(http):
    body = b'{"model": "m", "prompt": "' + b"a" * 2000 + b'"}'
    status, answer = _post(http, body)  # Content-Length over the limit: refused before it is read
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer  # OpenAI's error shape

    def chunks():
        yield from (body[i:i + 100] for i in range(0, len(body), 100))

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_request_bytes (2000 bytes)" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "path", "param", "needle"), [
    (b'{"model": "m", "prompt": "\\ud800"}', "/v1/completions", "prompt", "prompt is not valid Unicode"),
    (b'{"model": "m", "prompt": ["a", "b\\udfff"]}', "/v1/completions", "prompt", "prompt[1] is not valid Unicode"),
    (b'{"model": "m", "prompt": [1, 4294967296]}', "/v1/completions", "prompt", "token id 4294967296 is out of range"),
    (b'{"model": "m", "prompt": [[1], [-1]]}', "/v1/completions", "prompt",
     "prompt[1]: token id -1 is out of range: token ids are >= 0 and below the model's vocabulary size"),
    (b'{"model": "m", "prompt": [[1], []]}', "/v1/completions", "prompt", "prompt[1] is an empty list of token ids"),
    (b'{"model": "m", "prompt": "a", "stop": ["\\ud800"]}', "/v1/completions", "stop", "surrogates not allowed"),
    (b'{"model": "m", "prompt": "a", "n": 17}', "/v1/completions", "n", "n must be in [1, 16], got 17"),
    (b'{"model": "m", "prompt": [' + b'"a", ' * 16 + b'"a"], "n": 16}', "/v1/completions", "n",
     f"17 prompts x n 16 = 272 choices; at most {MAX_CHOICES} per request"),
    (b'{"model": "m", "messages": [{"role": "\\ud800", "content": "x"}]}', "/v1/chat/completions",
     "messages[0].role", "messages[0].role is not valid Unicode"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "/v1/chat/completions", "messages[0].content", "messages[0].content is not valid Unicode"),
    (b'{"model": "m", "prompt": "\xff"}', "/v1/completions", None, "not valid UTF-8"),
])
def test_http_refuses_what_protobuf_cannot_carry(http, body, path, param, needle):
    status, answer = _post(http, body, path)
    assert status == 400, answer
    assert needle in answer["error"]["message"] and answer["error"]["param"] == param


@pytest.mark.parametrize(("body", "message"), [
    (b"", "the request body is empty: send a JSON object"),
    (b"[1, 2]", "the request body must be a JSON object, got an array"),
    (b'"hi"', "the request body must be a JSON object, got a string"),
    (b"3", "the request body must be a JSON object, got a number"),
    (b"null", "the request body must be a JSON object, got null"),
])
def test_a_json_body_that_is_no_object_is_named_as_such(http, body, message):
    """Helper finding: these answered pydantic's ``body: Field required`` / ``body: Input should be a
    valid dictionary ...``."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, answer = _post(http, body, path)
        assert status == 400 and answer["error"]["message"] == message and answer["error"]["param"] is None, answer


def test_http_error_bodies_render_lone_surrogates(http):
    status, answer = _post(http, b'{"model": "\\ud800", "prompt": "a"}')
    assert status == 404 and "'\\ud800'" in answer["error"]["message"]
    status, answer = _post(http, b'{"model": "m", "prompt": "a", "logit_bias": {"\\ud800": "x"}}')
    assert status == 400 and answer["error"]["param"].startswith('logit_bias["'), answer  # the key, quoted


@pytest.mark.parametrize(("fields", "path", "param"), [
    ('"messages": [{"role": "user", "content": "x"}], "echo": true', "/v1/chat/completions", "echo"),
    ('"prompt": "a", "suffix": "b"', "/v1/completions", "suffix"),
    ('"prompt": "a", "best_of": 3', "/v1/completions", "best_of"),
    ('"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]', "/v1/completions", "tools"),
    ('"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]', "/v1/chat/completions",
     "functions"),  # OpenAI's deprecated form of tools
    ('"messages": [{"role": "user", "content": "x"}], "guided_decoding_backend": "xgrammar"',
     "/v1/chat/completions", "guided_decoding_backend"),
    ('"prompt": "a", "guided_choice": ["yes", "no"]', "/v1/completions", "guided_choice"),
    ('"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"', "/v1/chat/completions",
     "chat_template"),
])
def test_http_refuses_openai_and_vllm_fields_it_does_not_serve(http, fields, path, param):
    status, answer = _post(http, f'{{"model": "m", {fields}}}'.encode(), path)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["code"] == "unsupported_parameter", answer


@pytest.mark.parametrize(("fields", "param", "message"), [
    ('"include_stop_str_in_output": "yes"', "include_stop_str_in_output",
     "include_stop_str_in_output must be a boolean, got 'yes'"),
    ('"include_stop_str_in_output": 1', "include_stop_str_in_output",
     "include_stop_str_in_output must be a boolean, got 1"),
    ('"min_tokens": true', "min_tokens", "min_tokens must be an integer, got True"),
    ('"min_tokens": -1', "min_tokens", "min_tokens must be >= 0, got -1"),
    ('"stop_token_ids": [5, -3]', "stop_token_ids", "stop_token_ids[1] must be >= 0, got -3"),
    ('"max_tokens": 1000000000000', "max_tokens", "max_tokens must be <= 4294967295, got 1000000000000"),
    ('"skip_special_tokens": "yes"', "skip_special_tokens", "skip_special_tokens must be a boolean, got 'yes'"),
    ('"skip_special_tokens": 1', "skip_special_tokens", "skip_special_tokens must be a boolean, got 1"),
    ('"use_beam_search": 0', "use_beam_search", "use_beam_search must be a boolean, got int"),
    ('"seed": -9223372036854775809', "seed",
     "seed must be in [-9223372036854775808, 18446744073709551615], got -9223372036854775809"),
    ('"seed": 18446744073709551616', "seed",  # the same range both ways (it named [0, ...] above it)
     "seed must be in [-9223372036854775808, 18446744073709551615], got 18446744073709551616"),
    ('"logit_bias": {" 5 ": 1.0}', "logit_bias", "logit_bias: key ' 5 ' is not a token id (decimal digits)"),
    ('"logit_bias": {"\u0665": 1.0}', "logit_bias", "logit_bias: key '\u0665' is not a token id (decimal digits)"),
    ('"logit_bias": {"-5": 1.0}', "logit_bias", "logit_bias: key '-5' is not a token id (decimal digits)"),
])
def test_http_fields_are_typed_strictly_and_named_with_their_limit(http, fields, param, message):
    """vLLM's extra fields as strictly as the declared ones (``1`` is no boolean), and an integer
    beyond its wire field named with the limit, not with protobuf's words."""
    status, answer = _post(http, f'{{"model": "m", "prompt": "a", {fields}}}'.encode())
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["message"] == message


def test_a_negative_seed_is_taken_as_vllm_takes_it():
    """vLLM takes any int64 seed: a negative one is the same bits as the wire's uint64 (distinct
    seeds stay distinct); below int64 it is refused."""
    core = FakeCore()
    state = FrontDoorState(core=core, model_name="m", tokenizer=None, health=lambda: (True, ""), targets=list,
                           metrics_registry=None, accepts_api_key=lambda key: True)
    client = TestClient(build_app(state), raise_server_exceptions=False)
    for seed, wire in ((-1, (1 << 64) - 1), (-(1 << 63), 1 << 63), (5, 5)):
        _post(client, f'{{"model": "m", "prompt": "a", "seed": {seed}}}'.encode())  # what the core got
        assert core.seen[-1].sampling.seed == wire
    status, answer = _post(client, f'{{"model": "m", "prompt": "a", "seed": {-(1 << 63) - 1}}}'.encode())
    assert status == 400 and answer["error"]["param"] == "seed"


def test_neutral_values_of_unserved_openai_fields_pass():
    from router.openai.protocol import ChatCompletionRequest, CompletionRequest
    from router.openai.requests import refuse_unsupported

    refuse_unsupported(CompletionRequest(model="m", prompt="a", echo=False, best_of=1, suffix=None))
    refuse_unsupported(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                             tool_choice="none", tools=[], response_format={"type": "text"},
                                             use_beam_search=False, bad_words=[]))


def test_an_unset_max_tokens_is_16_for_text_and_the_rest_of_the_context_for_a_chat(tokenizer):
    """OpenAI's completions default 16; its chat default (and vLLM's) is all the context leaves."""
    v = RequestValidator(tokenizer, Limits(max_model_len=512, vocab_size=len(tokenizer)))
    text = v.prepare(build_request("Once upon a time"))
    assert text.worker_request.sampling.max_tokens == 16
    chat = v.prepare(build_request([{"role": "user", "content": "Tell me a story."}]))
    assert chat.worker_request.sampling.max_tokens == 512 - len(chat.prompt_token_ids)
    assert v.prepare(build_request([{"role": "user", "content": "Hi"}], max_tokens=7)).worker_request.sampling \
        .max_tokens == 7


def test_every_http_request_is_counted_by_route_and_status():
    """``http_requests_total``: the outermost layer counts what the inner ones answer too (413 before
    any route runs); unknown paths and methods share one ``other`` series; the HTTP layer's own refusals of a
    generation request count in ``request_errors`` as the request path's do."""
    from serving.metrics import ProcessMetrics

    metrics = ProcessMetrics("router", "router-0", "m")
    state = FrontDoorState(core=FakeCore(), model_name="m", tokenizer=None, health=lambda: (True, ""),
                           targets=list, metrics_registry=None, accepts_api_key=lambda key: True,
                           max_request_bytes=2000, metrics=metrics)
    client = TestClient(build_app(state), raise_server_exceptions=False)
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models/m").status_code == 200 and client.get("/v1/models/x").status_code == 404
    for path in ("/nope", "/admin/../x"):
        assert client.get(path).status_code == 404
    assert _post(client, b'{"model": "m", "prompt": "a", "max_tokens": "3"}')[0] == 400
    assert _post(client, b'{"model": "x", "prompt": "a"}')[0] == 404
    assert _post(client, b"x" * 3000)[0] == 413
    for method in ("XYZZY-1", "XYZZY-2"):  # any token parses as a method: one ``other`` series
        client.request(method, "/health")
    assert client.delete("/v1/completions").status_code == 405

    def count(**labels) -> float:
        return metrics.get("http_requests", **labels)._value.get()
    assert count(method="GET", handler="/health", status="200") == 1
    assert count(method="GET", handler="/v1/models/{model}", status="200") == 1
    assert count(method="GET", handler="/v1/models/{model}", status="404") == 1
    assert count(method="GET", handler="other", status="404") == 2
    assert count(method="POST", handler="/v1/completions", status="400") == 1
    assert count(method="POST", handler="/v1/completions", status="404") == 1
    assert count(method="POST", handler="/v1/completions", status="413") == 1
    assert count(method="other", handler="/health", status="405") == 2
    assert count(method="DELETE", handler="/v1/completions", status="405") == 1
    assert metrics.get("request_errors", code="INVALID_ARGUMENT")._value.get() == 1
    assert metrics.get("request_errors", code="NOT_FOUND")._value.get() == 1

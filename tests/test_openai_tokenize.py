"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version`` on the router's HTTP port, with the served
model's real tokenizer and the router's own validator (no cluster: these routes run no request):
the ids are the ones a completion or chat request is prefilled with; errors in OpenAI's shape."""

from __future__ import annotations

import types

import pytest
from fastapi.testclient import TestClient

from router.chat import render_chat
from router.limits import Limits
from router.openai.app import FrontDoorState, build_app
from router.validation import RequestValidator

MODEL = "m"


@pytest.fixture(scope="module")
def http(tokenizer):
    validator = RequestValidator(tokenizer, Limits(max_model_len=64, vocab_size=len(tokenizer), max_prompt_bytes=4000))
    state = FrontDoorState(core=types.SimpleNamespace(validator=validator, admission=None), model_name=MODEL,
                           tokenizer=tokenizer, health=lambda: (True, ""), targets=list, metrics_registry=None,
                           accepts_api_key=lambda key: True, max_model_len=64)
    return TestClient(build_app(state), raise_server_exceptions=False)


def test_tokenize_a_prompt_as_completions_do(http, tokenizer):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    bare = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False) and bare["token_strs"] is None
    assert http.post("/tokenize", json={"model": "", "prompt": "Hello world"}).json()["tokens"] == ids  # "": served
    long = http.post("/tokenize", json={"prompt": "word " * 100}).json()  # counted, not refused
    assert long["count"] > 64


def test_tokenize_messages_as_chat_does(http, tokenizer):
    messages = [{"role": "user", "content": "Name three rivers."}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == render_chat(tokenizer, messages)


@pytest.mark.parametrize(("body", "status", "param", "needle"), [
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt", "exactly one of prompt"),
    ({}, 400, "prompt", "exactly one of prompt"),
    ({"prompt": ""}, 400, "prompt", "prompt: text is empty"),
    ({"prompt": "a" * 4001}, 400, "prompt", "max_prompt_bytes is 4000"),
    ({"messages": [{"role": "wizard", "content": "b"}]}, 400, "messages[0].role", "is not a chat role"),
    ({"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True}, 400, "add_special_tokens",
     "not supported with messages"),
    ({"messages": [{"role": "user", "content": "b"}], "chat_template": "x"}, 400, "chat_template",
     "not supported"),
    ({"model": "other", "prompt": "a"}, 404, "model", "does not exist"),
    ({"prompt": 3}, 400, "prompt", "prompt"),
])
def test_tokenize_refusals_name_the_field(http, body, status, param, needle):
    r = http.post("/tokenize", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_detokenize_and_version(http, tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    r = http.post("/detokenize", json={"tokens": [1, len(tokenizer)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert f"tokens[1]: id {len(tokenizer)} is not in [0, {len(tokenizer)})" in r.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    long = http.post("/detokenize", json={"tokens": [1] * 65})
    assert long.status_code == 400 and "at most max_model_len (64)" in long.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": ["a"]}).status_code == 400
    v = http.get("/version")
    assert v.status_code == 200 and isinstance(v.json()["version"], str) and v.json()["version"]


def _app(tokenizer, origins):
    validator = RequestValidator(tokenizer, Limits(max_model_len=64, vocab_size=len(tokenizer)))
    state = FrontDoorState(core=types.SimpleNamespace(validator=validator, admission=None), model_name=MODEL,
                           tokenizer=tokenizer, health=lambda: (True, ""), targets=list, metrics_registry=None,
                           accepts_api_key=lambda key: key == "sk-1", max_model_len=64, allowed_origins=origins)
    return TestClient(build_app(state), raise_server_exceptions=False)


def test_cors_is_off_by_default_and_allowed_origins_pass_preflights_without_a_key(tokenizer):
    preflight = {"origin": "https://ui.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    off = _app(tokenizer, ())
    r = off.options("/tokenize", headers=preflight)
    assert r.status_code == 401 and "access-control-allow-origin" not in r.headers  # no CORS: the key check answers
    on = _app(tokenizer, ("https://ui.example",))
    r = on.options("/tokenize", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = on.options("/tokenize", headers={**preflight, "access-control-request-headers": "x-stainless-os, openai-project"})
    assert r.status_code == 200  # the openai SDK's own headers, as vLLM allows any
    assert on.options("/tokenize", headers={**preflight, "origin": "https://evil.example"}).status_code == 400
    r = on.post("/tokenize", json={"prompt": "hi"}, headers={"origin": "https://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ui.example"  # readable
    r = on.post("/tokenize", json={"prompt": "hi"},
                headers={"origin": "https://ui.example", "authorization": "Bearer sk-1"})
    assert r.status_code == 200 and "x-request-id" in r.headers["access-control-expose-headers"].lower()


@pytest.mark.parametrize("origin", ["ui.example", "https://ui.example/path", "ftp://ui.example", "HTTPS://UI.example",
                                    "https://ui.example:443", "https://user:pw@ui.example", "https://*.example",
                                    "https://ui.example:99999", "https://ui.example/"])
def test_an_allowed_origin_no_browser_sends_is_refused_at_start(origin):
    from router.openai.cors import check_origins
    with pytest.raises(ValueError, match="must be '\\*' or scheme://host"):
        check_origins((origin,))
    check_origins(("*", "https://ui.example", "http://localhost:3000", "http://[::1]:8080"))

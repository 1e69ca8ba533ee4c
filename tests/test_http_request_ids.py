"""Every answer of a generation route carries ``X-Request-Id``, refusals given before the route named
the request too (an unknown model, a malformed or oversized body, a missing key), and such a refusal
is logged once with that id, its status and its message; a body refused for its size counts in
``request_errors`` as gRPC's RESOURCE_EXHAUSTED, so every generation request counts once."""

from __future__ import annotations

import logging
import re
import types

import pytest
from fastapi.testclient import TestClient

from router.openai import request_ids
from router.openai.app import FrontDoorState, build_app
from serving.logs import ThrottledLog
from serving.metrics import ProcessMetrics


@pytest.fixture
def app():
    metrics = ProcessMetrics("router", "router", "m")
    state = FrontDoorState(core=types.SimpleNamespace(admission=None), model_name="m", tokenizer=None,
                           health=lambda: (True, ""), targets=list, metrics_registry=None,
                           accepts_api_key=lambda key: key == "sk-1", max_request_bytes=2000, metrics=metrics)
    return TestClient(build_app(state), raise_server_exceptions=False), metrics


KEY = {"authorization": "Bearer sk-1"}


def test_refusals_before_the_route_are_named_with_the_clients_id_and_logged(app, caplog, monkeypatch):
    http, _ = app
    # a fresh throttle: an earlier test's refusal must not make this one's first line a counted one
    monkeypatch.setattr(request_ids, "_refused", ThrottledLog(request_ids.log, "refused"))
    caplog.set_level(logging.INFO, logger="router.openai.request_ids")
    r = http.post("/v1/completions", json={"model": "other", "prompt": "x"}, headers={**KEY, "X-Request-Id": "op-1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "cmpl-op-1"
    line = next(rec.getMessage() for rec in caplog.records if "cmpl-op-1" in rec.getMessage())
    assert "refused: HTTP 404: model 'other' does not exist" in line
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": 3}, headers=KEY)  # no client id: a fresh one
    assert r.status_code == 400 and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", r.headers["x-request-id"])
    assert http.post("/v1/completions", json={"prompt": "x"}).headers["x-request-id"].startswith("cmpl-")  # 401
    bad = http.post("/v1/completions", json={"prompt": "x"}, headers={**KEY, "X-Request-Id": "a b"})
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", bad.headers["x-request-id"])  # an invalid client id is not echoed
    assert "x-request-id" not in http.get("/v1/models", headers=KEY).headers  # other routes: as before
    two = http.post("/v1/completions", json={"model": "other", "prompt": "x"},
                    headers=[("authorization", "Bearer sk-1"), ("x-request-id", "first"), ("x-request-id", "second")])
    assert two.headers["x-request-id"] == "cmpl-first"  # the first, as the route takes it


def test_an_oversized_body_counts_once_in_request_errors(app):
    http, metrics = app
    body = b'{"model": "m", "prompt": "' + b"a" * 2000 + b'"}'
    r = http.post("/v1/completions", content=body, headers={**KEY, "content-type": "application/json",
                                                           "X-Request-Id": "big-1"})
    assert r.status_code == 413 and r.headers["x-request-id"] == "cmpl-big-1"
    assert metrics.get("request_errors", code="RESOURCE_EXHAUSTED")._value.get() == 1
    assert metrics.get("http_requests", method="POST", handler="/v1/completions", status="413")._value.get() == 1
    http.post("/v1/models", content=body, headers={**KEY, "content-type": "application/json"})  # not a generation
    anonymous = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert anonymous.status_code == 401  # the key is checked first: no key, no count in request_errors
    assert metrics.get("request_errors", code="RESOURCE_EXHAUSTED")._value.get() == 1

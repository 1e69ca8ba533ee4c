"""A client that disconnects from the HTTP front door cancels its request: also a non-streamed
one (found by chaos testing: it ran on to ``max_tokens`` for nobody) and a streamed one before
its first message; a streamed request that fails before its first message gets its HTTP status. A real uvicorn server on
loopback, a fake request path whose request runs until it is cancelled; no cluster."""

from __future__ import annotations

import json
import socket
import threading
import time
import types

import grpc
import pytest

from pdcluster.v1 import common_pb2, router_pb2
from router.errors import RouterError
from router.http import HttpServer
from router.openai.app import FrontDoorState, build_app


class BlockingCore:
    """Each request yields nothing until cancelled (like a long generation); records cancels."""

    admission = None  # no admission control

    def __init__(self):
        self.started = threading.Event()
        self.cancelled = threading.Event()

    def start(self, request):
        gone = threading.Event()

        def responses():
            self.started.set()
            if request.text == "fail":  # fails before its first message, as with no live prefill worker
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no live prefill worker")
            if request.text == "quick":
                yield router_pb2.GenerateResponse(token_ids=[7], text="x", finish_reason=common_pb2.FINISH_REASON_LENGTH)
                return
            if gone.wait(30):
                self.cancelled.set()
            yield router_pb2.GenerateResponse(token_ids=[7], text="x", finish_reason=common_pb2.FINISH_REASON_LENGTH)

        return types.SimpleNamespace(request_id=request.request_id, cancel=gone.set, discard=lambda: None,
                                     responses=responses)


@pytest.fixture
def served():
    core = BlockingCore()
    state = FrontDoorState(core=core, model_name="m", tokenizer=None, health=lambda: (True, ""), targets=list,
                           metrics_registry=None, accepts_api_key=lambda key: True)
    server = HttpServer(build_app(state), "127.0.0.1", 0)
    port = server.start()
    yield core, port
    server.stop()


def _send(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (path.encode(), len(data)) + data)
    return sock


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "m", "prompt": "long", "max_tokens": 1000}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "long"}], "max_tokens": 1000}),
])
def test_a_non_streamed_request_is_cancelled_when_its_client_disconnects(served, path, body):
    core, port = served
    sock = _send(port, body, path)
    assert core.started.wait(10)
    sock.close()
    t0 = time.monotonic()
    assert core.cancelled.wait(5), "the request ran on after its client disconnected"
    assert time.monotonic() - t0 < 2.0


def test_a_non_streamed_request_still_answers(served):
    core, port = served
    sock = _send(port, {"model": "m", "prompt": "quick", "max_tokens": 1})
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        answer += sock.recv(65536)
    sock.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert json.loads(payload)["choices"][0]["text"] == "x"
    assert not core.cancelled.is_set()


def _answer(sock: socket.socket, until: bytes) -> bytes:
    answer = b""
    while until not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    sock.close()
    return answer


def test_a_streamed_request_is_cancelled_when_its_client_leaves_before_the_first_message(served):
    core, port = served
    sock = _send(port, {"model": "m", "prompt": "long", "max_tokens": 1000, "stream": True})
    assert core.started.wait(10)
    sock.close()
    assert core.cancelled.wait(5), "the stream's request ran on after its client disconnected"


def test_a_streamed_request_that_fails_before_its_first_message_gets_its_status(served):
    _, port = served
    answer = _answer(_send(port, {"model": "m", "prompt": "fail", "max_tokens": 4, "stream": True}), b"}}")
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), head
    assert json.loads(payload)["error"]["message"] == "no live prefill worker"
    answer = _answer(_send(port, {"model": "m", "prompt": "quick", "max_tokens": 1, "stream": True}), b"[DONE]")
    assert answer.startswith(b"HTTP/1.1 200") and b'"text": "x"' in answer and b"data: [DONE]" in answer, answer

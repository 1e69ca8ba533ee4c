"""The HTTP port's request bodies must arrive in time (:mod:`router.openai.body`): a body that
trickles or never comes gets 408 in OpenAI's error shape after ``body_timeout_s``, a body without a
length that grows past ``max_request_bytes`` gets 413, the API key is checked before any body is
read, and requests whose bodies arrive are served as before. Real uvicorn on loopback, raw sockets
for the slow senders."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from router.http import HttpServer
from router.openai.app import FrontDoorState, build_app
from router.openai.body import BodyDeadline

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def port():
    state = FrontDoorState(core=None, model_name="m", tokenizer=None, health=lambda: (True, ""), targets=list,
                           metrics_registry=None, accepts_api_key=lambda key: key == "k", max_request_bytes=2000,
                           body_timeout_s=TIMEOUT_S)
    server = HttpServer(build_app(state), "127.0.0.1", 0)
    yield server.start()
    server.stop()


def _exchange(port: int, head: bytes, body_parts: list[bytes], pause_s: float = 0.0) -> tuple[int, dict, float]:
    """Send ``head`` then each part (``pause_s`` apart); return (status, JSON body, seconds to the answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(head)
        for part in body_parts:
            time.sleep(pause_s)
            try:
                s.sendall(part)
            except OSError:
                break  # the server answered and closed meanwhile
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - t0
    head_text, body = data.split(b"\r\n\r\n", 1)
    return int(head_text.split()[1]), json.loads(body), elapsed


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _head(length: int | None, key: str = "k") -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\n{size}\r\n\r\n").encode()


def test_a_body_that_never_comes_gets_408(port):
    status, body, elapsed = _exchange(port, _head(100), [b'{"model": '])
    assert status == 408, body
    assert body["error"]["code"] == "request_timeout" and "http_body_timeout_s (1 s; 10 bytes came)" in \
        body["error"]["message"]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5


def test_a_trickling_body_gets_408_though_each_part_comes_in_time(port):
    parts = [b"{", b'"model"', b": ", b'"m"']  # 0.4 s apart: each in time, the whole not
    status, body, _ = _exchange(port, _head(100), parts, pause_s=0.4)
    assert status == 408 and "bytes came" in body["error"]["message"]


def test_a_chunked_body_past_the_limit_gets_413_as_it_arrives(port):
    chunk = b"%x\r\n%s\r\n" % (500, b"a" * 500)
    status, body, _ = _exchange(port, _head(None), [chunk] * 5)
    assert status == 413 and "max_request_bytes (2000 bytes)" in body["error"]["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_client_that_sends_its_whole_body_first_reads_the_413(port, chunked):
    """Python's urllib sends the whole body, then reads: a body the server left unread made the close a
    connection reset (a helper's trial, 5 MB); the refused body is now read and dropped before the 413."""
    body = b"x" * (8 << 20)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=iter([body]) if chunked else body,
                                     headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(request, timeout=30)
    assert exc.value.code == 413
    assert json.loads(exc.value.read())["error"]["code"] == "request_too_large"


def test_a_client_that_expects_100_continue_gets_the_413_before_sending(port):
    head = _head(8 << 20).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    status, body, elapsed = _exchange(port, head, [])
    assert status == 413 and body["error"]["code"] == "request_too_large" and elapsed < 1.0, body


def test_the_api_key_is_checked_before_the_body_is_waited_for(port):
    status, body, elapsed = _exchange(port, _head(100, key="wrong"), [])
    assert status == 401 and elapsed < TIMEOUT_S, body


def test_a_body_that_arrives_is_served(port):
    payload = b'{"model": "other", "prompt": "a"}'  # reaches the route: an unknown model is its 404
    status, body, _ = _exchange(port, _head(len(payload)), [payload[:10], payload[10:]], pause_s=0.2)
    assert status == 404 and "other" in body["error"]["message"], body


def test_the_timeout_and_size_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        BodyDeadline(None, max_bytes=10, timeout_s=0)
    with pytest.raises(ValueError, match="must be positive"):
        BodyDeadline(None, max_bytes=0)

"""The HTTP port's connections (:mod:`router.http_protocol`): a connection that sends nothing is
closed after ``header_timeout_s``, a head that trickles gets 408 in OpenAI's error shape and the
connection closes, on a fresh connection and on a kept-alive one; heads that arrive in time are
served, a slow body is left to the body deadline, and idle connections do not keep others from
being served; a connection beyond ``max_connections`` gets 503 and is closed; a request h11
cannot parse gets 400 in OpenAI's error shape. Real uvicorn on loopback, raw sockets."""

from __future__ import annotations

import json
import socket
import time

import pytest

from deploy.spec import spec_from_args
from router.http import HttpServer
from router.http_protocol import protocol
from router.limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_HTTP_MAX_CONNECTIONS
from router.openai.app import FrontDoorState, build_app

from cli_helpers import parse_up

HEAD_S = 1.0
MAX_CONNECTIONS = 60
BODY_S = 4.0
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
ANSWERED: list[int] = []  # the statuses the guards reported (counted in http_requests_total)


@pytest.fixture(scope="module")
def port():
    state = FrontDoorState(core=None, model_name="m", tokenizer=None, health=lambda: (True, ""), targets=list,
                           metrics_registry=None, accepts_api_key=lambda key: key == "k", max_request_bytes=2000,
                           body_timeout_s=BODY_S)
    server = HttpServer(build_app(state), "127.0.0.1", 0, header_timeout_s=HEAD_S, max_connections=MAX_CONNECTIONS,
                        answered=ANSWERED.append)
    yield server.start()
    server.stop()


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _read_response(s: socket.socket) -> tuple[int, bytes]:
    """One response with a ``content-length`` (status, body), leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), body


def _trickle(s: socket.socket, data: bytes, pause_s: float) -> None:
    for i in range(len(data)):
        time.sleep(pause_s)
        try:
            s.sendall(data[i:i + 1])
        except OSError:
            return  # the server closed the connection meanwhile


def test_a_silent_connection_is_closed_without_an_answer(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        assert _read_all(s) == b""
        assert HEAD_S <= time.monotonic() - t0 < HEAD_S + 4


def test_a_trickling_head_gets_408_and_the_connection_closes(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        _trickle(s, HEALTH, pause_s=0.25)  # 33 bytes at 4 a second: each in time, the whole not
        data = _read_all(s)
        elapsed = time.monotonic() - t0
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "http_header_timeout_s (1 s;" in error["message"]
    assert HEAD_S <= elapsed < HEAD_S + 4
    assert 408 in ANSWERED  # counted (helper finding: no ASGI layer sees it)


def test_a_kept_alive_connection_gets_the_same_deadline_for_its_next_head(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(HEALTH)
        assert _read_response(s)[0] == 200
        _trickle(s, HEALTH, pause_s=0.25)
        assert _read_all(s).startswith(b"HTTP/1.1 408 ")


def test_a_head_in_parts_within_the_deadline_is_served_and_the_connection_kept(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        _trickle(s, HEALTH[:10], pause_s=0.02)
        s.sendall(HEALTH[10:])
        assert _read_response(s)[0] == 200
        time.sleep(HEAD_S / 2)
        s.sendall(HEALTH)  # the same connection serves the next request
        assert _read_response(s)[0] == 200


def test_a_slow_body_is_the_body_deadlines_not_the_heads(port):
    payload = b'{"model": "other", "prompt": "a"}'  # reaches the route: an unknown model is its 404
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        time.sleep(HEAD_S + 0.5)  # past the head deadline, within the body's
        s.sendall(payload)
        status, body = _read_response(s)
    assert status == 404 and b"other" in body


def test_idle_connections_do_not_keep_others_from_being_served(port):
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(50)]
    try:
        for c in idle[:25]:
            c.sendall(b"GET /hea")  # half a head
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(HEALTH)
            assert _read_response(s)[0] == 200
        time.sleep(HEAD_S + 1)
        for i, c in enumerate(idle):  # every one was closed by its deadline
            c.settimeout(5)
            data = _read_all(c)
            assert data.startswith(b"HTTP/1.1 408 ") if i < 25 else data == b"", (i, data[:40])
    finally:
        for c in idle:
            c.close()


def test_health_answers_head_requests_too(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 200 ")


def test_a_connection_beyond_max_connections_gets_503_and_is_closed(port):
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # every one accepted
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            data = _read_all(s)
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections" and 503 in ANSWERED
    finally:
        for c in held:
            c.close()
    time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # room again
        s.sendall(HEALTH)
        assert _read_response(s)[0] == 200


@pytest.mark.parametrize("head", [b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                                  b"NOT A REQUEST LINE\r\n\r\n"])
def test_a_request_h11_cannot_parse_gets_400_in_openais_shape(port, head):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        data = _read_all(s)
    head_text, body = data.split(b"\r\n\r\n", 1)
    assert head_text.startswith(b"HTTP/1.1 400 ") and b"application/json" in head_text
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
    assert 400 in ANSWERED


def test_a_request_with_both_content_length_and_transfer_encoding_gets_400(port):
    """RFC 9112 6.1 lets a server refuse it; a proxy reading the other header would see another request
    boundary (request smuggling). Chaos-helper finding: it was served from the chunked body."""
    body = b'{"prompt": "a"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\nAuthorization: Bearer k\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        status, answer = _read_response(s)
    assert status == 400 and "both Content-Length and Transfer-Encoding" in json.loads(answer)["error"]["message"]


def test_the_limits_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        protocol(0, 10)
    with pytest.raises(ValueError, match="must be positive"):
        protocol(1, 0)


def test_the_flag_reaches_the_router_config(capsys):
    def up(*argv: str):
        return spec_from_args(parse_up(*argv), "redis://127.0.0.1:1").router

    default = up()
    assert default.http_header_timeout_s == DEFAULT_HEADER_TIMEOUT_S
    assert default.http_max_connections == DEFAULT_HTTP_MAX_CONNECTIONS
    cfg = up("--http-header-timeout", "2.5", "--http-max-connections", "100")
    assert cfg.http_header_timeout_s == 2.5 and cfg.http_max_connections == 100
    for bad in (("--http-header-timeout", "0"), ("--http-max-connections", "0")):
        with pytest.raises(SystemExit):
            up(*bad)
        assert "must be" in capsys.readouterr().err

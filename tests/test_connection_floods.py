"""Connections that never finish their handshake are bounded in number and in time on every port:
the router's HTTPS port (:mod:`router.tls_gate`) and any gRPC server (:func:`serving.rpc.connection_options`).
A flood of raw TCP connections that send nothing used to hold a router's descriptors for a minute or
two each, uncounted by any limit. Real uvicorn / gRPC servers on loopback, raw sockets."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.http import HttpServer
from router.openai.app import FrontDoorState, build_app
from router.tls_gate import GatedLoop
from serving.certs import create_ca, issue
from serving.rpc import HANDSHAKE_TIMEOUT_S, add_health, connection_options, set_serving
from serving.security import Plane, SecurityConfig, make_server

CA = create_ca("test-floods")
LEAF = issue(CA, "router", ["127.0.0.1"])
MAX = 6


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``s`` (EOF or reset) within ``within_s`` seconds (what it sends
    meanwhile, e.g. gRPC's HTTP/2 settings, is read and dropped)."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def _https_health(port: int) -> int:
    context = ssl.create_default_context(cadata=CA.cert_pem.decode())
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=10, context=context) as r:
        return r.status


def test_https_port_bounds_connections_in_their_handshake():
    state = FrontDoorState(core=None, model_name="m", tokenizer=None, health=lambda: (True, ""), targets=list,
                           metrics_registry=None, accepts_api_key=lambda key: True)
    server = HttpServer(build_app(state), "127.0.0.1", 0, tls=(LEAF.cert_pem, LEAF.key_pem), max_connections=MAX)
    port = server.start()
    try:
        silent = [_raw(port) for _ in range(MAX)]  # never send a ClientHello
        time.sleep(0.3)
        extra = _raw(port)
        assert _closed_by_server(extra, 5), "a connection beyond max_connections in their handshake is closed"
        assert not _closed_by_server(silent[0], 0.2), "the first ones wait for their handshake"
        for s in silent:
            s.close()
        deadline = time.monotonic() + 5
        while True:  # the server sees the closes soon after
            try:
                assert _https_health(port) == 200
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        # the application's own max_connections still applies to handshaken connections
        held = [ssl.create_default_context(cadata=CA.cert_pem.decode()).wrap_socket(_raw(port),
                server_hostname="127.0.0.1") for _ in range(MAX)]
        extra = ssl.create_default_context(cadata=CA.cert_pem.decode()).wrap_socket(_raw(port),
                                                                                    server_hostname="127.0.0.1")
        assert b" 503 " in extra.recv(4096)
        for s in held + [extra]:
            s.close()
    finally:
        server.stop()


def _request_with_the_finished(port: int, path: str) -> bytes:
    """A TLS client whose request leaves in the same packet as its handshake's Finished (as a TLS 1.3
    client may send it); returns what the server sends within a second of the request."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context(cadata=CA.cert_pem.decode()).wrap_bio(incoming, outgoing,
                                                                            server_hostname="127.0.0.1")
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if outgoing.pending:
                raw.sendall(outgoing.read())
            incoming.write(raw.recv(65536))
    tls.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    raw.sendall(outgoing.read())
    raw.settimeout(1.0)  # a TLS close waits for the client's close_notify: stop reading once the answer came
    got = b""
    try:
        while data := raw.recv(65536):
            incoming.write(data)
            try:
                while chunk := tls.read(65536):
                    got += chunk
            except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                pass
    except TimeoutError:
        pass
    raw.close()
    return got


def test_a_connection_refused_after_its_handshake_runs_no_request_that_came_with_it():
    """The gate hands what came with the handshake to the application's protocol after its
    ``connection_made``; a connection that refused (503 over max_connections) must not run it."""
    paths: list[str] = []

    async def app(scope, receive, send):
        paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server = HttpServer(app, "127.0.0.1", 0, tls=(LEAF.cert_pem, LEAF.key_pem), max_connections=1)
    port = server.start()
    try:
        assert _request_with_the_finished(port, "/first").startswith(b"HTTP/1.1 200")  # served as usual
        held = ssl.create_default_context(cadata=CA.cert_pem.decode()).wrap_socket(_raw(port),
                                                                                   server_hostname="127.0.0.1")
        held.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(4096).startswith(b"HTTP/1.1 200")
        assert _request_with_the_finished(port, "/refused").startswith(b"HTTP/1.1 503")
        time.sleep(0.3)
        assert paths == ["/first", "/held"]
        held.close()
    finally:
        server.stop()


def test_gated_loop_times_handshakes_out_and_keeps_data_sent_with_the_handshake(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(LEAF.cert_pem)
    key.write_bytes(LEAF.key_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    got: list[bytes] = []
    ready = threading.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            got.append(data)
            self.transport.write(data.upper())

    async def serve():
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0, ssl=context)
        loop_box.append(server)
        ready.set()
        await asyncio.sleep(30)

    runner = asyncio.Runner(loop_factory=lambda: GatedLoop(max_pending=4, handshake_timeout_s=0.5))
    thread = threading.Thread(target=lambda: _run_quietly(runner, serve()), daemon=True)
    thread.start()
    assert ready.wait(10)
    port = loop_box[0].sockets[0].getsockname()[1]
    silent = _raw(port)
    started = time.monotonic()
    assert _closed_by_server(silent, 5) and time.monotonic() - started < 3, "a silent handshake is closed in time"
    client = ssl.create_default_context(cadata=CA.cert_pem.decode()).wrap_socket(_raw(port), server_hostname="127.0.0.1")
    client.sendall(b"hello")  # may arrive with the handshake's last message
    assert client.recv(5) == b"HELLO" and got == [b"hello"]
    client.close()
    with pytest.raises(ValueError, match="must be positive"):
        GatedLoop(max_pending=0, handshake_timeout_s=1)


def _run_quietly(runner: asyncio.Runner, coro) -> None:
    try:
        runner.run(coro)
    finally:
        runner.close()


def test_grpc_server_bounds_connections_from_accept_and_times_handshakes_out():
    server = make_server(SecurityConfig(), Plane.INTERNAL, max_workers=2, max_connections=MAX)
    health = add_health(server)
    set_serving(health, [])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        silent = [_raw(port) for _ in range(MAX)]
        time.sleep(0.3)
        assert _closed_by_server(_raw(port), 5), "a connection beyond max_connections is closed at accept"
        started = time.monotonic()
        assert _closed_by_server(silent[0], HANDSHAKE_TIMEOUT_S + 5), "a silent connection is closed"
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 5
        for s in silent:
            s.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="max_connections must be positive"):
        connection_options(0)

"""A process' ``/metrics`` endpoint (:mod:`serving.metrics_http`) keeps answering scrapers while
other clients connect and stay silent, send half a request, or never complete a TLS handshake
(before, one silent connection to the HTTPS endpoint held the accepting thread in the handshake and
every scrape timed out); such connections are closed after ``io_timeout_s``. Real servers on
loopback, raw sockets for the slow clients."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from serving.certs import create_ca, issue
from serving import metrics_http
from serving.metrics_http import MetricsHttpServer

IO_S = 1.0
CA = create_ca("test-metrics")
LEAF = issue(CA, "router", ["127.0.0.1"])


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("pdcluster:probe", "a counter to find in the scrape", registry=registry).inc()
    return registry


@pytest.fixture(params=["http", "https"])
def server(request):
    tls = (LEAF.cert_pem, LEAF.key_pem) if request.param == "https" else None
    srv = MetricsHttpServer(_registry(), "127.0.0.1", tls=tls, io_timeout_s=IO_S)
    srv.start()
    yield request.param, srv
    srv.stop()


def _scrape(scheme: str, port: int) -> bytes:
    ctx = ssl.create_default_context(cadata=CA.cert_pem.decode()) if scheme == "https" else None
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", context=ctx, timeout=5) as r:
        return r.read()


def test_silent_and_half_sent_connections_do_not_keep_scrapers_out(server):
    scheme, srv = server
    silent = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(5)]
    half = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(5)]
    try:
        for c in half:
            c.sendall(b"GET /metr")  # plaintext: half a request line; TLS: a broken ClientHello
        t0 = time.monotonic()
        for _ in range(3):
            assert b"pdcluster:probe_total 1.0" in _scrape(scheme, srv.port)
        assert time.monotonic() - t0 < IO_S  # served at once, not after the slow clients' timeouts
        for c in silent + half:  # each closed by the server within its timeout
            c.settimeout(IO_S + 5)
            while c.recv(65536):
                pass
    finally:
        for c in silent + half:
            c.close()


def test_trickling_connections_are_closed_at_their_deadline_and_bounded_in_number(monkeypatch):
    """A request trickling a byte before each read timeout held its thread for ever, and nothing
    bounded how many did."""
    monkeypatch.setattr(metrics_http, "CONNECTION_DEADLINE_S", 1.5)
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 3)
    srv = MetricsHttpServer(_registry(), "127.0.0.1", io_timeout_s=IO_S)
    srv.start()
    held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(3)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        assert extra.recv(1) == b"", "a connection beyond MAX_CONNECTIONS is closed at accept"
        extra.close()
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 5 and not closed:
            try:
                held[0].sendall(b"G")  # a byte well within each read's timeout
                held[0].settimeout(IO_S / 2)
                closed = held[0].recv(1) == b""
            except TimeoutError:
                pass
            except OSError:  # reset
                closed = True
        assert closed and time.monotonic() - t0 < 3, "a trickling connection is closed at its deadline"
        for c in held:
            c.close()
        time.sleep(0.2)
        assert b"pdcluster:probe_total 1.0" in _scrape("http", srv.port)  # the slots came back
    finally:
        for c in held:
            c.close()
        srv.stop()


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="io_timeout_s must be positive"):
        MetricsHttpServer(_registry(), "127.0.0.1", io_timeout_s=0)

"""The HTTP port's connections: request heads must arrive in time, connections are bounded, and
what uvicorn answers itself is in OpenAI's error shape.

uvicorn closes a keep-alive connection that stays silent after a response, but it has no timeout
for the head of a request and no limit on connections: a fresh connection that sends nothing, or a
head that arrives a byte a second, held a socket for as long as the client liked, and a flood of
them used up the router's file descriptors, which its gRPC port, its Redis connections and its logs
share (body timeouts are :mod:`router.openai.body`'s). :func:`protocol` makes uvicorn's h11
protocol

* give each request head ``head_timeout_s`` seconds, counted from the connection's start and, on a
  kept-alive connection, from the end of the previous response; a connection whose head is late is
  closed, with a 408 when part of a head came (as Node.js's ``headersTimeout`` and Apache's
  ``mod_reqtimeout`` do), silently when nothing did (as uvicorn's own keep-alive timeout does);
* refuse a connection beyond ``max_connections`` open ones at once with a 503 (``Retry-After: 1``)
  and close it, so the port never holds more descriptors than that (uvicorn's
  ``limit_concurrency`` answers 503 too, but only to requests, keeping every connection open);
* answer a request h11 cannot parse (a bad request line or ``Content-Length``) with 400 in
  OpenAI's error shape instead of uvicorn's plain text;
* report each of these answers (400, 408, 503: no ASGI layer sees them) to ``answered``, so
  ``http_requests_total`` counts them with the app's own answers (``method`` and ``handler``
  ``other``: no head was parsed).

Lifecycle of one connection's head timer: armed at ``connection_made``; cancelled once h11 has
parsed a request head (the request runs, with no head timeout, until its response completes);
armed again when a response completes and the connection stays open; cancelled at
``connection_lost``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.openai.errors import error_body
from serving.logs import ThrottledLog

log = logging.getLogger(__name__)
_too_many = ThrottledLog(log, "HTTP connections refused (max_connections)")
_late_heads = ThrottledLog(log, "HTTP connections closed (request head late)")


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the module docstring's guards; :func:`protocol` makes the
    subclass with the limits set."""

    head_timeout_s: float = 0.0
    max_connections: int = 0
    answered = staticmethod(lambda status: None)
    _head_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            _too_many.info(_peer(self.client), "HTTP connection from %s refused: %d open (max_connections %d): 503",
                           _peer(self.client), len(self.connections) - 1, self.max_connections)
            transport.write(_response(503, f"the server holds max_connections ({self.max_connections}) "
                                           "connections; retry later", "too_many_connections", b"retry-after: 1\r\n"))
            transport.close()
            self.answered(503)
            return
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a head was parsed (or the client broke the protocol)
            self._cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in OpenAI's error shape."""
        self.transport.write(_response(400, f"invalid HTTP request: {msg}", "invalid_http_request"))
        self.transport.close()
        self.answered(400)

    def _arm(self) -> None:
        self._cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._late)

    def _cancel(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        came = len(self.conn.trailing_data[0])
        if came:
            _late_heads.info(_peer(self.client), "HTTP client %s: request head incomplete after %g s "
                             "(%d bytes came): 408, closed", _peer(self.client), self.head_timeout_s, came)
            self.transport.write(_response(408, f"the request head did not arrive within http_header_timeout_s "
                                                f"({self.head_timeout_s:g} s; {came} bytes came)", "request_timeout"))
            self.answered(408)
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


def _response(status: int, message: str, code: str, extra_headers: bytes = b"") -> bytes:
    """A whole ``connection: close`` response with OpenAI's error body, written before (or
    instead of) h11's state machine: the connection closes right after it."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n%s"
            b"content-length: %d\r\n\r\n%s" % (status, _REASONS[status], extra_headers, len(body), body))


def protocol(head_timeout_s: float, max_connections: int,
             answered: Callable[[int], None] | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol class (``uvicorn.Config(http=...)``) with the module docstring's
    guards: request heads within ``head_timeout_s`` seconds, at most ``max_connections`` open
    connections; ``answered(status)`` is called for each answer the protocol gives itself.

    Raises:
        ValueError: ``head_timeout_s`` or ``max_connections`` not positive.
    """
    if not head_timeout_s > 0 or max_connections < 1:
        raise ValueError(f"the HTTP header timeout ({head_timeout_s}) and max_connections ({max_connections}) "
                         "must be positive")
    attrs = {"head_timeout_s": float(head_timeout_s), "max_connections": int(max_connections)}
    if answered is not None:
        attrs["answered"] = staticmethod(answered)
    return type("GuardedH11", (_GuardedH11,), attrs)

"""Request heads must arrive in time: the HTTP port's defence against clients that open a
connection and send nothing, or trickle their request line and headers (slowloris).

uvicorn closes a keep-alive connection that stays silent after a response, but it has no timeout
for the head of a request: a fresh connection that sends nothing, or a head that arrives a byte a
second, holds a socket and its buffers for as long as the client likes, and enough of them exhaust
the process's file descriptors (body timeouts are :mod:`router.openai.body`'s). :func:`protocol`
makes uvicorn's h11 protocol give each request head ``timeout_s`` seconds, counted from the
connection's start and, on a kept-alive connection, from the end of the previous response; a
connection whose head is late is closed, with a 408 in OpenAI's error shape when part of a head
came (as Node.js's ``headersTimeout`` and Apache's ``mod_reqtimeout`` do), silently when nothing did
(as uvicorn's own keep-alive timeout does).

Lifecycle of one connection's timer: armed at ``connection_made``; cancelled once h11 has parsed a
request head (the request runs, with no head timeout, until its response completes); armed again
when a response completes and the connection stays open; cancelled at ``connection_lost``.
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.openai.errors import error_body

log = logging.getLogger(__name__)


class _HeadDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head (see the module docstring);
    :func:`protocol` makes the subclass with the deadline set."""

    head_timeout_s: float = 0.0
    _head_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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
            log.info("HTTP client %s: request head incomplete after %g s (%d bytes came): 408, closed",
                     _peer(self.client), self.head_timeout_s, came)
            self.transport.write(_response_408(self.head_timeout_s, came))
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def _response_408(timeout_s: float, came: int) -> bytes:
    body = json.dumps(error_body(408, f"the request head did not arrive within http_header_timeout_s "
                                      f"({timeout_s:g} s; {came} bytes came)", code="request_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class (``uvicorn.Config(http=...)``) closing connections whose request
    head does not arrive within ``timeout_s`` seconds (see the module docstring).

    Raises:
        ValueError: ``timeout_s`` not positive.
    """
    if not timeout_s > 0:
        raise ValueError(f"the HTTP header timeout must be positive, got {timeout_s}")
    return type("HeadDeadlineH11", (_HeadDeadlineH11,), {"head_timeout_s": float(timeout_s)})

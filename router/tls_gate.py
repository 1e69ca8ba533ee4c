"""The HTTPS port's connections before their TLS handshake ends: bounded in number and in time.

asyncio hands an HTTPS connection to its protocol (uvicorn's, guarded by
:mod:`router.http_protocol`) only once the TLS handshake is done, and waits 60 s for a handshake.
A flood of TCP connections that never send a ClientHello was therefore counted by no limit and
held for a minute each: it used up the router's file descriptors (shared with its gRPC port, its
Redis connections and its logs) and new clients were refused until the flood timed out.

:class:`GatedLoop` is the event loop the HTTPS port runs on. Its ``create_server`` with an
``ssl`` context accepts plain TCP and puts a :class:`_Handshake` in front of the application's
protocol. Lifecycle of one connection:

* accepted: refused (closed at once, no byte written) when ``max_pending`` connections are already
  in their handshake; else its reading pauses, so no byte of the ClientHello is lost before
  ``loop.start_tls`` takes it over;
* handshaking: ``start_tls`` with ``handshake_timeout_s``; a late, failed or abandoned handshake
  closes the connection (asyncio logs those at debug level only);
* handshaken: the application's protocol gets the TLS transport (``connection_made``) and the
  connection leaves the gate's count; from then on the application's own limits apply.

So the port holds at most ``max_pending`` connections in their handshake, each for at most
``handshake_timeout_s`` seconds, besides its application's ``max_connections``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

from serving.logs import ThrottledLog

log = logging.getLogger(__name__)
_refused = ThrottledLog(log, "HTTPS connections refused (handshakes pending)")


class _Handshake(asyncio.Protocol):
    """One accepted connection until its TLS handshake ends (the module docstring's lifecycle).

    asyncio's TLS layer may pass on application data that came with the handshake's last message
    before ``start_tls`` returns: it is kept here and handed to the application's protocol after
    its ``connection_made``, unless that refused the connection (then it never runs)."""

    def __init__(self, loop: GatedLoop, make_app: Callable[[], asyncio.Protocol], context: ssl.SSLContext) -> None:
        self._loop = loop
        self._make_app = make_app
        self._context = context
        self._early: list[bytes] = []
        self._eof = False
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        loop = self._loop
        if loop.pending >= loop.max_pending:
            peer = transport.get_extra_info("peername")
            _refused.info(str(peer), "HTTPS connection from %s refused: %d connections in their TLS handshake "
                          "(max %d)", peer, loop.pending, loop.max_pending)
            transport.abort()
            return
        loop.pending += 1
        transport.pause_reading()  # start_tls reads the ClientHello; nothing may consume it before
        loop.create_task(self._handshake(transport))

    async def _handshake(self, transport: asyncio.Transport) -> None:
        loop = self._loop
        try:
            tls = await loop.start_tls(transport, self, self._context, server_side=True,
                                       ssl_handshake_timeout=loop.handshake_timeout_s)
        except asyncio.CancelledError:  # the server is shutting down
            transport.abort()
            raise
        except Exception:  # noqa: BLE001 - late, failed or abandoned: whatever the error, the connection ends
            transport.abort()
            return
        finally:
            loop.pending -= 1
        if tls is None or self._lost or self._eof or tls.is_closing():  # the peer left as the handshake ended
            transport.abort()
            return
        app = self._make_app()
        tls.set_protocol(app)
        app.connection_made(tls)
        for data in self._early:
            if tls.is_closing():  # refused (e.g. over max_connections) or closed: what came early must not run
                return
            app.data_received(data)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self._early.append(data)

    def eof_received(self) -> None:
        """The peer closed as the handshake ended (asyncio's TLS layer closes the connection)."""
        self._eof = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True


class GatedLoop(asyncio.SelectorEventLoop):
    """An event loop whose TLS servers run :class:`_Handshake` in front of their protocol.

    Args:
        max_pending: connections in their TLS handshake at once, per loop; one more is closed at
            accept.
        handshake_timeout_s: seconds a TLS handshake may take; later the connection is closed.

    Raises:
        ValueError: ``max_pending`` or ``handshake_timeout_s`` not positive.
    """

    def __init__(self, max_pending: int, handshake_timeout_s: float) -> None:
        super().__init__()
        if max_pending < 1 or not handshake_timeout_s > 0:
            self.close()
            raise ValueError(f"max_pending ({max_pending}) and handshake_timeout_s ({handshake_timeout_s}) "
                             "must be positive")
        self.max_pending = max_pending
        self.handshake_timeout_s = handshake_timeout_s
        self.pending = 0

    async def create_server(self, protocol_factory, *args, ssl=None, **kwargs):  # type: ignore[override]
        """``asyncio`` ``create_server``; with an ``ssl`` context, TLS comes from the gate."""
        if ssl is None:
            return await super().create_server(protocol_factory, *args, **kwargs)
        return await super().create_server(lambda: _Handshake(self, protocol_factory, ssl), *args, **kwargs)

"""The router's HTTP port: uvicorn serving the FastAPI app on a thread of the router process,
HTTPS when given a certificate. With ``reuse_port`` the listening socket is made here with
SO_REUSEPORT (uvicorn's own has none), so the cluster's routers share one HTTP port and the
kernel spreads connections over them (``pdcluster up --routers N``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial

import uvicorn

from router.http_protocol import protocol
from router.limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_HTTP_MAX_CONNECTIONS
from router.tls_gate import GatedLoop
from serving.rpc import HANDSHAKE_TIMEOUT_S

log = logging.getLogger(__name__)

def _private_file(data: bytes) -> str:
    """``data`` in a new temporary file readable by its owner only (mode 0600); returns its path."""
    fd, path = tempfile.mkstemp(prefix="pdcluster-tls-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) with SO_REUSEADDR and SO_REUSEPORT,
    not yet listening (uvicorn listens on it).

    Raises:
        OSError: the address cannot be bound (taken by a socket without SO_REUSEPORT, or by
            another user).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """uvicorn on its own thread (its own event loop).

    Args:
        app: the ASGI application.
        host / port: where to listen (port 0 = any free port).
        tls: ``(certificate PEM, key PEM)`` to serve HTTPS with; ``None``: plain HTTP. uvicorn
            reads them from files: they are written to 0600 temporary files, removed once it listens.
            Connections in their TLS handshake are bounded too: at most ``max_connections`` at once,
            each for at most :data:`serving.rpc.HANDSHAKE_TIMEOUT_S` (:mod:`router.tls_gate`).
        reuse_port: listen with SO_REUSEPORT (other processes of this user may bind the port too).
        header_timeout_s: seconds each request head may take to arrive; a connection whose head is
            late is closed (:mod:`router.http_protocol`).
        max_connections: open connections at most; one more gets 503 and is closed (the process's
            open-file limit must fit them, twice over with TLS: :func:`serving.fd_room.make_fd_room`).
        answered: ``(status) ->`` called for each answer the connection guards give themselves (no
            ASGI layer sees those: :mod:`router.http_protocol`).

    Raises:
        OSError: with ``reuse_port``, the port cannot be bound.
        ValueError: ``header_timeout_s`` or ``max_connections`` not positive.
    """

    def __init__(self, app, host: str, port: int, tls: tuple[bytes, bytes] | None = None,
                 reuse_port: bool = False, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 max_connections: int = DEFAULT_HTTP_MAX_CONNECTIONS,
                 answered: Callable[[int], None] | None = None) -> None:
        http = protocol(header_timeout_s, max_connections, answered)
        self._tls_files = [_private_file(tls[0]), _private_file(tls[1])] if tls else []
        ssl = {"ssl_certfile": self._tls_files[0], "ssl_keyfile": self._tls_files[1]} if tls else {}
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1, http=http, **ssl)
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        sockets = [reuse_port_socket(host, port)] if reuse_port else None
        loop = partial(GatedLoop, max_connections, HANDSHAKE_TIMEOUT_S) if tls else asyncio.SelectorEventLoop
        self._thread = threading.Thread(target=self._run, args=(loop, sockets), name="router-http", daemon=True)

    def _run(self, loop_factory: Callable[[], asyncio.AbstractEventLoop], sockets: list[socket.socket] | None) -> None:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(self.server.serve(sockets=sockets))

    def start(self, timeout_s: float = 30.0) -> int:
        """Start serving; returns the bound port.

        Raises:
            RuntimeError: not listening within ``timeout_s`` seconds (e.g. the port is taken).
        """
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        try:
            while not self.server.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the HTTP server could not listen on {self.host}:{self.port}")
                time.sleep(0.01)
        finally:
            self._remove_tls_files()
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.port

    def _remove_tls_files(self) -> None:
        for path in self._tls_files:
            os.unlink(path)
        self._tls_files = []

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        if self._tls_files:  # never started
            self._remove_tls_files()

"""The router's HTTP port: uvicorn serving the FastAPI app on a thread of the router process,
HTTPS when given a certificate."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import uvicorn


def _private_file(data: bytes) -> str:
    """``data`` in a new temporary file readable by its owner only (mode 0600); returns its path."""
    fd, path = tempfile.mkstemp(prefix="pdcluster-tls-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


class HttpServer:
    """uvicorn on its own thread (its own event loop).

    Args:
        app: the ASGI application.
        host / port: where to listen (port 0 = any free port).
        tls: ``(certificate PEM, key PEM)`` to serve HTTPS with; ``None``: plain HTTP. uvicorn
            reads them from files: they are written to 0600 temporary files, removed once it listens.
    """

    def __init__(self, app, host: str, port: int, tls: tuple[bytes, bytes] | None = None) -> None:
        self._tls_files = [_private_file(tls[0]), _private_file(tls[1])] if tls else []
        ssl = {"ssl_certfile": self._tls_files[0], "ssl_keyfile": self._tls_files[1]} if tls else {}
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1, **ssl)
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="router-http", daemon=True)

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

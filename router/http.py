"""The router's HTTP port: uvicorn serving the FastAPI app on a thread of the router process."""

from __future__ import annotations

import threading
import time

import uvicorn


class HttpServer:
    """uvicorn on its own thread (its own event loop).

    Args:
        app: the ASGI application.
        host / port: where to listen (port 0 = any free port).
    """

    def __init__(self, app, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
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
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server could not listen on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.port

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

"""A process' own Prometheus ``/metrics`` endpoint: prometheus-client's WSGI server on a thread.

Every worker serves one on its host (any free port, plain HTTP, open: the address is
registered in Redis for service discovery). Every router serves one too, on a private port
of its own (the shared public HTTP port reaches a random router when several share it:
:mod:`router.server`); the router's asks for an API key when the cluster has keys and serves
HTTPS with the public certificate when the cluster has one, like its public HTTP port.

Each connection is served on its own thread (prometheus-client's threading WSGI server) with a
socket timeout of :data:`IO_TIMEOUT_S` on every read and write, and with TLS the handshake happens
on that thread too: a client that connects and stays silent, or never completes its handshake,
holds one thread for at most that long and never the thread that accepts connections (with the
handshake in ``accept``, one such client kept every scraper out). A connection is closed
:data:`CONNECTION_DEADLINE_S` after it was accepted whatever it is doing (a request trickling a
byte per read timeout kept its thread for ever), and at most :data:`MAX_CONNECTIONS` are served at
once: one more is closed at accept, so trickling clients cost a bounded number of threads.

The body is prometheus-client's text format 0.0.4 whatever the scraper asks for: its
OpenMetrics output rewrites the ``:`` of our names to ``_``, which would split a dashboard's
series between processes.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable
from wsgiref.simple_server import make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from common.grpc_metadata import bearer_token
from serving.logs import ThrottledLog

log = logging.getLogger(__name__)
_refused = ThrottledLog(log, "/metrics connections refused (MAX_CONNECTIONS)")

IO_TIMEOUT_S = 10.0
"""Socket timeout of each read and write of a ``/metrics`` connection, TLS handshake included (seconds)."""
CONNECTION_DEADLINE_S = 30.0
"""A ``/metrics`` connection is closed this long after it was accepted (seconds; a scrape takes milliseconds)."""
MAX_CONNECTIONS = 64
"""``/metrics`` connections served at once (each on a thread of its own); one more is closed at accept."""


class _Handler(_SilentHandler):
    timeout = IO_TIMEOUT_S  # MetricsHttpServer(io_timeout_s=...) sets its own subclass's

    def setup(self) -> None:
        super().setup()  # applies the timeout
        self._deadline = threading.Timer(CONNECTION_DEADLINE_S, _shut, (self.connection,))
        self._deadline.daemon = True
        self._deadline.start()
        if isinstance(self.connection, ssl.SSLSocket):
            try:
                self.connection.do_handshake()
            except BaseException:  # no finish() follows a failed setup(): the timer must not outlive it
                self._deadline.cancel()
                raise

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()


def _shut(sock: socket.socket) -> None:
    """End a connection past its deadline: its thread's blocked read returns at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class _Server(ThreadingWSGIServer):
    # socketserver's listen backlog is 5: a few connections opened at once (slow clients, several
    # scrapers) while the accepting thread waits for the CPU can fill it, and the next scraper's
    # connection then waits for its SYN's retransmission, a second later (a full test run here once
    # saw a scrape take 1.03 s behind 10 slow clients; not reproduced in isolation)
    request_queue_size = 128

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._active = 0  # connections being served (verify_request .. process_request_thread's end)
        self._active_lock = threading.Lock()

    def verify_request(self, request, client_address) -> bool:
        """Take a serving slot (False: :data:`MAX_CONNECTIONS` are taken; the connection is closed)."""
        with self._active_lock:
            if self._active >= MAX_CONNECTIONS:
                _refused.info(str(client_address[0]), "/metrics connection from %s refused: %d served at once",
                              client_address, MAX_CONNECTIONS)
                return False
            self._active += 1
            return True

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._active -= 1

    def handle_error(self, request, client_address) -> None:
        """A client that timed out, failed its handshake or left: one debug line, no traceback."""
        log.debug("/metrics connection from %s ended with an error", client_address, exc_info=True)


def _tls_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A server TLS context of ``cert_pem`` / ``key_pem`` (read through 0600 temporary files,
    removed at once: :mod:`ssl` loads certificates from files only)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    paths = []
    try:
        for data in (cert_pem, key_pem):
            fd, path = tempfile.mkstemp(prefix="pdcluster-tls-", suffix=".pem")
            paths.append(path)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(paths[0], paths[1])
    finally:
        for path in paths:
            os.unlink(path)
    return ctx


class MetricsHttpServer:
    """``GET /metrics`` of ``registry`` on ``host`` (any free port).

    Args:
        registry: the collectors to expose.
        host: where to listen.
        accepts_api_key: ``(key or None) -> bool``; when given, a request without an accepted
            ``Authorization: Bearer KEY`` gets 401. ``None``: open.
        tls: ``(certificate PEM, key PEM)`` to serve HTTPS with; ``None``: plain HTTP.
        io_timeout_s: socket timeout of each read and write of a connection (seconds; > 0).

    Raises:
        ValueError: ``io_timeout_s`` not positive.
    """

    def __init__(self, registry: CollectorRegistry, host: str,
                 accepts_api_key: Callable[[str | None], bool] | None = None,
                 tls: tuple[bytes, bytes] | None = None, io_timeout_s: float = IO_TIMEOUT_S) -> None:
        if not io_timeout_s > 0:
            raise ValueError(f"io_timeout_s must be positive, got {io_timeout_s}")
        self.host = host

        def app(environ, start_response):
            if environ.get("PATH_INFO") != "/metrics":
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found; metrics are at /metrics\n"]
            if accepts_api_key is not None and not accepts_api_key(bearer_token(environ.get("HTTP_AUTHORIZATION"))):
                start_response("401 Unauthorized", [("Content-Type", "text/plain")])
                return [b"missing or invalid API key: send 'Authorization: Bearer KEY'\n"]
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [generate_latest(registry)]

        self._http = make_server(host, 0, app, _Server,
                                 handler_class=type("Handler", (_Handler,), {"timeout": io_timeout_s}))
        if tls is not None:  # the handshake on the connection's own thread (_Handler.setup), not in accept
            self._http.socket = _tls_context(*tls).wrap_socket(self._http.socket, server_side=True,
                                                               do_handshake_on_connect=False)
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> str:
        """Serve on a daemon thread; returns ``host:port``."""
        self._thread.start()
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self._thread.is_alive():
            self._http.shutdown()
        self._http.server_close()

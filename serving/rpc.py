"""gRPC plumbing shared by the router and the workers: message limits, the health service, bounded
thread pools, explicit refusals with a retry-after hint, and the mark that tells a handler's own
status from a transport failure.

Servers and internal channels themselves are made by :mod:`serving.security`.

Queues are explicit: a server's thread pool is sized from what it admits
(:func:`pool_size`: running + queued + :data:`SPARE_THREADS` for fast refusals and control
calls), and a call beyond what it admits is refused at once (:func:`refuse`: RESOURCE_EXHAUSTED
with ``retry-after-ms`` trailing metadata) instead of waiting unseen in gRPC's queue.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Servers accept the router's keepalive pings (:func:`keepalive_options`) however often they
    # come, also on a stream that sends nothing for a while (a reservation waiting for blocks).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]

DEFAULT_MAX_QUEUED_REQUESTS = 256
"""Requests admitted beyond what the decode workers run (``pdcluster up --max-queued-requests``):
by the router over the whole cluster, by a decode worker beyond its own ``max_num_seqs``."""
SPARE_THREADS = 16
"""Threads of a server beyond what it admits: fast refusals, aborts, loads and health checks."""
RETRY_AFTER_METADATA = "retry-after-ms"
"""Trailing metadata of a RESOURCE_EXHAUSTED refusal: milliseconds after which a retry may succeed."""
HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a new connection may take to finish its handshake (TLS, and gRPC's HTTP/2 preface) on
any pdcluster port; later it is closed (gRPC's own default is 120 s, asyncio's TLS one 60 s: a
flood of connections that never start could hold a process's descriptors that long)."""
MAX_INTERNAL_CONNECTIONS = 1024
"""Connections a worker's internal gRPC port holds at once, handshakes included (its callers are
the cluster's routers and peer workers); one more is closed at accept."""
HANDLER_STATUS_METADATA = "x-pdcluster-handler-status"
"""Trailing metadata every pdcluster handler's status carries (:class:`MarkHandlerStatus`): the
server answered, so the status is its decision, not a transport failure."""


def receive_limit(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """:data:`GRPC_OPTIONS` with each incoming message capped at ``max_receive_bytes`` (a larger
    one fails with RESOURCE_EXHAUSTED before any handler runs): the cluster's internal limit by
    default, the router's public ``max_request_bytes`` on its public port."""
    return [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v) for k, v in GRPC_OPTIONS]


def connection_options(max_connections: int) -> list[tuple[str, int]]:
    """Server options bounding a port's connections: at most ``max_connections`` open at once,
    counted from accept (before any handshake), one more closed at once; each handshake within
    :data:`HANDSHAKE_TIMEOUT_S`.

    Raises:
        ValueError: ``max_connections`` is not positive.
    """
    if max_connections < 1:
        raise ValueError(f"max_connections must be positive, got {max_connections}")
    return [("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000))]


def keepalive_options(ping_s: float) -> list[tuple[str, int]]:
    """Channel options: while calls are open, ping the server every ``ping_s`` seconds and fail
    every call of the connection with UNAVAILABLE when a ping is not answered within ``ping_s``
    (a peer that stopped answering: paused, or its host gone without closing the socket).

    Raises:
        ValueError: ``ping_s`` is not positive.
    """
    if ping_s <= 0:
        raise ValueError(f"ping_s must be positive, got {ping_s}")
    ms = max(1, int(ping_s * 1000))
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms), ("grpc.http2.ping_timeout_ms", ms),
            ("grpc.http2.max_pings_without_data", 0)]


def pool_size(max_running: int, max_queued: int) -> int:
    """Threads of a server whose calls each hold one: ``max_running`` + ``max_queued`` admitted
    calls plus :data:`SPARE_THREADS`."""
    return max_running + max_queued + SPARE_THREADS


def refuse(context: grpc.ServicerContext, message: str, retry_after_ms: int) -> None:
    """End the call with RESOURCE_EXHAUSTED and ``retry-after-ms`` trailing metadata (kept with any
    trailing metadata already set); raises, as ``context.abort`` does."""
    context.set_trailing_metadata((*(context.trailing_metadata() or ()), (RETRY_AFTER_METADATA, str(retry_after_ms))))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def _trailing(call) -> Sequence[tuple[str, str]]:
    try:
        return call.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - a call object without trailers (e.g. failed before sending)
        return ()


def retry_after_ms(call) -> int | None:
    """The ``retry-after-ms`` hint of a finished call or :class:`grpc.RpcError` (``None``: none)."""
    for k, v in _trailing(call):
        if k == RETRY_AFTER_METADATA and v.isdigit():
            return int(v)
    return None


def handler_status(call) -> bool:
    """Whether a finished call's status came from a pdcluster handler (:class:`MarkHandlerStatus`),
    not from the transport (connection refused or lost, a ping timeout, a deadline)."""
    return any(k == HANDLER_STATUS_METADATA for k, _ in _trailing(call))


class MarkHandlerStatus(grpc.ServerInterceptor):
    """Marks the status of every ``pdcluster.v1`` call that reaches its handler with
    :data:`HANDLER_STATUS_METADATA`, so a caller can tell the server's own answer (any code)
    from a failure of the transport (no trailers at all)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/pdcluster.v1."):
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)

        def marked(request_or_iterator, context):
            context.set_trailing_metadata(((HANDLER_STATUS_METADATA, "1"),))
            return behavior(request_or_iterator, context)

        return handler._replace(**{kind: marked})


def add_health(server: grpc.Server) -> health.HealthServicer:
    """Attach a new standard ``grpc.health.v1`` service to ``server``; returns it."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, services: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        health_servicer.set(name, status)

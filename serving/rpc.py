"""gRPC plumbing shared by the router and the workers: message limits and the health service.

Servers and internal channels themselves are made by :mod:`serving.security`.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def receive_limit(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """:data:`GRPC_OPTIONS` with each incoming message capped at ``max_receive_bytes`` (a larger
    one fails with RESOURCE_EXHAUSTED before any handler runs): the cluster's internal limit by
    default, the router's public ``max_request_bytes`` on its public port."""
    return [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v) for k, v in GRPC_OPTIONS]


def add_health(server: grpc.Server) -> health.HealthServicer:
    """Attach a new standard ``grpc.health.v1`` service to ``server``; returns it."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, services: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        health_servicer.set(name, status)

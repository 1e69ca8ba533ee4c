"""gRPC server plumbing shared by the router and the workers."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def make_server(max_workers: int = 64, max_receive_bytes: int = MAX_MESSAGE_BYTES
                ) -> tuple[grpc.Server, health.HealthServicer]:
    """A threaded gRPC server with the standard ``grpc.health.v1`` service attached.

    ``max_receive_bytes`` caps each incoming message (a larger one fails with
    RESOURCE_EXHAUSTED before any handler runs): the cluster's internal limit by default,
    the router's public ``max_request_bytes`` on its public port.
    """
    options = [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v) for k, v in GRPC_OPTIONS]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Bind an insecure port (0 = any free port); returns the bound port.

    Raises:
        RuntimeError: the address could not be bound.
    """
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC server to {host}:{port}")
    return bound


def set_serving(health_servicer: health.HealthServicer, services: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        health_servicer.set(name, status)


def channel(address: str) -> grpc.Channel:
    """Insecure channel with the cluster's message-size limits."""
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)

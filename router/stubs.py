"""Cached gRPC channels and stubs to workers, by role and address."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from pdcluster.v1 import worker_pb2_grpc

_STUBS = {"decode": worker_pb2_grpc.DecodeWorkerStub, "prefill": worker_pb2_grpc.PrefillWorkerStub}


class StubCache:
    """One channel per worker address, shared by all requests (thread-safe).

    Args:
        connect: opens the channel to a worker's ``host:port`` (the router's internal
            channels: :func:`serving.security.internal_channel`, sending the cluster secret).
    """

    def __init__(self, connect: Callable[[str], grpc.Channel]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._stubs: dict[tuple[str, str], object] = {}

    def get(self, role: str, address: str):
        key = (role, address)
        with self._lock:
            stub = self._stubs.get(key)
            if stub is None:
                stub = _STUBS[role](self._connect(address))
                self._stubs[key] = stub
            return stub

"""Cached gRPC channels and stubs to workers, by role and address."""

from __future__ import annotations

import threading

from pdcluster.v1 import worker_pb2_grpc
from serving.rpc import channel

_STUBS = {"decode": worker_pb2_grpc.DecodeWorkerStub, "prefill": worker_pb2_grpc.PrefillWorkerStub}


class StubCache:
    """One channel per worker address, shared by all requests (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stubs: dict[tuple[str, str], object] = {}

    def get(self, role: str, address: str):
        key = (role, address)
        with self._lock:
            stub = self._stubs.get(key)
            if stub is None:
                stub = _STUBS[role](channel(address))
                self._stubs[key] = stub
            return stub

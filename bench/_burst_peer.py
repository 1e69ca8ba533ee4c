"""The floor peer of ``bench/overload.py``: a bare gRPC Python server with the ``Router``
service and nothing else. ``Generate`` admits ``CAPACITY`` concurrent calls (each sleeps 1 s,
then streams 16 empty messages) and refuses the others in its handler with RESOURCE_EXHAUSTED
and a ``retry-after-ms`` hint, as the router does, but without the router's work: what gRPC
Python itself costs on this machine for the same burst.

Prints its port, then serves until killed. Usage: ``python bench/_burst_peer.py CAPACITY``
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from pdcluster.v1 import router_pb2, router_pb2_grpc  # noqa: E402


class FloorRouter(router_pb2_grpc.RouterServicer):
    def __init__(self, capacity: int) -> None:
        self.capacity, self.held, self.lock = capacity, 0, threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            full = self.held >= self.capacity
            self.held += not full
        if full:
            context.set_trailing_metadata((("retry-after-ms", "1000"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        try:
            time.sleep(1.0)
            for _ in range(16):
                yield router_pb2.GenerateResponse()
        finally:
            with self.lock:
                self.held -= 1


if __name__ == "__main__":
    cap = int(sys.argv[1])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cap + 64))
    router_pb2_grpc.add_RouterServicer_to_server(FloorRouter(cap), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()

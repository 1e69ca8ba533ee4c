"""One burst of ``Generate`` calls sent at once from one thread on one channel (run as its own
process by ``bench/overload.py``, so the client is the same slim process for every target).

Prints one JSON object: for each call its status code name and its latency from send to
status (seconds), in send order.

Usage: ``python bench/_burst_client.py HOST:PORT N``
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from pdcluster.client import build_request  # noqa: E402
from pdcluster.v1 import router_pb2_grpc  # noqa: E402


def burst(address: str, n: int) -> list[tuple[str, float]]:
    """Send ``n`` streamed requests of 16 tokens at once; wait for every status (at most 300 s)."""
    results: dict[int, tuple[str, float]] = {}
    all_done = threading.Event()
    requests = [build_request(f"Count to {i}.", max_tokens=16, ignore_eos=True, temperature=0) for i in range(n)]
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(30)
        stub = router_pb2_grpc.RouterStub(channel)

        def done(call, i: int, t0: float) -> None:
            results[i] = (call.code().name, time.monotonic() - t0)
            if len(results) == n:
                all_done.set()

        calls = []
        gc.collect()
        gc.disable()
        for i, request in enumerate(requests):
            t0 = time.monotonic()
            call = stub.Generate(request, timeout=300)
            call.add_done_callback(lambda c, i=i, t0=t0: done(c, i, t0))
            calls.append(call)
        for call in calls:  # the admitted ones stream their tokens
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass
        all_done.wait(300)
        gc.enable()
    return [results[i] for i in sorted(results)]


if __name__ == "__main__":
    print(json.dumps(burst(sys.argv[1], int(sys.argv[2]))))

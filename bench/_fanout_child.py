"""One run of ``bench/stream_fanout.py`` (a variant in its own process) and its stream client.

The child prints one JSON line: ``step_ms_median`` and ``step_ms_mean`` over the measured steps (ms).
"""

from __future__ import annotations

import asyncio
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import torch

from pdcluster.v1 import worker_pb2

SERVICE, METHOD = "pdcluster.bench.Fanout", "Stream"
LINEARS_PER_STEP = 240
WARMUP_STEPS = 10
HIDDEN = 576


def _event(i: int) -> worker_pb2.DecodeEvent:
    return worker_pb2.DecodeEvent(tokens=worker_pb2.TokenDelta(token_ids=[i]))


class _Stepper:
    """Decode-step-sized torch work, then ``deliver(step)`` after each step; ``deliver(None)`` at the end."""

    def __init__(self, rows: int, steps: int) -> None:
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5 for _ in range(30)]
        self.x = torch.randn(rows, HIDDEN, generator=gen)
        self.steps = steps
        self.times: list[float] = []

    def step(self) -> None:
        y = self.x
        for _ in range(LINEARS_PER_STEP // len(self.weights)):
            for w in self.weights:
                y = torch.nn.functional.linear(y, w).tanh()

    def run(self, deliver) -> None:
        for i in range(WARMUP_STEPS + self.steps):
            t0 = time.perf_counter()
            self.step()
            if i >= WARMUP_STEPS:
                self.times.append(time.perf_counter() - t0)
            deliver(i)
        deliver(None)

    def result(self) -> dict:
        return {"step_ms_median": 1e3 * statistics.median(self.times),
                "step_ms_mean": 1e3 * statistics.fmean(self.times)}


def _start_client(script: str, port: int, streams: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, script, "--client", str(port), "--streams", str(streams)])


def _run_sync(stepper: _Stepper, streams: int, script: str, simple: bool) -> None:
    queues: list = []
    lock, ready = threading.Lock(), threading.Event()

    def handler(request, context):
        q = queue.SimpleQueue() if simple else queue.Queue()
        with lock:
            queues.append(q)
            if len(queues) == streams:
                ready.set()
        while True:
            try:
                i = q.get(timeout=0.5)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if i is None:
                return
            yield _event(i)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams + 8))
    rpc = grpc.unary_stream_rpc_method_handler(handler, response_serializer=worker_pb2.DecodeEvent.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = _start_client(script, port, streams)
    if not ready.wait(60):
        raise RuntimeError("the client's streams did not all arrive within 60 s")

    def deliver(i):
        for q in queues:
            q.put(i)

    stepper.run(deliver)
    _finish(client)
    server.stop(None)


async def _run_aio(stepper: _Stepper, streams: int, script: str) -> None:
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue] = []
    ready = threading.Event()

    async def handler(request, context):
        q: asyncio.Queue = asyncio.Queue()
        queues.append(q)
        if len(queues) == streams:
            ready.set()
        while (i := await q.get()) is not None:
            yield _event(i)

    server = grpc.aio.server()
    rpc = grpc.unary_stream_rpc_method_handler(handler, response_serializer=worker_pb2.DecodeEvent.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = _start_client(script, port, streams)
    if not await loop.run_in_executor(None, ready.wait, 60):
        raise RuntimeError("the client's streams did not all arrive within 60 s")

    def fan(i):
        for q in queues:
            q.put_nowait(i)

    await loop.run_in_executor(None, stepper.run, lambda i: loop.call_soon_threadsafe(fan, i))
    await loop.run_in_executor(None, _finish, client)
    await server.stop(None)


def _finish(client: subprocess.Popen) -> None:
    if client.wait(60) != 0:
        raise RuntimeError(f"the stream client exited with {client.returncode} (a stream lost messages)")


def child_main(variant: str, streams: int, steps: int, script: str) -> int:
    stepper = _Stepper(streams, steps)
    if variant == "none":
        stepper.run(lambda i: None)
    elif variant == "aio":
        asyncio.run(_run_aio(stepper, streams, script))
    else:
        _run_sync(stepper, streams, script, simple=variant == "sync_simplequeue")
    print(json.dumps(stepper.result()))
    return 0


def client_main(port: int, streams: int) -> int:
    """Read ``streams`` streams at once; exit 1 when one missed a message or repeated one."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_stream(f"/{SERVICE}/{METHOD}", response_deserializer=worker_pb2.DecodeEvent.FromString)
    bad: list[int] = []

    def read(k: int) -> None:
        expect = 0
        for ev in call(b""):
            if list(ev.tokens.token_ids) != [expect]:
                bad.append(k)
                return
            expect += 1

    threads = [threading.Thread(target=read, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    return 1 if bad else 0

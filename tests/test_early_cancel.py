"""Calls cancelled before their handler could register its cancel callback (real gRPC, loopback).

A gRPC Python server runs no termination callback registered after the call ended
(``add_callback`` returns False), and a handler may start late: on a busy worker the
thread pool runs it after the caller already cancelled (the router cancels a decode
worker's ``Reserve`` as soon as its client goes away, e.g. while the request is still
queued). Each handler here is held until its call's cancel has landed, which forces the
orderings the abort storm of ``test_e2e.py`` hit now and then:

* ``Reserve`` cancelled before its handler registered the abort callback: nothing may
  be reserved (it used to hold its blocks as a reservation nobody feeds until the
  transfer lease, 120 s by default, ran out);
* ``Reserve`` cancelled between registering the callback and queueing the reservation:
  the callback's abort reaches the scheduler first, so one more must follow;
* the same for ``Prefill`` (aborted at once) and the router's ``Generate`` (never placed);
* an abort of a reservation (by its transfer id) never ends a later one of the same id.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import Future

import grpc
import pytest

from decode_worker.events import Tokens
from decode_worker.server import DecodeWorkerServicer
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from prefill_worker.contracts import PrefillError
from prefill_worker.server import PrefillWorkerServicer
from router.service import RouterServicer
from serving.security import Plane, SecurityConfig, bind, internal_channel, make_server

from sched_helpers import BS, CPU, _decode_sched, _events, _no_decode_leak, _req, _reserve, model  # noqa: F401

OPEN = SecurityConfig()
SAMPLING = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True,
                                     repetition_penalty=1.0)


def _wait_cancelled(context, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while context.is_active():
        assert time.monotonic() < deadline, "the caller's cancel never landed"
        time.sleep(0.002)


class _Late:
    """Mixin: a handler calls :meth:`_begin` first, which returns once its caller has
    cancelled the call; ``finished`` is set when the handler is done."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.finished = threading.Event(), threading.Event()

    def _begin(self, context) -> None:
        self.entered.set()
        _wait_cancelled(context)

    def _late_stream(self, handler, request, context):
        """``handler``'s response stream, started once the caller cancelled; sets ``finished`` after it."""
        self._begin(context)
        try:
            yield from handler(request, context)
        finally:
            self.finished.set()


class _LateDecode(_Late, DecodeWorkerServicer):
    def Reserve(self, request, context):
        return self._late_stream(super().Reserve, request, context)


class _CancelOnQueue:
    """A decode scheduler whose caller's cancel lands (and the abort callback runs) just
    before the reservation is queued."""

    def __init__(self, sched) -> None:
        self.sched, self.call, self.aborted = sched, Future(), threading.Event()

    def submit_abort(self, *args) -> None:
        self.sched.submit_abort(*args)
        self.aborted.set()

    def submit_reserve(self, req, stream) -> None:
        self.call.result(timeout=5).cancel()
        assert self.aborted.wait(5), "the cancel callback did not run"
        self.sched.submit_reserve(req, stream)

    def __getattr__(self, name):
        return getattr(self.sched, name)


def _serve(add, servicer):
    server = make_server(OPEN, Plane.INTERNAL, max_workers=4)
    add(servicer, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0, OPEN, Plane.INTERNAL)}"
    server.start()
    return server, internal_channel(OPEN, address)


@pytest.fixture
def decode(model, model_config):
    _, sched = _decode_sched(model, model_config, lease_s=120.0)
    stop = threading.Event()
    loop = threading.Thread(target=sched.run, args=(stop,), daemon=True)
    loop.start()
    servers = []
    yield sched, servers
    for s in servers:
        s.stop(grace=None)
    stop.set()
    loop.join(timeout=10)


def _reserve_call(channel, rid: str):
    wreq = worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=list(range(100, 108)), sampling=SAMPLING)
    return worker_pb2_grpc.DecodeWorkerStub(channel).Reserve(
        worker_pb2.ReserveRequest(request=wreq, transfer_id=uuid.uuid4().hex), timeout=30)


def _settled(sched, rid: str, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sched.has_request(rid) or sched.kv.num_free != sched.kv.num_usable:
        assert time.monotonic() < deadline, f"{rid} still held after {timeout_s}s: {sched.load()}"
        time.sleep(0.01)
    _no_decode_leak(sched)


def test_reserve_cancelled_before_its_handler_ran_reserves_nothing(decode):
    sched, servers = decode
    servicer = _LateDecode(sched, "d0", "unused:0", BS, "float32", CPU)
    server, channel = _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer)
    servers.append(server)
    call = _reserve_call(channel, "early")
    assert servicer.entered.wait(5)
    call.cancel()
    assert servicer.finished.wait(5)
    _settled(sched, "early")
    assert sched.load()["num_finished"] == 0  # never reserved at all


def test_reserve_cancelled_while_being_queued_is_aborted(decode):
    sched, servers = decode
    proxy = _CancelOnQueue(sched)
    server, channel = _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
                             DecodeWorkerServicer(proxy, "d0", "unused:0", BS, "float32", CPU))
    servers.append(server)
    proxy.call.set_result(_reserve_call(channel, "between"))
    assert proxy.aborted.wait(5)
    _settled(sched, "between")


def test_abort_of_an_earlier_reservation_spares_a_later_one_of_the_same_id(model, model_config):
    _, sched = _decode_sched(model, model_config)
    old, new = _req("same", list(range(100, 108))), _req("same", list(range(100, 108)))
    new.transfer_id = "xfer-later"
    stream, _ = _reserve(sched, new)
    sched.submit_abort("same", old.transfer_id)  # the end of the earlier call, arriving late
    sched.step(block=False)
    assert sched.has_request("same") and _events(stream) == []
    sched.submit_abort("same", new.transfer_id)
    sched.step(block=False)
    assert _events(stream) == [Tokens([], [], "abort")] and not sched.has_request("same")
    _no_decode_leak(sched)


class _FakePrefillScheduler:
    def __init__(self) -> None:
        self.future: Future = Future()
        self.aborted: queue.Queue = queue.Queue()

    def submit(self, req, send, external) -> Future:
        return self.future

    def submit_abort(self, request_id: str) -> None:
        self.aborted.put(request_id)
        self.future.set_exception(PrefillError(grpc.StatusCode.CANCELLED, "request aborted"))


class _LatePrefill(_Late, PrefillWorkerServicer):
    def Prefill(self, request, context):
        self._begin(context)
        return super().Prefill(request, context)


def test_prefill_cancelled_before_its_handler_registered_is_aborted():
    sched = _FakePrefillScheduler()
    servicer = _LatePrefill(sched, lambda request, req: (None, None), "p0", CPU)
    server, channel = _serve(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer)
    try:
        wreq = worker_pb2.WorkerRequest(request_id="early-p", prompt_token_ids=[1, 2, 3], sampling=SAMPLING)
        fut = worker_pb2_grpc.PrefillWorkerStub(channel).Prefill.future(
            worker_pb2.PrefillRequest(request=wreq, transfer_id="t"), timeout=30)
        assert servicer.entered.wait(5)
        fut.cancel()
        assert sched.aborted.get(timeout=5) == "early-p"
    finally:
        if not sched.future.done():
            sched.future.set_exception(PrefillError(grpc.StatusCode.CANCELLED, "test over"))
        server.stop(grace=None)


class _FakeActive:
    def __init__(self) -> None:
        self.request_id, self.discarded, self.served, self.error = "early-r", threading.Event(), False, None

    def cancel(self) -> None:
        pass

    def discard(self, error=None) -> None:
        self.error = error
        self.discarded.set()

    def responses(self):
        self.served = True  # would place the request and reserve blocks on a decode worker
        yield router_pb2.GenerateResponse(request_id=self.request_id)


class _LateRouter(_Late, RouterServicer):
    def Generate(self, request, context):
        return self._late_stream(super().Generate, request, context)


def test_generate_cancelled_before_its_handler_registered_is_never_placed():
    active = _FakeActive()
    core = type("Core", (), {"start": lambda self, request, owner="": active})()
    servicer = _LateRouter(core, router_pb2.ModelInfo())
    server, channel = _serve(lambda s, srv: router_pb2_grpc.add_RouterServicer_to_server(s, srv), servicer)
    try:
        call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(request_id="early-r"))
        assert servicer.entered.wait(5)
        call.cancel()
        assert servicer.finished.wait(5)
        assert active.discarded.is_set() and not active.served
        assert active.error.code == grpc.StatusCode.CANCELLED  # counted as every request is
    finally:
        server.stop(grace=None)

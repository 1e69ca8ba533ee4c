"""Scripted workers on real gRPC (loopback), no model, and a ``RequestRouter`` over them: the
fixture behind the router's migration and request-ending tests (``tests/test_migration_router.py``,
``tests/test_router_endings.py``).

``ScriptedDecode`` streams a fixed token sequence once its KV "arrived" (the prefill call answered), and may
"die" after a few tokens (UNAVAILABLE) or refuse; ``ScriptedPrefill`` delivers the KV or fails; ``KvLedger``
records which transfers delivered or failed; ``ScriptedView`` stands in for the registry view (the placer
marks failed workers there).
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pdcluster.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from router.core import RequestRouter
from router.limits import Limits
from router.load import LoadTracker
from router.placement import Placer, make_policy
from router.policy import Signals
from router.stubs import StubCache
from router.validation import RequestValidator
from serving.metrics import ProcessMetrics
from serving.registry import WorkerInfo, WorkerLoadSnapshot
from serving.security import Plane, SecurityConfig, bind, internal_channel, make_server

OPEN = SecurityConfig()
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
TEXT = " one two three four five six seven eight nine ten eleven twelve"


class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams ``seq`` from the request's ``output_token_ids`` on, one token per event, once
    its KV "arrived" (the prefill call answered); ``die_after`` tokens then UNAVAILABLE."""

    def __init__(self, wid: str, seq: list[int], kv: "KvLedger", die_after: int | None = None,
                 refuse: grpc.StatusCode | None = None) -> None:
        self.wid, self.seq, self.kv, self.die_after, self.refuse = wid, seq, kv, die_after, refuse
        self.requests: list[worker_pb2.WorkerRequest] = []

    def Reserve(self, request, context):
        self.requests.append(request.request)
        if self.refuse is not None:
            context.abort(self.refuse, "request needs 99 KV blocks")
        yield worker_pb2.DecodeEvent(reservation=worker_pb2.KvDestination(worker_id=self.wid))
        if not self.kv.wait(request.transfer_id):
            context.abort(UNAVAILABLE, "KV transfer failed: prefill side failed: " + self.kv.why[request.transfer_id])
        k = len(request.request.output_token_ids)
        for i, tok in enumerate(self.seq[k:request.request.sampling.max_tokens]):
            if self.die_after is not None and i == self.die_after:
                context.abort(UNAVAILABLE, "Socket closed")
            last = k + i + 1 == request.request.sampling.max_tokens
            yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenDelta(
                token_ids=[tok], finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0))

    def FailTransfer(self, request, context):
        self.kv.fail(request.transfer_id, request.reason)
        return worker_pb2.FailTransferResponse(outcome=worker_pb2.FailTransferResponse.OUTCOME_FAILED)

    def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=False)


class KvLedger:
    """Which transfers delivered their KV (a prefill call answered) or failed."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done: set[str] = set()
        self.why: dict[str, str] = {}

    def deliver(self, tid: str) -> None:
        with self.cond:
            self.done.add(tid)
            self.cond.notify_all()

    def fail(self, tid: str, why: str) -> None:
        with self.cond:
            self.why[tid] = why
            self.cond.notify_all()

    def wait(self, tid: str) -> bool:
        with self.cond:
            assert self.cond.wait_for(lambda: tid in self.done or tid in self.why, timeout=10)
            return tid in self.done


class ScriptedPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, kv: KvLedger, fail: bool = False) -> None:
        self.kv, self.fail = kv, fail
        self.requests: list[worker_pb2.PrefillRequest] = []

    def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail:
            context.abort(UNAVAILABLE, "Socket closed")
        self.kv.deliver(request.transfer_id)
        return worker_pb2.PrefillResponse(cached_prompt_tokens=len(request.request.prompt_token_ids) +
                                          len(request.request.output_token_ids))


class ScriptedView:
    def __init__(self, workers) -> None:
        self.workers_list = workers
        self.marked: list[str] = []

    def workers(self, role=None):
        return [(w, WorkerLoadSnapshot(num_free_blocks=10, num_total_blocks=10)) for w in self.workers_list
                if (role is None or w.role == role) and w.worker_id not in self.marked]

    workers_now = workers

    def refresh(self) -> bool:  # a migration re-reads the registry: the scripted list is it
        return True

    def mark_unreachable(self, worker_id: str) -> None:
        self.marked.append(worker_id)


@pytest.fixture
def cluster(tokenizer):
    """``make(decodes, prefills, max_migrations)`` -> a RequestRouter over those servicers
    (worker ids in list order: d0, d1, ... / p0, ...)."""
    servers = []

    def make(decodes, prefills, max_migrations=3):
        infos = []
        for role, servicers, add in (("decode", decodes, worker_pb2_grpc.add_DecodeWorkerServicer_to_server),
                                     ("prefill", prefills, worker_pb2_grpc.add_PrefillWorkerServicer_to_server)):
            for i, servicer in enumerate(servicers):
                server = make_server(OPEN, Plane.INTERNAL, max_workers=8)
                add(servicer, server)
                port = bind(server, "127.0.0.1", 0, OPEN, Plane.INTERNAL)
                server.start()
                servers.append(server)
                infos.append(WorkerInfo(worker_id=f"{role[0]}{i}", role=role, address=f"127.0.0.1:{port}"))
        load = LoadTracker()
        view = ScriptedView(infos)
        return RequestRouter(RequestValidator(tokenizer, Limits(512, tokenizer.vocab_size + 100)), tokenizer,
                             Placer(view, make_policy("round_robin", Signals(load))), load,
                             ProcessMetrics("router", "router", "m"), StubCache(lambda a: internal_channel(OPEN, a)),
                             max_migrations=max_migrations)

    yield make
    for s in servers:
        s.stop(None)


def generate_all(router: RequestRouter, prompt: str, max_tokens: int, stop=(), stream=True):
    req = router_pb2.GenerateRequest(request_id="req-1", text=prompt, stream=stream, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, stop=list(stop)))
    return list(router.start(req).responses())


def metric_value(router: RequestRouter, name: str, **labels) -> float:
    return router.metrics.get(name, **labels)._value.get()


"""Request migration in the router (``router/core.py`` + ``router/migration.py``) against
scripted workers on real gRPC (loopback), no model: a decode worker that "dies" after a
few tokens (its stream ends with UNAVAILABLE), a prefill worker that fails, a decode
worker whose KV never comes (policy "error": ``FailTransfer`` ends its stream).

Checked: the client's stream goes on with no repeated or missing token; the next
workers get the tokens already streamed as ``output_token_ids`` under the attempt's own
request id; a stop string held back across the migration still cuts the text; usage and
the request statistics count each token once; the migration metric and the limit
(``max_migrations``, then UNAVAILABLE naming the cause; 0: the worker's own status);
refusals are not retried; the blame rules of :func:`router.migration.classify`; the
placement avoids failed workers; the ``--max-migrations`` flag is validated. Also the endings
around them: a stream closed after its stop string cancels the decode call; an abort before the
reservation answers, streamed or not, and counts as ``abort``; an abort or a client gone while a
migration waits for a worker (ABORT / CANCELLED, not UNAVAILABLE); an unexpected error on the router
(INTERNAL, counted, its seat freed).
"""

from __future__ import annotations

import re
import threading

import grpc
import pytest

from deploy.spec import spec_from_args
from pdcluster.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from router.core import RequestRouter
from router.errors import RouterError
from router.limits import Limits
from router.load import LoadTracker
from router.migration import Side, classify
from router.placement import Placer, make_policy
from router.policy import RequestContext, Signals
from router.server import RouterConfig
from router.stubs import StubCache
from router.validation import RequestValidator
from serving.metrics import ProcessMetrics
from serving.registry import WorkerInfo, WorkerLoadSnapshot
from serving.security import Plane, SecurityConfig, bind, internal_channel, make_server

from cli_helpers import parse_up

OPEN = SecurityConfig()
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
TEXT = " one two three four five six seven eight nine ten eleven twelve"


class _Decode(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams ``seq`` from the request's ``output_token_ids`` on, one token per event, once
    its KV "arrived" (the prefill call answered); ``die_after`` tokens then UNAVAILABLE."""

    def __init__(self, wid: str, seq: list[int], kv: "_Kv", die_after: int | None = None,
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


class _Kv:
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


class _Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, kv: _Kv, fail: bool = False) -> None:
        self.kv, self.fail = kv, fail
        self.requests: list[worker_pb2.PrefillRequest] = []

    def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail:
            context.abort(UNAVAILABLE, "Socket closed")
        self.kv.deliver(request.transfer_id)
        return worker_pb2.PrefillResponse(cached_prompt_tokens=len(request.request.prompt_token_ids) +
                                          len(request.request.output_token_ids))


class _View:
    def __init__(self, workers) -> None:
        self.workers_list = workers
        self.marked: list[str] = []

    def workers(self, role=None):
        return [(w, WorkerLoadSnapshot(num_free_blocks=10, num_total_blocks=10)) for w in self.workers_list
                if (role is None or w.role == role) and w.worker_id not in self.marked]

    workers_now = workers

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
        view = _View(infos)
        return RequestRouter(RequestValidator(tokenizer, Limits(512, tokenizer.vocab_size + 100)), tokenizer,
                             Placer(view, make_policy("round_robin", Signals(load))), load,
                             ProcessMetrics("router", "router", "m"), StubCache(lambda a: internal_channel(OPEN, a)),
                             max_migrations=max_migrations)

    yield make
    for s in servers:
        s.stop(None)


def _generate(router: RequestRouter, prompt: str, max_tokens: int, stop=(), stream=True):
    req = router_pb2.GenerateRequest(request_id="req-1", text=prompt, stream=stream, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, stop=list(stop)))
    return list(router.start(req).responses())


def _metric(router: RequestRouter, name: str, **labels) -> float:
    return router.metrics.get(name, **labels)._value.get()


def test_decode_death_resumes_on_another_decode_worker(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = _Kv()
    dying, healthy, prefill = _Decode("d0", seq, kv, die_after=4), _Decode("d1", seq, kv), _Prefill(kv)
    router = cluster([dying, healthy], [prefill])
    msgs = _generate(router, "Count:", len(seq))
    streamed = [t for m in msgs for t in m.token_ids]
    assert streamed == seq, "a token was repeated or lost"
    assert "".join(m.text for m in msgs) == TEXT
    assert re.fullmatch(r"req-1/[0-9a-f]{8}/migration-1", healthy.requests[0].request_id)
    assert dying.requests[0].request_id == healthy.requests[0].request_id.removesuffix("/migration-1")
    assert list(healthy.requests[0].output_token_ids) == seq[:4]
    assert list(prefill.requests[1].request.output_token_ids) == seq[:4]
    usage = msgs[-1].usage
    prompt_len = len(tokenizer.encode("Count:"))
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, len(seq))
    assert usage.cached_prompt_tokens == prompt_len  # the first prefill's answer, not the migration's
    assert _metric(router, "request_migrations", failed_role="decode") == 1
    assert _metric(router, "generation_tokens") == len(seq)
    assert _metric(router, "request_success", finished_reason="length") == 1
    assert router.placer.view.marked == ["d0"]
    assert router.load.in_flight("d0") == router.load.in_flight("d1") == router.load.in_flight("p0") == 0


def test_stop_string_held_back_across_a_migration(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    dies_at = len(tokenizer.encode(" one two three four", add_special_tokens=False))
    kv = _Kv()
    router = cluster([_Decode("d0", seq, kv, die_after=dies_at), _Decode("d1", seq, kv)], [_Prefill(kv)])
    for stream in (True, False):
        msgs = _generate(router, "Count:", len(seq), stop=[" four five"], stream=stream)
        assert "".join(m.text for m in msgs) == " one two three"
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_at_most_max_migrations_then_unavailable_naming_the_cause(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = _Kv()
    decodes = [_Decode("d0", seq, kv, die_after=1), _Decode("d1", seq, kv, die_after=1)]
    router = cluster(decodes, [_Prefill(kv)], max_migrations=3)
    router.placer.view.mark_unreachable = lambda wid: None  # both stay listed: tried again in turn
    with pytest.raises(RouterError) as exc:
        _generate(router, "Count:", len(seq))
    assert exc.value.code == UNAVAILABLE
    assert "failed after 3 migrations" in exc.value.message and "Socket closed" in exc.value.message
    assert sum(len(d.requests) for d in decodes) == 4
    assert [len(r.output_token_ids) for d in decodes for r in d.requests] == [0, 2, 1, 3]
    assert _metric(router, "request_migrations", failed_role="decode") == 3
    assert _metric(router, "request_errors", code="UNAVAILABLE") == 1


def test_no_migration_when_disabled_or_refused(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = _Kv()
    router = cluster([_Decode("d0", seq, kv, die_after=2), _Decode("d1", seq, kv)], [_Prefill(kv)],
                     max_migrations=0)
    with pytest.raises(RouterError) as exc:
        _generate(router, "Count:", len(seq))
    assert (exc.value.code, exc.value.message) == (UNAVAILABLE, "decode worker d0: Socket closed")
    refusing = _Decode("d0", seq, kv, refuse=grpc.StatusCode.RESOURCE_EXHAUSTED)
    router = cluster([refusing, _Decode("d1", seq, kv)], [_Prefill(kv)])
    with pytest.raises(RouterError) as exc:
        _generate(router, "Count:", len(seq))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _metric(router, "request_migrations", failed_role="decode") == 0


def test_failed_prefill_retries_on_another_prefill_worker(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = _Kv()
    dead, alive = _Prefill(kv, fail=True), _Prefill(kv)
    router = cluster([_Decode("d0", seq, kv)], [dead, alive])
    msgs = _generate(router, "Count:", len(seq))
    assert [t for m in msgs for t in m.token_ids] == seq
    assert len(dead.requests) == len(alive.requests) == 1
    assert re.fullmatch(r"req-1/[0-9a-f]{8}/migration-1", alive.requests[0].request.request_id)
    assert not alive.requests[0].request.output_token_ids
    assert _metric(router, "request_migrations", failed_role="prefill") == 1
    assert router.placer.view.marked == ["p0"]


@pytest.mark.parametrize("decode,prefill,role,suspects,lost", [
    # the decode worker died: its stream broke (the prefill may have failed to deliver as well)
    ((UNAVAILABLE, "Socket closed"), None, "decode", {"d"}, {"d"}),
    ((UNAVAILABLE, "Socket closed"), (UNAVAILABLE, "KV transfer failed: x"), "decode", {"d"}, {"d"}),
    ((grpc.StatusCode.INTERNAL, "decode step failed: boom"), None, "decode", {"d"}, set()),
    # the prefill worker died: the decode stream ends (policy "error") or was cancelled
    ((UNAVAILABLE, "KV transfer failed: prefill side failed: p"), (UNAVAILABLE, "Socket closed"),
     "prefill", {"p"}, {"p"}),
    ((grpc.StatusCode.CANCELLED, "Locally cancelled"), (UNAVAILABLE, "Socket closed"), "prefill", {"p"}, {"p"}),
    # the prefill worker could not deliver (decode unreachable): both suspected, none marked
    ((grpc.StatusCode.CANCELLED, "Locally cancelled"), (UNAVAILABLE, "KV transfer failed: timeout"),
     "prefill", {"p", "d"}, set()),
    # the decode worker's lease expired with no prefill failure known
    ((UNAVAILABLE, "KV transfer lease expired after 1.0s"), None, "prefill", {"p", "d"}, set()),
])
def test_classify_blames_the_failed_worker(decode, prefill, role, suspects, lost):
    f = classify(Side("decode", "d", *decode), Side("prefill", "p", *(prefill or (None, ""))))
    assert (f.role, set(f.suspects), set(f.lost), f.migratable) == (role, suspects, lost, True)
    refused = classify(Side("decode", "d", grpc.StatusCode.RESOURCE_EXHAUSTED, "too big"), Side("prefill", "p"))
    assert not refused.migratable


def test_placement_avoids_failed_workers_unless_none_is_left():
    infos = [WorkerInfo(worker_id=w, role=r, address="x:1") for w, r in
             (("d0", "decode"), ("d1", "decode"), ("p0", "prefill"))]
    placer = Placer(_View(infos), make_policy("least_loaded", Signals(LoadTracker())))
    request = RequestContext("r", [1, 2, 3])
    assert placer.place(request).decode.worker_id == "d0"
    got = placer.place(request, avoid=frozenset({"d0", "p0"}))
    assert (got.decode.worker_id, got.prefill.worker_id) == ("d1", "p0")  # p0 is the only prefill worker


def test_max_migrations_flag_and_config_are_validated():
    args = parse_up("--max-migrations", "5")
    assert spec_from_args(args, "redis://x:1").router.max_migrations == 5
    assert parse_up().max_migrations == 3
    with pytest.raises(SystemExit):
        parse_up("--max-migrations", "-1")
    with pytest.raises(ValueError, match=r"max_migrations must be an integer in \[0, 100\], got 101"):
        RouterConfig(model="m", model_path="/x", redis_url="redis://x:1", max_migrations=101)


class _Lingering(_Decode):
    """Streams ``seq`` at once, then waits (at most 10 s) for the router to cancel the call."""

    def __init__(self, seq: list[int], kv: _Kv, hold: threading.Event | None = None) -> None:
        super().__init__("d0", seq, kv)
        self.cancelled, self.hold = threading.Event(), hold

    def Reserve(self, request, context):
        context.add_callback(self.cancelled.set)
        if self.hold is not None:
            assert self.hold.wait(10)
        yield from super().Reserve(request, context)
        self.cancelled.wait(10)


def test_a_stream_closed_after_its_stop_string_cancels_the_decode_call(cluster, tokenizer):
    """The front door closes a stream once its final message (a stop string's) is out: the decode
    worker's call is cancelled then, not left to run to max_tokens."""
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = _Kv()
    decode = _Lingering(seq[:6], kv)
    router = cluster([decode], [_Prefill(kv)])
    req = router_pb2.GenerateRequest(request_id="req-1", text="Count:", stream=True, sampling=common_pb2.SamplingParams(
        max_tokens=len(seq), temperature=0.0, stop=[" three"]))
    active = router.start(req)  # held, as the HTTP front door holds its sub-requests: no GC cancels the call
    responses = active.responses()
    while not next(responses).finish_reason:
        pass
    responses.close()
    assert decode.cancelled.wait(5)
    assert _metric(router, "request_success", finished_reason="stop") == 1


@pytest.mark.parametrize("stream", [True, False])
def test_an_abort_before_the_reservation_answers_and_counts_as_abort(cluster, tokenizer, stream):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv, hold = _Kv(), threading.Event()
    router = cluster([_Lingering(seq, kv, hold)], [_Prefill(kv)])
    active = router.start(router_pb2.GenerateRequest(request_id="req-1", text="Count:", stream=stream,
                                                     sampling=common_pb2.SamplingParams(max_tokens=4)))
    responses = active.responses()
    threading.Timer(0.5, lambda: (router.abort("req-1"), hold.set())).start()
    last = next(responses)  # the non-streamed answer too: one message
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT and not last.token_ids
    responses.close()
    assert _metric(router, "request_success", finished_reason="abort") == 1
    assert router.metrics.get("request_errors", code="CANCELLED")._value.get() == 0


@pytest.mark.parametrize("ending", ["abort", "cancel"])
def test_an_abort_or_cancel_during_a_migrations_wait_ends_it_as_the_client_asked(cluster, tokenizer, ending):
    """The only decode worker died: the migration waits for a replacement. An abort meanwhile ends the
    request with finish reason ABORT (a success), a client gone with CANCELLED, never UNAVAILABLE."""
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = _Kv()
    router = cluster([_Decode("d0", seq, kv, die_after=2)], [_Prefill(kv)])
    active = router.start(router_pb2.GenerateRequest(request_id="req-1", text="Count:", stream=True,
                                                     sampling=common_pb2.SamplingParams(max_tokens=len(seq))))
    end = (lambda: router.abort("req-1")) if ending == "abort" else active.cancel
    timer = threading.Timer(1.0, end)
    timer.start()
    msgs = []
    try:
        for m in active.responses():
            msgs.append(m)
    except RouterError as e:
        assert ending == "cancel" and e.code == grpc.StatusCode.CANCELLED
    else:
        assert ending == "abort" and msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert [t for m in msgs for t in m.token_ids] == seq[:2]
        assert _metric(router, "request_success", finished_reason="abort") == 1
    timer.join()
    assert _metric(router, "request_errors", code="UNAVAILABLE") == 0
    assert router.load.in_flight("d0") == router.load.in_flight("p0") == 0


def test_an_unexpected_error_on_the_router_is_internal_and_counted(cluster, tokenizer):
    kv = _Kv()
    router = cluster([_Decode("d0", [5, 6], kv)], [_Prefill(kv)])

    def broken(*_a, **_k):
        raise RuntimeError("policy bug")

    router.placer.place = broken
    with pytest.raises(RouterError) as exc:
        _generate(router, "Count:", 2)
    assert exc.value.code == grpc.StatusCode.INTERNAL and "policy bug" in exc.value.message
    assert _metric(router, "request_errors", code="INTERNAL") == 1
    assert not router._table  # forgotten: its seat is free


class _Holding(_Prefill):
    """A prefill worker that never forgets a request id (as one still tearing down an aborted
    request's KV send): the same worker-side id again is refused with ALREADY_EXISTS."""

    def Prefill(self, request, context):
        if any(r.request.request_id == request.request.request_id for r in self.requests):
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request.request_id} is running")
        return super().Prefill(request, context)


def test_a_client_reusing_a_request_id_at_once_never_meets_its_earlier_request(cluster, tokenizer):
    """A client retries ``req-1`` right after its first ``req-1`` ended: the workers may still be
    tearing the first one down, and each admission reaches them under an id of its own."""
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = _Kv()
    prefill = _Holding(kv)
    router = cluster([_Decode("d0", seq, kv)], [prefill])
    for _ in range(2):
        assert [t for m in _generate(router, "Count:", 3) for t in m.token_ids] == seq[:3]
    first, second = (r.request.request_id for r in prefill.requests)
    assert first != second and first.startswith("req-1/") and second.startswith("req-1/")

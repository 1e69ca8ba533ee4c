"""How a request ends in the router (``router/core.py``) around its workers, against scripted
workers on real gRPC (loopback), no model (``tests/router_scripted.py``): a stream closed after its
stop string cancels the decode call; an abort before the reservation answers, streamed or not, and
counts as ``abort``; an abort or a client gone while a migration waits for a worker (ABORT /
CANCELLED, not UNAVAILABLE); an unexpected error on the router (INTERNAL, counted, its seat freed);
a client reusing a request id at once never meets its earlier request on a worker.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pdcluster.v1 import common_pb2, router_pb2
from router.errors import RouterError

from router_scripted import (TEXT, KvLedger, ScriptedDecode, ScriptedPrefill, cluster, generate_all,
                             metric_value)

__all__ = ["cluster"]  # the fixture, used by name

class _Lingering(ScriptedDecode):
    """Streams ``seq`` at once, then waits (at most 10 s) for the router to cancel the call."""

    def __init__(self, seq: list[int], kv: KvLedger, hold: threading.Event | None = None) -> None:
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
    kv = KvLedger()
    decode = _Lingering(seq[:6], kv)
    router = cluster([decode], [ScriptedPrefill(kv)])
    req = router_pb2.GenerateRequest(request_id="req-1", text="Count:", stream=True, sampling=common_pb2.SamplingParams(
        max_tokens=len(seq), temperature=0.0, stop=[" three"]))
    active = router.start(req)  # held, as the HTTP front door holds its sub-requests: no GC cancels the call
    responses = active.responses()
    while not next(responses).finish_reason:
        pass
    responses.close()
    assert decode.cancelled.wait(5)
    assert metric_value(router, "request_success", finished_reason="stop") == 1


@pytest.mark.parametrize("stream", [True, False])
def test_an_abort_before_the_reservation_answers_and_counts_as_abort(cluster, tokenizer, stream):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv, hold = KvLedger(), threading.Event()
    router = cluster([_Lingering(seq, kv, hold)], [ScriptedPrefill(kv)])
    active = router.start(router_pb2.GenerateRequest(request_id="req-1", text="Count:", stream=stream,
                                                     sampling=common_pb2.SamplingParams(max_tokens=4)))
    responses = active.responses()
    threading.Timer(0.5, lambda: (router.abort("req-1"), hold.set())).start()
    last = next(responses)  # the non-streamed answer too: one message
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT and not last.token_ids
    responses.close()
    assert metric_value(router, "request_success", finished_reason="abort") == 1
    assert router.metrics.get("request_errors", code="CANCELLED")._value.get() == 0


@pytest.mark.parametrize("ending", ["abort", "cancel"])
def test_an_abort_or_cancel_during_a_migrations_wait_ends_it_as_the_client_asked(cluster, tokenizer, ending):
    """The only decode worker died: the migration waits for a replacement. An abort meanwhile ends the
    request with finish reason ABORT (a success), a client gone with CANCELLED, never UNAVAILABLE."""
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = KvLedger()
    router = cluster([ScriptedDecode("d0", seq, kv, die_after=2)], [ScriptedPrefill(kv)])
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
        assert metric_value(router, "request_success", finished_reason="abort") == 1
    timer.join()
    assert metric_value(router, "request_errors", code="UNAVAILABLE") == 0
    assert router.load.in_flight("d0") == router.load.in_flight("p0") == 0


def test_an_unexpected_error_on_the_router_is_internal_and_counted(cluster, tokenizer):
    kv = KvLedger()
    router = cluster([ScriptedDecode("d0", [5, 6], kv)], [ScriptedPrefill(kv)])

    def broken(*_a, **_k):
        raise RuntimeError("policy bug")

    router.placer.place = broken
    with pytest.raises(RouterError) as exc:
        generate_all(router, "Count:", 2)
    assert exc.value.code == grpc.StatusCode.INTERNAL and "policy bug" in exc.value.message
    assert metric_value(router, "request_errors", code="INTERNAL") == 1
    assert not router._table  # forgotten: its seat is free


class _Holding(ScriptedPrefill):
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
    kv = KvLedger()
    prefill = _Holding(kv)
    router = cluster([ScriptedDecode("d0", seq, kv)], [prefill])
    for _ in range(2):
        assert [t for m in generate_all(router, "Count:", 3) for t in m.token_ids] == seq[:3]
    first, second = (r.request.request_id for r in prefill.requests)
    assert first != second and first.startswith("req-1/") and second.startswith("req-1/")

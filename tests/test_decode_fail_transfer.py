"""``DecodeWorker.FailTransfer`` end to end over real gRPC: the router's
:class:`router.handle.RequestHandle` sees a real ``Prefill`` call fail and tells a real
decode worker (scheduler loop running, KV from nowhere), which applies its policy.

* "error": the ``Reserve`` stream ends with UNAVAILABLE; the handle keeps the
  prefill error (the client gets the prefill worker's own status).
* "recompute": the stream goes on token-exact; the handle forgets the prefill error.
* A cancelled prefill call frees the decode side at once, under either policy, and so
  does a ``FailTransfer`` that cannot reach the decode worker.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid

import grpc
import pytest

from decode_worker.server import DecodeWorkerServicer
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.handle import RequestHandle
from serving.security import Plane, SecurityConfig, bind, internal_channel, make_server

from sched_helpers import (  # noqa: F401
    BS,
    CPU,
    _colocated,
    _decode_sched,
    _no_decode_leak,
    model,
    text_ids,
)

OPEN = SecurityConfig()  # these workers take calls without credentials


class _FailingPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """A prefill worker whose every ``Prefill`` ends with ``code``: ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message

    def Prefill(self, request, context):
        context.abort(self.code, self.message)


class _Decode:
    """A decode worker: scheduler loop thread + gRPC server (no KV receiver)."""

    def __init__(self, model, model_config, policy: str) -> None:
        self.runner, self.sched = _decode_sched(model, model_config, kv_failure_policy=policy)
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self.sched.run, args=(self.stop,), daemon=True)
        self.server = make_server(OPEN, Plane.INTERNAL, max_workers=8)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
            DecodeWorkerServicer(self.sched, "d0", "unused:0", BS, "float32", CPU), self.server)
        self.address = f"127.0.0.1:{bind(self.server, '127.0.0.1', 0, OPEN, Plane.INTERNAL)}"
        self.loop.start()
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)
        self.stop.set()
        self.loop.join(timeout=10)


@pytest.fixture
def serve():
    started = []

    def start(servicer_or_decode):
        started.append(servicer_or_decode)
        return servicer_or_decode

    yield start
    for s in started:
        if isinstance(s, _Decode):
            s.close()
        else:
            s.stop(grace=None)


def _prefill_server(code: grpc.StatusCode, message: str):
    server = make_server(OPEN, Plane.INTERNAL, max_workers=4)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_FailingPrefill(code, message), server)
    port = bind(server, "127.0.0.1", 0, OPEN, Plane.INTERNAL)
    server.start()
    return server, f"127.0.0.1:{port}"


def _open_request(decode_address: str, prompt: list[int], max_tokens: int):
    """What the router does up to the ``Prefill`` call: a handle with the decode
    worker's reservation open."""
    h = RequestHandle(f"req-{uuid.uuid4().hex[:8]}", fail_transfer_timeout_s=10.0)
    h.transfer_id = uuid.uuid4().hex
    h.decode_stub = worker_pb2_grpc.DecodeWorkerStub(internal_channel(OPEN, decode_address))
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, ignore_eos=True,
                                         repetition_penalty=1.0)
    wreq = worker_pb2.WorkerRequest(request_id=h.request_id, prompt_token_ids=prompt, sampling=sampling)
    h.d_call = h.decode_stub.Reserve(worker_pb2.ReserveRequest(request=wreq, transfer_id=h.transfer_id),
                                     timeout=120)
    dest = next(h.d_call).reservation
    return h, wreq, dest


def _prefill_fails(h: RequestHandle, prefill_address: str, wreq, dest) -> None:
    h.p_future = worker_pb2_grpc.PrefillWorkerStub(internal_channel(OPEN, prefill_address)).Prefill.future(
        worker_pb2.PrefillRequest(request=wreq, transfer_id=h.transfer_id, destination=dest), timeout=30)
    h.p_future.add_done_callback(h.on_prefill_done)


def _settled(sched, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sched.kv.num_free != sched.kv.num_usable or sched.load()["num_running"]:
        assert time.monotonic() < deadline, f"decode side not back at baseline: {sched.load()}"
        time.sleep(0.02)
    _no_decode_leak(sched)


UNAVAILABLE_MSG = "KV transfer failed: receiver rejected: corrupt: checksum mismatch"


def test_error_policy_ends_the_decode_stream(model, model_config, text_ids, serve):
    decode = serve(_Decode(model, model_config, "error"))
    prefill, p_addr = _prefill_server(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_MSG)
    serve(prefill)
    h, wreq, dest = _open_request(decode.address, text_ids[:20], 4)
    _prefill_fails(h, p_addr, wreq, dest)
    with pytest.raises(grpc.RpcError) as exc:
        list(h.d_call)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "KV transfer failed: prefill side failed" in exc.value.details()
    assert UNAVAILABLE_MSG in exc.value.details()
    assert h.prefill_error is not None and h.prefill_error.code() == grpc.StatusCode.UNAVAILABLE
    assert decode.sched.num_failed_transfers == 1
    _settled(decode.sched)


def test_recompute_policy_goes_on_token_exact(model, model_config, text_ids, serve):
    prompt = text_ids[:30]
    _, want = _colocated(model, model_config, prompt, 6)
    decode = serve(_Decode(model, model_config, "recompute"))
    prefill, p_addr = _prefill_server(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    serve(prefill)
    h, wreq, dest = _open_request(decode.address, prompt, 6)
    _prefill_fails(h, p_addr, wreq, dest)
    tokens = [t for ev in h.d_call for t in ev.tokens.token_ids]
    assert tokens == want
    deadline = time.monotonic() + 10
    while h.prefill_error is not None:  # the FailTransfer answer arrives on a gRPC thread
        assert time.monotonic() < deadline, "the handle kept the prefill error"
        time.sleep(0.02)
    load = worker_pb2_grpc.DecodeWorkerStub(internal_channel(OPEN, decode.address)).GetLoad(
        worker_pb2.GetLoadRequest(), timeout=5)
    assert load.num_kv_recomputes == 1 and load.num_failed_transfers == 1
    _settled(decode.sched)


@pytest.mark.parametrize("policy", ["error", "recompute"])
def test_cancelled_prefill_frees_the_decode_side_at_once(model, model_config, text_ids, serve, policy):
    decode = serve(_Decode(model, model_config, policy))
    prefill, p_addr = _prefill_server(grpc.StatusCode.CANCELLED, "destination blocks were released")
    serve(prefill)
    h, wreq, dest = _open_request(decode.address, text_ids[:20], 4)
    _prefill_fails(h, p_addr, wreq, dest)
    with pytest.raises(grpc.RpcError) as exc:
        list(h.d_call)
    assert exc.value.code() == grpc.StatusCode.CANCELLED
    _settled(decode.sched)
    assert decode.sched.num_kv_recomputes == 0 and decode.sched.num_failed_transfers == 0


def test_unreachable_decode_falls_back_to_cancelling(model, model_config, text_ids, serve):
    decode = serve(_Decode(model, model_config, "recompute"))
    prefill, p_addr = _prefill_server(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    serve(prefill)
    h, wreq, dest = _open_request(decode.address, text_ids[:20], 4)
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    h.decode_stub = worker_pb2_grpc.DecodeWorkerStub(internal_channel(OPEN, f"127.0.0.1:{dead_port}"))
    _prefill_fails(h, p_addr, wreq, dest)
    with pytest.raises(grpc.RpcError) as exc:
        list(h.d_call)
    assert exc.value.code() == grpc.StatusCode.CANCELLED
    _settled(decode.sched)
    assert decode.sched.num_kv_recomputes == 0

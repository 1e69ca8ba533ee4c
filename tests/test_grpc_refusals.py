"""The gRPC front door's refusals without a cluster (a fake request path behind the real servicer):
unparsable requests -> INVALID_ARGUMENT naming the field, counted and named with a minted id;
messages over ``max_request_bytes`` -> RESOURCE_EXHAUSTED; a refusal's ``x-request-id``."""

from __future__ import annotations

import types

import grpc
import pytest

from pdcluster.client import build_request
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.errors import RouterError
from router.decoding import bad_utf8_field, parse_or_refusal
from router.service import RouterServicer, add_router_service
from serving.rpc import receive_limit
from serving.security import Plane, SecurityConfig, make_server


class FakeCore:
    """Answers every request with one token; records what reached it."""

    admission = None  # no admission control

    def __init__(self):
        self.seen = []
        self.unparsable = []

    def refuse_unparsable(self, reason):
        self.unparsable.append(reason)
        return f"minted-{len(self.unparsable)}"

    def start(self, request, owner=""):
        self.seen.append(request)
        if request.text == "refuse":
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: refused")
        return types.SimpleNamespace(cancel=lambda: None, responses=lambda: iter([
            router_pb2.GenerateResponse(request_id="r", token_ids=[7], finish_reason=common_pb2.FINISH_REASON_LENGTH)]))

    def abort(self, request_id, owner=None):
        return request_id == "known"


@pytest.fixture(scope="module")
def router_server():
    core = FakeCore()
    server = make_server(SecurityConfig(), Plane.PUBLIC, max_workers=4, options=receive_limit(64 * 1024))
    add_router_service(RouterServicer(core, router_pb2.ModelInfo(model_name="fake")), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield core, channel
    server.stop(None)


def _raw_call(channel, method: str, data: bytes, streaming: bool):
    path = f"/pdcluster.v1.Router/{method}"
    if streaming:
        return list(channel.unary_stream(path, request_serializer=None, response_deserializer=None)(data, timeout=10))
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)(data, timeout=10)


@pytest.mark.parametrize(("request_", "old", "field"), [
    (router_pb2.GenerateRequest(text="hello"), b"hello", "text"),
    (router_pb2.GenerateRequest(request_id="abc", token_ids=router_pb2.TokenIds(ids=[1])), b"abc", "request_id"),
    (build_request([{"role": "user", "content": "ok"}, {"role": "user", "content": "hello"}]), b"hello",
     "messages.messages[1].content"),
    (build_request("x", stop=["a", "hello"]), b"hello", "sampling.stop[1]"),
])
def test_invalid_utf8_is_invalid_argument_naming_the_field(router_server, request_, old, field):
    core, channel = router_server
    data = request_.SerializeToString().replace(old, old[:1] + b"\xff" + old[2:])  # same length: still parses
    assert bad_utf8_field(router_pb2.GenerateRequest.DESCRIPTOR, data) == field
    with pytest.raises(grpc.RpcError) as exc:
        _raw_call(channel, "Generate", data, streaming=True)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == f"the request is not a valid pdcluster.v1.GenerateRequest: {field} is not valid UTF-8"
    assert request_ not in core.seen
    # counted and logged by the core as its own refusals are, under an id the client gets back
    assert core.unparsable[-1] == exc.value.details()
    assert dict(exc.value.trailing_metadata())["x-request-id"] == f"minted-{len(core.unparsable)}"


def test_other_methods_and_garbage_are_refused_too(router_server):
    core, channel = router_server
    with pytest.raises(grpc.RpcError) as exc:
        _raw_call(channel, "Abort", router_pb2.AbortRequest(request_id="kno").SerializeToString()[:-1] + b"\xff",
                  streaming=False)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id is not valid UTF-8" in exc.value.details()
    assert not any("AbortRequest" in reason for reason in core.unparsable)  # an Abort is no request
    with pytest.raises(grpc.RpcError) as exc:
        _raw_call(channel, "Generate", b"\x12\xff\xff", streaming=True)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in exc.value.details()
    assert parse_or_refusal(router_pb2.GenerateRequest)(b"\x12\x05hi").message().endswith("Wire format was corrupt")
    ok = router_pb2.AbortResponse.FromString(
        _raw_call(channel, "Abort", router_pb2.AbortRequest(request_id="known").SerializeToString(), streaming=False))
    assert ok.found


def test_messages_over_max_request_bytes_are_resource_exhausted(router_server):
    core, channel = router_server
    stub = router_pb2_grpc.RouterStub(channel)
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(router_pb2.GenerateRequest(text="x" * (64 * 1024)), timeout=10))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "65536" in exc.value.details()
    (msg,) = stub.Generate(router_pb2.GenerateRequest(text="y" * (60 * 1024)), timeout=10)
    assert list(msg.token_ids) == [7]
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(router_pb2.GenerateRequest(text="refuse"), timeout=10))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details() == "prompt: refused"


def test_a_refusal_echoes_only_an_id_metadata_can_carry(router_server):
    """A refused ``Generate`` carries its id as ``x-request-id``, unless the id is what was wrong with
    it (too long or not printable ASCII: no metadata could carry it)."""
    _, channel = router_server
    stub = router_pb2_grpc.RouterStub(channel)
    for rid, echoed in (("mine-1", True), ("x" * 300, False), ("a\x1fb", False)):
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(router_pb2.GenerateRequest(request_id=rid, text="refuse"), timeout=10))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(exc.value.trailing_metadata()).get("x-request-id") == (rid if echoed else None)


def test_a_request_without_an_id_takes_its_calls_x_request_id(router_server):
    """A tracing client's ``x-request-id`` metadata names a request whose ``request_id`` is empty (as the
    HTTP API's ``X-Request-Id``); a ``request_id`` of its own wins."""
    core, channel = router_server
    stub = router_pb2_grpc.RouterStub(channel)
    list(stub.Generate(router_pb2.GenerateRequest(text="hi"), metadata=(("x-request-id", "trace-7"),), timeout=10))
    assert core.seen[-1].request_id == "trace-7"
    list(stub.Generate(router_pb2.GenerateRequest(request_id="own", text="hi"),
                       metadata=(("x-request-id", "trace-8"),), timeout=10))
    assert core.seen[-1].request_id == "own"


def test_minted_request_ids_are_distinct_valid_and_not_a_sequence():
    """A request without an id gets one no client can predict (else it could take the next one
    first and have another client's request refused as ALREADY_EXISTS)."""
    from router.validation import mint_request_id, request_id_problem
    ids = [mint_request_id() for _ in range(20000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 and request_id_problem(i) is None for i in ids)
    assert len({i[:8] for i in ids}) > 19000  # no common prefix, no counter in the low digits
    assert len({i[-8:] for i in ids}) > 19000

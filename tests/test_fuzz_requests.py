"""Property-based requests against a live local cluster (hypothesis): every answer is a result
or INVALID_ARGUMENT / OUT_OF_RANGE / RESOURCE_EXHAUSTED (gRPC), a 2xx or 4xx (HTTP); never
INTERNAL / UNKNOWN / 5xx; no worker dies; every KV pool is back at baseline at the end.

gRPC: ``GenerateRequest``s with every prompt kind (text, token ids, chat messages with random
roles, none), sampling values drawn from each declared parameter's wire type (NaN, infinities,
negatives, huge counts, token ids outside the vocabulary), oversized prompts and messages, and
invalid UTF-8 written into a string field of the serialized message (which must be
INVALID_ARGUMENT); also raw random bytes. HTTP: JSON bodies for ``/v1/completions`` and
``/v1/chat/completions`` whose fields take plausible and random JSON values, and undecodable
bodies. Structured outputs on both: random regexes, grammars and schemas reach the workers' compiler. A valid request generates at most 3 tokens (or the default 16), so each is quick.

Budget: 560 generated requests (``pytest --slow``: 10x).
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.request
from collections import Counter

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParam, Shape, sampling_params
from pdcluster.v1 import common_pb2, router_pb2
from router.limits import CHAT_ROLES, DEFAULT_MAX_REQUEST_BYTES, MAX_CHAT_MESSAGES
from serving.registry import WorkerRegistry

from cluster_utils import assert_no_leak, running_cluster

MODEL = "smollm2-135m-instruct"
VOCAB = 49152
MAX_MODEL_LEN = 256  # a valid prompt (at most ~200 tokens, 4 per exotic character) always fits
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
MARK = "~~BAD~~"  # written into a string field, then replaced by invalid UTF-8 of the same length
NOT_UTF8 = b"\xff\xfe\xc3\x28\xa0\xa1\xe2"
_FIELD = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
_INT_RANGES = {FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1),
               FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1)}


def _settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", str(MAX_MODEL_LEN),
                         "--block-size", "16", "--num-kv-blocks", "96", "--heartbeat-s", "0.5") as state:
        with grpc.insecure_channel(state["router_address"]) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        yield state


@pytest.fixture(scope="module")
def workers(cluster):
    return {info.worker_id for info, _ in WorkerRegistry(cluster["redis_url"], cluster["cluster"]).live_workers()}


@pytest.fixture(autouse=True)
def _nothing_died_nothing_held(cluster, workers):
    yield
    assert_no_leak(cluster, timeout_s=15.0)
    alive = {info.worker_id for info, _ in WorkerRegistry(cluster["redis_url"], cluster["cluster"]).live_workers()}
    assert alive == workers, f"workers lost: {workers - alive}"


# ---- gRPC ---------------------------------------------------------------------------------------------------
# Each request is drawn in one of three modes: every field valid (must succeed), one field drawn
# from its whole wire type, or every field so. Invalid UTF-8 is then written into a string field
# of a quarter of them (must be INVALID_ARGUMENT).

_floats = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1e-45, 1e-20, 0.5, 1.0, 2.0, -2.0, 100.0,
                                                          -100.5, 3.4e38, math.inf, -math.inf, math.nan]))
_token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, 2**32 - 1))
_vocab_ids = st.integers(0, VOCAB - 1)
_plain_text = st.text(st.characters(exclude_categories=("Cc", "Cs"), include_characters="\n"), min_size=1,
                      max_size=40)  # every character is at least one token


def _wild_element(p: SamplingParam) -> st.SearchStrategy:
    """Values of one element (or scalar, or map value) of ``p``, over its whole wire type."""
    field = _FIELD[p.name]
    if p.shape is Shape.MAP:
        field = field.message_type.fields_by_name["value"]
    if p.token_ids:
        return _token_ids
    if field.type in _INT_RANGES:
        low, high = _INT_RANGES[field.type]
        return st.one_of(st.integers(max(low, -3), 25), st.integers(low, high))
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=8), st.text(min_size=250, max_size=300))
    return _floats


def _wild(p: SamplingParam) -> st.SearchStrategy:
    if p.name == "max_tokens":  # valid ones stay tiny so a request is quick
        return st.one_of(st.integers(1, 3), st.sampled_from([0, MAX_MODEL_LEN, 2**32 - 1]))
    if p.shape is Shape.MAP:
        return st.one_of(st.dictionaries(_token_ids, _wild_element(p), max_size=4),
                         st.just(dict.fromkeys(range(1025), 1.0)))
    if p.shape is Shape.REPEATED:
        return st.one_of(st.lists(_wild_element(p), max_size=4), st.lists(_wild_element(p), min_size=15, max_size=20))
    return _wild_element(p)


def _valid_number(p: SamplingParam, r) -> st.SearchStrategy:
    if p.type is int:
        return st.integers(int(r.low), int(min(r.high, r.low + 50)) if r.high is not None else int(r.low) + 50)
    return st.floats(r.low, r.high if r.high is not None else 4.0, exclude_min=r.low_open, exclude_max=r.high_open,
                     width=32)


def _valid(p: SamplingParam) -> st.SearchStrategy:
    """Values the declaration accepts (counts and lengths kept small)."""
    if p.name == "max_tokens":
        return st.integers(1, 3)
    if p.name == "min_tokens":  # at most max_tokens
        return st.integers(0, 1)
    if p.name == "truncate_prompt_tokens":  # -1, or 1 .. max_model_len - 1 (0 is refused, as vLLM does)
        return st.one_of(st.just(-1), st.integers(1, MAX_MODEL_LEN - 1))
    if p.type is bool:
        return st.booleans()
    if p.shape is Shape.MAP:
        return st.dictionaries(_vocab_ids, _valid_number(p, p.range), max_size=3)
    if p.shape is Shape.REPEATED:
        words = st.text(min_size=1, max_size=12)
        return st.lists(_vocab_ids if p.token_ids else words.filter(str.strip) if p.nonblank else words, max_size=3)
    return _valid_number(p, p.range) if p.range else st.integers(0, 50)


_valid_prompt = st.one_of(
    st.builds(lambda t: {"text": t}, _plain_text),
    st.builds(lambda ids: {"token_ids": router_pb2.TokenIds(ids=ids)}, st.lists(_vocab_ids, min_size=1, max_size=40)),
    st.builds(lambda ms: {"messages": router_pb2.MessageList(messages=ms)},
              st.lists(st.builds(common_pb2.ChatMessage, role=st.sampled_from(CHAT_ROLES),
                                 content=st.text(max_size=12)), min_size=1, max_size=3)),
)
_message = st.builds(common_pb2.ChatMessage, role=st.one_of(st.sampled_from(CHAT_ROLES), st.text(max_size=8)),
                     content=st.text(max_size=40))
_wild_prompt = st.one_of(
    st.builds(lambda t: {"text": t}, st.one_of(st.text(max_size=60), st.sampled_from([60_000, 5 * 1024 * 1024])
                                                .map(lambda n: "a" * n))),
    st.builds(lambda ids: {"token_ids": router_pb2.TokenIds(ids=ids)},
              st.one_of(st.lists(_token_ids, max_size=40), st.lists(_vocab_ids, min_size=MAX_MODEL_LEN - 8,
                                                                            max_size=MAX_MODEL_LEN + 8))),
    st.builds(lambda ms: {"messages": router_pb2.MessageList(messages=ms)},
              st.one_of(st.lists(_message, max_size=4), st.lists(_message, min_size=MAX_CHAT_MESSAGES + 1,
                                                                max_size=MAX_CHAT_MESSAGES + 3))),
    st.just({}),
)
_SO = common_pb2.StructuredOutputs
_valid_structured = st.one_of(st.none(), st.sampled_from([
    _SO(regex="[a-z ]{1,8}"), _SO(choice=["yes", "no"]), _SO(json_object=True, disable_any_whitespace=True),
    _SO(json='{"type": "integer"}'), _SO(grammar='root ::= "a" [0-9]*')]))
_grammarish = st.one_of(st.text(max_size=30), st.lists(st.sampled_from(
    ["root", " ::= ", '"', "a", "|", "(", ")", "*", "[", "]", "{", "}", "\\", "\n", ":", "?", "+", "{99}", "^"]),
    max_size=12).map("".join))
_wild_structured = st.one_of(  # the workers compile random constraints: refused, never a crash
    st.builds(lambda t: _SO(regex=t), _grammarish), st.builds(lambda t: _SO(grammar=t), _grammarish),
    st.builds(lambda t: _SO(json=t), st.one_of(st.text(max_size=30), st.builds(json.dumps, st.dictionaries(
        st.sampled_from(["type", "properties", "items", "enum", "$ref", "x"]),
        st.one_of(st.text(max_size=8), st.integers(), st.booleans(), st.lists(st.text(max_size=4))), max_size=3)))),
    st.builds(lambda c: _SO(choice=c), st.lists(st.text(max_size=8), max_size=300)),
    st.builds(_SO, json=st.text(max_size=5), regex=st.text(max_size=5), json_object=st.booleans(),
              disable_any_whitespace=st.booleans()))
_valid_id = st.one_of(st.just(""), st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12))
_wild_id = st.one_of(st.text(max_size=12), st.text(min_size=257, max_size=260))


@st.composite
def generate_requests(draw, modes=("valid", "one wild field", "wild")) -> tuple[bytes, str, bool]:
    """``(serialized GenerateRequest, mode, whether a string field holds invalid UTF-8)``."""
    mode = draw(st.sampled_from(modes))
    params = sampling_params()
    fields = ["request_id", "prompt", "structured_outputs", *(p.name for p in params)]
    wild = set(fields) if mode == "wild" else {draw(st.sampled_from(fields))} if mode != "valid" else set()
    req = router_pb2.GenerateRequest(request_id=draw(_wild_id if "request_id" in wild else _valid_id),
                                     stream=draw(st.booleans()),
                                     structured_outputs=draw(_wild_structured if "structured_outputs" in wild
                                                             else _valid_structured),
                                     **draw(_wild_prompt if "prompt" in wild else _valid_prompt))
    for p in params:
        if p.name == "max_tokens" or draw(st.booleans()):
            p.write(req.sampling, draw(_wild(p) if p.name in wild else _valid(p)))
    targets = [("request_id", req)] + ([("text", req)] if req.WhichOneof("prompt") == "text" else [])
    targets += [(f, m) for m in req.messages.messages[:2] for f in ("role", "content")]
    corrupt = draw(st.integers(0, 3)) == 0
    if corrupt:
        name, msg = draw(st.sampled_from(targets + [("stop", req.sampling)]))
        if name == "stop":
            msg.stop.append(MARK)
        else:
            setattr(msg, name, getattr(msg, name)[:5] + MARK)
    return req.SerializeToString().replace(MARK.encode(), NOT_UTF8), mode, corrupt


@st.composite
def mutated_requests(draw) -> bytes:
    """A valid serialized request with 1 to 4 bytes replaced, deleted or inserted."""
    data = bytearray(draw(generate_requests(modes=("valid",)))[0])
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["replace"] * 4 + ["delete", "insert"]))  # a replacement keeps the framing
        if edit == "insert" or i == len(data):
            data.insert(i, draw(st.integers(0, 255)))
        elif edit == "delete":
            del data[i]
        else:
            data[i] = draw(st.integers(0, 255))
    return bytes(data)


def _generate(channel: grpc.Channel, data: bytes) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_stream("/pdcluster.v1.Router/Generate", request_serializer=None,
                                response_deserializer=router_pb2.GenerateResponse.FromString)
    try:
        responses = list(call(data, timeout=120))
    except grpc.RpcError as e:
        return e.code(), e.details()
    assert responses and responses[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return grpc.StatusCode.OK, ""


def test_grpc_requests_are_answered_or_refused(cluster, fuzz_examples):
    answers: Counter = Counter()
    with grpc.insecure_channel(cluster["router_address"]) as channel:
        @_settings(fuzz_examples(150))
        @given(generate_requests())
        def check(request):
            data, mode, corrupt = request
            code, details = _generate(channel, data)
            answers[code.name] += 1
            assert code == grpc.StatusCode.OK or code in REFUSALS, (code, details)
            if corrupt and len(data) <= 4 * 1024 * 1024:
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "not valid UTF-8" in details, (code, details)
            elif mode == "valid" and not corrupt:
                assert code == grpc.StatusCode.OK, (code, details)

        check()
    print(f"gRPC answers: {dict(answers)}")
    assert answers["OK"] >= sum(answers.values()) // 10, answers  # the success path is exercised too


def test_raw_bytes_are_answered_or_refused(cluster, fuzz_examples):
    answers: Counter = Counter()
    with grpc.insecure_channel(cluster["router_address"]) as channel:
        @_settings(fuzz_examples(80))
        @given(st.one_of(st.binary(max_size=200), mutated_requests()))
        def check(data):
            code, details = _generate(channel, data)
            answers[code.name] += 1
            assert code == grpc.StatusCode.OK or code in REFUSALS, (code, details)

        check()
    print(f"raw-bytes answers: {dict(answers)}")


# ---- HTTP ---------------------------------------------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | _floats | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3),
                     max_leaves=6)
_ids = st.lists(_token_ids, max_size=8)
_small = st.one_of(st.integers(1, 2), st.sampled_from([0, -1, 17, 10**9, 2**64, "2", 1.5, None]))
_f32 = {"width": 32}
# field: (valid values, values from anywhere); the first two are in every body
_REQUIRED = {"model": (st.just(MODEL), st.one_of(st.just(MODEL), _json)),
             "max_tokens": (st.integers(1, 3), _small)}
_COMMON = {
    "n": (st.integers(1, 2), _small), "stream": (st.booleans(), _json),
    "temperature": (st.floats(0, 2, **_f32), st.one_of(_floats, _json)),
    "top_p": (st.floats(0, 1, exclude_min=True, **_f32), _floats),
    "top_k": (st.integers(0, 100), st.one_of(st.integers(-5, 10**6), _json)),
    "min_p": (st.floats(0, 1, **_f32), _floats), "seed": (st.integers(0, 2**64 - 1), _json),
    "stop": (st.one_of(st.text(min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8), max_size=3)),
             st.one_of(st.lists(st.text(max_size=300), max_size=20), _json)),
    "stop_token_ids": (st.lists(_vocab_ids, max_size=3), st.one_of(_ids, _json)),
    "presence_penalty": (st.floats(-2, 2, **_f32), _floats), "frequency_penalty": (st.floats(-2, 2, **_f32), _floats),
    "repetition_penalty": (st.floats(0.5, 2, **_f32), _floats), "ignore_eos": (st.booleans(), _json),
    "user": (st.text(max_size=10), _json),
    "logit_bias": (st.dictionaries(_vocab_ids.map(str), st.floats(-100, 100, **_f32), max_size=3),
                   st.one_of(st.dictionaries(st.one_of(_token_ids.map(str), st.text(max_size=4)), _json, max_size=3),
                             st.just({str(t): 1 for t in range(1025)}))),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), _json),
    "extra_field": (_json, _json),
    "structured_outputs": (st.sampled_from([{"choice": ["a", "b"]}, {"regex": "[0-9]{1,3}"}, {"json_object": True}]),
                           st.one_of(_json, st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar"]),
                                                            _json, max_size=2))),
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                        st.one_of(_json, st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "x"])},
                                                               optional={"json_schema": _json}))),
}
_valid_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}), max_size=2)
_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]), "text": _json}),
                  max_size=2)
_COMPLETION = {
    "prompt": (st.one_of(_plain_text, st.lists(_plain_text, min_size=1, max_size=3),
                         st.lists(_vocab_ids, min_size=1, max_size=20),
                         st.lists(st.lists(_vocab_ids, min_size=1, max_size=10), min_size=1, max_size=3)),
               st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3), _ids,
                         st.lists(_ids, max_size=3), _json)),
}
_COMPLETION_OPTIONAL = {"logprobs": (st.integers(0, 5), _json), "echo": (st.just(False), _json)}
_CHAT = {
    "messages": (st.lists(st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES),
                                                 "content": st.one_of(st.text(max_size=12), _valid_parts)}),
                          min_size=1, max_size=3),
                 st.one_of(st.lists(st.fixed_dictionaries(
                     {"role": st.one_of(st.sampled_from(CHAT_ROLES), st.text(max_size=6), _json)},
                     optional={"content": st.one_of(st.text(max_size=30), _parts, _json)}), max_size=3), _json)),
}
_CHAT_OPTIONAL = {"logprobs": (st.just(True), _json), "top_logprobs": (st.integers(0, 5), st.integers(-1, 25) | _json),
                  "max_completion_tokens": (st.integers(1, 3), _small)}


@st.composite
def http_bodies(draw) -> tuple[str, bytes, str]:
    """``(path, body, mode)``: a JSON body in one of the three modes of :func:`generate_requests`,
    or (mode ``"bytes"``) random bytes."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    mode = draw(st.sampled_from(["valid", "one wild field", "wild", "bytes"]))
    if mode == "bytes":
        return path, draw(st.binary(max_size=60)), mode
    required = {**_REQUIRED, **(_CHAT if chat else _COMPLETION)}
    optional = {**_COMMON, **(_CHAT_OPTIONAL if chat else _COMPLETION_OPTIONAL)}
    names = [*required, *optional]
    wild = set(names) if mode == "wild" else {draw(st.sampled_from(names))} if mode != "valid" else set()
    body = {name: draw(pair[name in wild]) for name, pair in required.items()}
    for name, pair in optional.items():
        if name in wild or draw(st.integers(0, 3)) == 0:
            body[name] = draw(pair[name in wild])
    if chat and "top_logprobs" in body and "top_logprobs" not in wild:
        body["logprobs"] = True  # top_logprobs needs logprobs
    if "stream_options" in body and not wild & {"stream_options", "stream"}:
        body["stream"] = True  # stream_options needs stream
    if "structured_outputs" in body and "response_format" in body and not wild:
        del body["response_format"]  # one constraint at a time
    return path, json.dumps(body).encode(), mode


def _post(base: str, path: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(base + path, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_http_bodies_are_answered_or_refused(cluster, fuzz_examples):
    base = f"http://{cluster['router_http_address']}"
    answers: Counter = Counter()

    @_settings(fuzz_examples(120))
    @given(http_bodies())
    def check(request):
        path, body, mode = request
        status, answer = _post(base, path, body)
        answers[status] += 1
        assert status < 500, (status, answer[:500])
        if status >= 400:
            assert "error" in json.loads(answer), answer[:500]
        if mode == "valid":
            assert status == 200, (status, answer[:500])
            assert answer.rstrip().endswith(b"data: [DONE]") if json.loads(body).get("stream") else json.loads(answer)

    check()
    print(f"HTTP answers: {dict(answers)}")
    assert answers[200] >= sum(answers.values()) // 10, answers


def test_http_body_over_max_request_bytes_is_413(cluster):
    """Refused from its declared length, before any of it is read (the default limit: 4 MiB)."""
    host, port = cluster["router_http_address"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(DEFAULT_MAX_REQUEST_BYTES + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()

"""The sampling-parameter declaration (:mod:`common.sampling_params`) and what derives
from it: the router's checks and resolved defaults, the client's keyword arguments,
the ``pdcluster generate`` flags and the engine's types."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
from google.protobuf.descriptor import FieldDescriptor

from common.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SAMPLING_PARAMS,
    Range,
    SamplingParam,
    Shape,
    Target,
    sampling_param,
    sampling_params,
    write_sampling,
)
from engine.request import RequestParams
from engine.sampling import SamplingOptions, make_generator
from pdcluster import cli
from pdcluster.client import build_request
from pdcluster.v1 import common_pb2
from router.limits import Limits
from router.validation import InvalidRequest, RequestValidator

LIMITS = Limits(max_model_len=64, vocab_size=1000)
NAN, INF = float("nan"), float("inf")
_PROTO_TYPES = {
    float: {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE},
    int: {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_INT64,
          FieldDescriptor.TYPE_UINT64},
    bool: {FieldDescriptor.TYPE_BOOL},
    str: {FieldDescriptor.TYPE_STRING},
}


def _prepare(**sampling):
    return RequestValidator(tokenizer=None, limits=LIMITS).prepare(build_request([1, 2, 3], **sampling))


# ---- the declaration against the proto and the engine types ----------------------------------


def test_declaration_matches_the_proto():
    fields = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert [p.name for p in SAMPLING_PARAMS] == [f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields]
    for p in SAMPLING_PARAMS:
        f = fields[p.name]
        is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
        assert is_map == (p.shape is Shape.MAP), p.name
        assert (f.is_repeated and not is_map) == (p.shape is Shape.REPEATED), p.name
        assert f.has_presence == p.presence, p.name
        value = f.message_type.fields_by_name["value"] if is_map else f
        assert value.type in _PROTO_TYPES[p.type], p.name


def test_declaration_matches_the_engine_types():
    options = {f.name: f.default for f in dataclasses.fields(SamplingOptions)}
    assert set(options) == {p.name for p in sampling_params(Target.SAMPLER)}
    assert all(options[p.name] == p.default for p in sampling_params(Target.SAMPLER))
    request = {f.name for f in dataclasses.fields(RequestParams)} - {"sampling"}
    assert request == {p.name for p in sampling_params(Target.REQUEST)}
    assert [p.name for p in sampling_params(Target.ROUTER)] == ["stop", "include_stop_str_in_output",
                                                              "truncate_prompt_tokens", "skip_special_tokens",
                                                              "bad_words"]
    assert sampling_param("logprobs").range == Range(0, MAX_LOGPROBS)
    with pytest.raises(KeyError):
        sampling_param("nope")


@pytest.mark.parametrize("kwargs", [
    dict(shape=Shape.REPEATED, presence=True), dict(shape=Shape.MAP, token_ids=True),
    dict(shape=Shape.MAP, cli=False), dict(context_limited=True), dict(default=0.5), dict(max_items=4),
    dict(shape=Shape.REPEATED, max_items=0), dict(shape=Shape.REPEATED, max_len=8), dict(nonblank=True),
])
def test_inconsistent_entries_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParam(**{"name": "x", "type": float, "default": 0.0, "help": "x", **kwargs})


@pytest.mark.parametrize(("rng", "inside", "outside", "text"), [
    (Range(0.0), [0.0, 1e30], [-1e-9, INF, NAN], ">= 0 and finite"),
    (Range(0.0, low_open=True), [1e-9, 5.0], [0.0, -1.0, INF, NAN], "> 0 and finite"),
    (Range(0.0, 1.0, low_open=True), [1e-9, 1.0], [0.0, 1.0 + 1e-9, NAN], "in (0, 1]"),
    (Range(-2.0, 2.0), [-2.0, 2.0], [-2.01, 2.01, NAN, -INF], "in [-2, 2]"),
    (Range(high=3.0, high_open=True), [-5.0, 2.9], [3.0, NAN], "< 3 and finite"),
    (Range(0.0, finite=False), [INF], [NAN, -1.0], ">= 0"),
])
def test_range_bounds_and_words(rng, inside, outside, text):
    assert all(rng.contains(v) for v in inside)
    assert not any(rng.contains(v) for v in outside)
    assert rng.describe(floating=True) == text


# ---- router validation derived from the declaration ------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(max_tokens=0), "sampling.max_tokens must be >= 1, got 0"),
    (dict(temperature=-0.5), "sampling.temperature must be >= 0 and finite, got -0.5"),
    (dict(temperature=INF), "sampling.temperature must be >= 0 and finite, got inf"),
    (dict(temperature=NAN), "sampling.temperature must be >= 0 and finite, got nan"),
    (dict(top_p=0.0), "sampling.top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "sampling.top_p must be in (0, 1], got 1.5"),
    (dict(top_p=NAN), "sampling.top_p must be in (0, 1], got nan"),
    (dict(top_k=-2), "sampling.top_k must be >= -1, got -2"),
    (dict(logprobs=MAX_LOGPROBS + 1), "sampling.logprobs must be in [0, 20], got 21"),
    (dict(stop=["a", ""]), "sampling.stop[1] must be non-empty"),
    (dict(bad_words=["a", " \n"]), "sampling.bad_words[1] is only whitespace"),
    (dict(stop=["s"] * (MAX_STOP_STRINGS + 1)), "sampling.stop has 17 entries; at most 16"),
    (dict(stop=["a", "x" * (MAX_STOP_CHARS + 1)]), "sampling.stop[1] has 257 characters; at most 256"),
    (dict(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
     "sampling.logit_bias has 1025 entries; at most 1024"),
    (dict(stop_token_ids=[5, 1000]), "sampling.stop_token_ids: token id 1000 >= vocab_size 1000"),
    (dict(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)), "sampling.stop_token_ids has 1025 entries; at most 1024"),
    (dict(min_p=-0.25), "sampling.min_p must be in [0, 1], got -0.25"),
    (dict(min_p=INF), "sampling.min_p must be in [0, 1], got inf"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty must be > 0 and finite, got 0.0"),
    (dict(repetition_penalty=INF), "sampling.repetition_penalty must be > 0 and finite, got inf"),
    (dict(presence_penalty=2.5), "sampling.presence_penalty must be in [-2, 2], got 2.5"),
    (dict(presence_penalty=NAN), "sampling.presence_penalty must be in [-2, 2], got nan"),
    (dict(frequency_penalty=-INF), "sampling.frequency_penalty must be in [-2, 2], got -inf"),
    (dict(logit_bias={1000: 1.0}), "sampling.logit_bias: token id 1000 >= vocab_size 1000"),
    (dict(logit_bias={3: -101.0}), "sampling.logit_bias[3] must be in [-100, 100], got -101.0"),
    (dict(logit_bias={3: NAN}), "sampling.logit_bias[3] must be in [-100, 100], got nan"),
    (dict(max_tokens=62), "sampling.max_tokens (62) + prompt (3 tokens) = 65 exceeds max_model_len 64"),
])
def test_router_refuses_out_of_range(kwargs, message):
    with pytest.raises(InvalidRequest, match=f"^{re.escape(message)}$"):
        _prepare(**kwargs)


def _edges(p: SamplingParam) -> list:
    """The accepted extremes of a numeric range (inclusive bounds; just inside open ones)."""
    r = p.range
    out = []
    for bound, is_open, step in ((r.low, r.low_open, 1), (r.high, r.high_open, -1)):
        if bound is not None:
            out.append(bound + step * (1e-6 if p.type is float else 1) if is_open else bound)
    return out


@pytest.mark.parametrize("param", [p for p in SAMPLING_PARAMS if p.shape is Shape.SCALAR and p.range],
                         ids=lambda p: p.name)
def test_router_accepts_every_bound(param):
    for value in _edges(param):
        if param.context_limited:
            value = min(value, LIMITS.max_model_len - 3)
        resolved = _prepare(**{param.name: value}).worker_request.sampling
        if param.target is not Target.ROUTER:
            assert getattr(resolved, param.name) == pytest.approx(value), (param.name, value)


def test_router_accepts_the_count_and_length_limits():
    validator = RequestValidator(None, Limits(max_model_len=64, vocab_size=2 * MAX_LOGIT_BIAS))
    stop = ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    prepared = validator.prepare(build_request([1, 2], stop=stop, logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS), 0.5)))
    assert prepared.stop == stop and len(prepared.worker_request.sampling.logit_bias) == MAX_LOGIT_BIAS
    assert sampling_param("stop").describe().endswith("at most 16 entries, each at most 256 characters; repeatable)")


def test_router_resolves_unset_fields():
    prepared = _prepare(stop=["END"], logit_bias={7: 1.5})
    s = prepared.worker_request.sampling
    assert s.max_tokens == 16 and s.temperature == 1.0 and s.top_p == 1.0 and s.repetition_penalty == 1.0
    assert s.HasField("temperature") and not s.HasField("seed")
    assert list(s.stop) == [] and prepared.stop == ["END"]  # router-only: never sent to the workers
    assert dict(s.logit_bias) == {7: 1.5}
    long_prompt = RequestValidator(None, LIMITS).prepare(build_request(list(range(60))))
    assert long_prompt.worker_request.sampling.max_tokens == 4  # clamped to what max_model_len leaves


# ---- the engine's own checks come from the declaration ----------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1.0), dict(temperature=INF), dict(temperature=NAN), dict(top_p=0.0), dict(top_p=NAN),
    dict(top_k=-2), dict(seed=-1), dict(seed=1 << 64), dict(logprobs=-1), dict(logprobs=21),
    dict(min_p=NAN), dict(repetition_penalty=0.0), dict(presence_penalty=-2.5), dict(frequency_penalty=NAN),
    dict(logit_bias={-1: 0.0}), dict(logit_bias={1: 100.5}),
])
def test_sampling_options_refuse_what_the_declaration_refuses(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingOptions(**kwargs)


def test_sampling_options_accept_the_bounds():
    opts = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, seed=(1 << 64) - 1, logprobs=20, min_p=1.0,
                           repetition_penalty=1e-6, presence_penalty=-2.0, frequency_penalty=2.0,
                           logit_bias={3: -100.0})
    assert opts.logit_bias == ((3, -100.0),)
    with pytest.raises(ValueError, match="seed"):
        make_generator(-1)


# ---- client keyword arguments and CLI flags ---------------------------------------------------


def test_client_refuses_unknown_keywords():
    with pytest.raises(TypeError, match="temprature"):
        build_request("x", temprature=0.5)
    req = build_request("x", **{p.name: None for p in SAMPLING_PARAMS})
    assert req.sampling == common_pb2.SamplingParams()  # None leaves every field unset


def test_cli_flags_come_from_the_declaration():
    flags = {a.option_strings[0]: a for a in _generate_parser()._actions if a.option_strings}
    expected = ["--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--min-p", "--repetition-penalty",
                "--presence-penalty", "--frequency-penalty", "--stop", "--stop-token-id", "--ignore-eos"]
    assert all(f in flags for f in expected)
    assert "--logprobs" not in flags and "--logit-bias" not in flags
    assert flags["--stop-token-id"].dest == "stop_token_ids"
    assert flags["--top-p"].help == "nucleus mass, 1 disables (in (0, 1]; unset: 1)"


def _generate_parser():
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices["generate"]


def test_every_float_range_refuses_nan():
    """Every float range refuses NaN (comparisons with NaN are False)."""
    for p in SAMPLING_PARAMS:
        if p.type is float and p.range is not None:
            assert not p.range.contains(math.nan), p.name


def test_a_value_protobuf_refuses_is_reported_with_its_parameters_name() -> None:
    from pdcluster.v1 import common_pb2

    # an integer beyond its field's width, named with the limit (a declared range is the router's to
    # check, but where the value is outside both, the declared one is named: the one a user must meet)
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1, got -1$"):
        write_sampling(common_pb2.SamplingParams(), {"max_tokens": -1})
    with pytest.raises(ValueError, match=r"^max_tokens must be <= 4294967295, got 1000000000000$"):
        write_sampling(common_pb2.SamplingParams(), {"max_tokens": 10**12})
    with pytest.raises(ValueError, match=r"^top_k must be >= -1, got -2147483649$"):
        write_sampling(common_pb2.SamplingParams(), {"top_k": -(1 << 31) - 1})
    # a repeated integer field: the element named, with its index (not protobuf's own message)
    with pytest.raises(ValueError, match=r"^stop_token_ids\[1\] must be >= 0, got -3$"):
        write_sampling(common_pb2.SamplingParams(), {"stop_token_ids": [7, -3]})
    with pytest.raises(ValueError, match=r"^stop_token_ids\[0\] must be <= 4294967295, got 4294967296$"):
        write_sampling(common_pb2.SamplingParams(), {"stop_token_ids": [1 << 32]})
    # types are strict, as in OpenAI's schema: a bool is no integer, nor 1 a bool; an integer is a float
    for values, message in (({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
                            ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a boolean, got 1"),
                            ({"max_tokens": True}, "max_tokens must be an integer, got True"),
                            ({"stop_token_ids": [1, 2.0]}, r"stop_token_ids must be a list of integers, got \[1, 2.0\]"),
                            ({"stop": [1]}, r"stop must be a list of strings, got \[1\]"),
                            ({"logit_bias": {5: "x"}}, "logit_bias must be a map of token ids to numbers, got {5: 'x'}")):
        with pytest.raises(TypeError, match=f"^{message}$"):
            write_sampling(common_pb2.SamplingParams(), values)
    write_sampling(common_pb2.SamplingParams(), {"temperature": 1, "stop": "x", "logit_bias": [(5, 1)]})
    # a ValueError subclass with other constructor arguments (UnicodeEncodeError), and a long value shortened
    with pytest.raises(ValueError, match=r"^stop: \['\\ud800', .*\.\.\.\] does not fit the field: .*surrogates"):
        write_sampling(common_pb2.SamplingParams(), {"stop": ["\ud800"] * 10_000})
    with pytest.raises(ValueError, match=r"^temperature: 1e\+308 does not fit the field: outside the range of a float32"
                       ):  # protobuf would store inf, refused as "got inf"
        write_sampling(common_pb2.SamplingParams(), {"temperature": 1e308})

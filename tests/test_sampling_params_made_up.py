"""Adding a sampling parameter touches the declaration, the proto and the sampler only
(``docs/adding_a_sampling_parameter.md``): this test adds a made-up ``made_up``
parameter that way and checks that the CLI flag, the client keyword, the router's
check and resolved default and the proto -> engine conversion all pick it up.

The proto change is simulated by a descriptor pool holding copies of
``common.proto`` (``SamplingParams`` plus ``optional float made_up = 99``), ``router.proto``
and ``worker.proto``; the sampler change by a ``SamplingOptions`` subclass with the
new field (its range check is inherited: it comes from the declaration).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import common.sampling_params as declaration
import pdcluster.client_types
import router.validation
import serving.convert
from common.sampling_params import Range, SamplingParam
from engine.sampling import SamplingOptions
from pdcluster import cli
from pdcluster.client import build_request
from pdcluster.v1 import common_pb2, router_pb2, worker_pb2
from router.limits import Limits
from router.validation import InvalidRequest, RequestValidator

MADE_UP = SamplingParam("made_up", float, 0.25, "a made-up knob", Range(0.0, 1.0), presence=True)


def _stubs_with_made_up_field() -> types.SimpleNamespace:
    """The three proto files in a fresh pool, ``SamplingParams`` with one more field."""
    pool = descriptor_pool.DescriptorPool()
    for module in (common_pb2, router_pb2, worker_pb2):
        fdp = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(fdp)
        if module is common_pb2:
            msg = next(m for m in fdp.message_type if m.name == "SamplingParams")
            msg.oneof_decl.add(name="_made_up")  # proto3 `optional`: a synthetic oneof
            msg.field.add(name="made_up", number=99, type=descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
                          label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL, json_name="madeUp",
                          proto3_optional=True, oneof_index=len(msg.oneof_decl) - 1)
        pool.Add(fdp)

    def cls(name):
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"pdcluster.v1.{name}"))

    return types.SimpleNamespace(SamplingParams=cls("SamplingParams"), GenerateRequest=cls("GenerateRequest"),
                                 WorkerRequest=cls("WorkerRequest"))


@pytest.fixture()
def made_up(monkeypatch):
    """The declaration + proto + sampler change of ``docs/adding_a_sampling_parameter.md``."""
    monkeypatch.setattr(declaration, "SAMPLING_PARAMS", declaration.SAMPLING_PARAMS + (MADE_UP,))
    stubs = _stubs_with_made_up_field()
    monkeypatch.setattr(pdcluster.client_types, "router_pb2", stubs)
    monkeypatch.setattr(router.validation, "common_pb2", stubs)
    monkeypatch.setattr(router.validation, "worker_pb2", stubs)
    options = dataclasses.make_dataclass("MadeUpOptions", [("made_up", float, dataclasses.field(default=0.25))],
                                         bases=(SamplingOptions,), frozen=True)
    monkeypatch.setattr(serving.convert, "SamplingOptions", options)
    return options


def test_cli_flag_and_client_keyword(made_up):
    args = cli.build_parser().parse_args(["generate", "--made-up", "0.5", "--top-k", "3", "x"])
    kwargs = cli._sampling_kwargs(args)
    assert kwargs["made_up"] == 0.5 and kwargs["top_k"] == 3
    assert build_request("x", **kwargs).sampling.made_up == 0.5
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["generate"]
    assert "a made-up knob (in [0, 1]; unset: 0.25)" in " ".join(sub.format_help().split())


def test_router_checks_and_resolves_it(made_up):
    validator = RequestValidator(tokenizer=None, limits=Limits(max_model_len=64, vocab_size=1000))
    for bad in (1.5, -0.5, float("nan"), float("inf")):
        with pytest.raises(InvalidRequest, match=r"^sampling\.made_up must be in \[0, 1\], got "):
            validator.prepare(build_request([1, 2, 3], made_up=bad))
    assert validator.prepare(build_request([1, 2, 3], made_up=0.5)).worker_request.sampling.made_up == 0.5
    unset = build_request([1, 2, 3])
    assert not unset.sampling.HasField("made_up")
    resolved = validator.prepare(unset).worker_request.sampling
    assert resolved.HasField("made_up") and resolved.made_up == 0.25  # the declared default


def test_worker_conversion_and_engine_check(made_up):
    validator = RequestValidator(tokenizer=None, limits=Limits(max_model_len=64, vocab_size=1000))
    prepared = validator.prepare(build_request([1, 2, 3], made_up=0.75, temperature=0.5))
    req = serving.convert.request_from_proto(prepared.worker_request, "t", torch.device("cpu"))
    assert req.params.sampling.made_up == 0.75 and req.params.sampling.temperature == 0.5
    with pytest.raises(ValueError, match=r"^made_up must be in \[0, 1\], got 2.0$"):
        made_up(made_up=2.0)

"""``pdcluster up --attention-backend``: declared once (engine.config.ATTENTION_BACKENDS, the
registry's names plus "auto"), validated in the worker config and at ``up`` against the device,
and reaching the model a worker loads."""

from __future__ import annotations

import dataclasses

import pytest

from cli_helpers import parse_up
from common.model_config import ConfigError
from deploy.spec import spec_from_args
from engine.attention import attention_backend_names
from engine.attention.torch_backend import paged_attention_batch_invariant, paged_attention_torch
from engine.config import ATTENTION_BACKENDS, CacheConfig, check_attention_backend
from serving.worker_config import WorkerConfig


def test_the_flag_lists_exactly_the_registered_backends_and_auto():
    assert ATTENTION_BACKENDS[0] == "auto"
    assert sorted(ATTENTION_BACKENDS[1:]) == attention_backend_names()


def test_flag_parsed_validated_and_passed_to_the_workers():
    assert parse_up().attention_backend == "auto"
    with pytest.raises(SystemExit):
        parse_up("--attention-backend", "flash")
    spec = spec_from_args(parse_up("--attention-backend", "batch-invariant"), "redis://127.0.0.1:1")
    assert spec.worker.attention_backend == "batch-invariant"
    assert spec.worker.runner_options()["attention_backend"] == "batch-invariant"
    with pytest.raises(ConfigError, match="--attention-backend 'triton' runs on CUDA only"):
        spec_from_args(parse_up("--attention-backend", "triton"), "redis://127.0.0.1:1")
    # its kernel is float32 only: with bfloat16 it would fall back to SDPA unseen (a helper's trial)
    with pytest.raises(ConfigError, match="'batch-invariant' needs float32.*got dtype 'bfloat16'"):
        spec_from_args(parse_up("--attention-backend", "batch-invariant", "--dtype", "bfloat16"),
                       "redis://127.0.0.1:1")
    # with tensor parallelism, `up` names its own flags (not the worker config's fields)
    with pytest.raises(ConfigError, match=r"--attention-backend sdpa needs --prefill-tp and --decode-tp 1"
                                          r".*'--decode-tp': 3"):
        spec_from_args(parse_up("--attention-backend", "sdpa", "--decode-tp", "3"), "redis://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"--quantization int8 needs --prefill-tp and --decode-tp 1"):
        spec_from_args(parse_up("--quantization", "int8", "--prefill-tp", "3"), "redis://127.0.0.1:1")


def test_worker_config_checks_the_backend():
    base = {"role": "decode", "worker_id": "w", "model": "m", "redis_url": "redis://x:1"}
    cfg = WorkerConfig(**base, attention_backend="sdpa")
    assert WorkerConfig.from_dict(dataclasses.asdict(cfg)).attention_backend == "sdpa"
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        WorkerConfig(**base, attention_backend="flash")
    with pytest.raises(ConfigError, match="runs on CPU only"):
        WorkerConfig(**base, device="cuda", attention_backend="batch-invariant")
    with pytest.raises(ConfigError, match="needs float32"):
        WorkerConfig(**base, dtype="bfloat16", attention_backend="batch-invariant")
    with pytest.raises(ConfigError, match="needs tensor parallelism off"):
        WorkerConfig(**base, attention_backend="torch", tp=2)
    assert check_attention_backend("triton", "cuda") == "triton"


def test_the_named_backend_is_the_one_the_model_runs():
    from engine.builder import build_runner
    from engine.model_loader import DEFAULT_MODEL

    cache = CacheConfig(num_blocks=8)
    _, runner = build_runner(DEFAULT_MODEL, cache, device="cpu", attention_backend="batch-invariant")
    assert runner.model.backend is paged_attention_batch_invariant
    _, runner = build_runner(DEFAULT_MODEL, cache, device="cpu")  # auto: float32 on CPU
    assert runner.model.backend is paged_attention_torch
    with pytest.raises(ConfigError, match="runs on CUDA only"):
        build_runner(DEFAULT_MODEL, cache, device="cpu", attention_backend="triton")
    with pytest.raises(ConfigError, match="not supported with tp=2"):
        build_runner(DEFAULT_MODEL, cache, tp=2, attention_backend="sdpa")

"""``--max-model-len`` must fit one worker's KV pool and the model's context (as vLLM refuses to
start otherwise); left out, it is 2048 or what the pool or the context holds when less. Every admitted request can then finish on one
worker, and a chat without ``max_tokens`` (the rest of the context) is never too long for it."""

from __future__ import annotations

import pytest

from common.model_config import ConfigError
from deploy.spec import DEFAULT_MAX_MODEL_LEN, fitted_max_model_len, spec_from_args

from cli_helpers import parse_up


def test_unset_is_the_default_or_what_the_pool_holds():
    assert fitted_max_model_len(None, 1000, 16) == DEFAULT_MAX_MODEL_LEN
    assert fitted_max_model_len(None, 65, 16) == 64 * 16  # the null block holds no tokens
    assert fitted_max_model_len(None, 1000, 16, context_len=512) == 512  # nor past the model's context


def test_a_set_value_that_fits_is_kept_and_one_that_does_not_is_refused():
    assert fitted_max_model_len(1024, 65, 16) == 1024
    with pytest.raises(ConfigError, match=r"--max-model-len 1025 does not fit one worker's KV pool: 64 usable "
                                          r"blocks of 16 tokens hold 1024 tokens"):
        fitted_max_model_len(1025, 65, 16)
    with pytest.raises(ConfigError, match=r"--max-model-len 9000 exceeds the model's context of 8192 tokens"):
        fitted_max_model_len(9000, 10000, 16, context_len=8192)  # as vLLM refuses it (newcomer finding)


def test_up_gives_the_router_and_the_workers_the_fitted_length():
    spec = spec_from_args(parse_up("--num-kv-blocks", "33"), "redis://127.0.0.1:1")
    assert spec.router.max_model_len == spec.worker.scheduler.max_model_len == 32 * 16
    spec = spec_from_args(parse_up("--max-model-len", "300"), "redis://127.0.0.1:1")
    assert spec.router.max_model_len == spec.worker.scheduler.max_model_len == 300
    with pytest.raises(ConfigError, match="--max-model-len 600"):
        spec_from_args(parse_up("--num-kv-blocks", "33", "--max-model-len", "600"), "redis://127.0.0.1:1")

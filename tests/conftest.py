"""Shared fixtures: the real model (dequantized once into the default cache); torch's thread count
for the CPU kernel tests."""

from __future__ import annotations

import os

from deploy.ray_env import use_loopback_ray

use_loopback_ray()  # local test clusters stay on loopback (before anything imports ray)

# This process is a Ray driver while `up`, `down` and `scale` run in it. Ray ends a driver whose GCS
# has been unreachable for 60 s with exit code 1 and one line on stderr, which pytest's output
# capture swallows: the whole run would stop there without a word. With an hour, such a loss
# fails the test it happened in, with its traceback. (The clusters' own Ray processes inherit
# it; nothing here waits for them to notice a lost GCS: `down` kills a head's whole session.)
os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "3600")

import pytest  # noqa: E402

from common.model_config import ModelConfig
from engine.model_loader import DEFAULT_MODEL, resolve_model

# Plain asserts in the shared scheduler helpers get pytest's introspection too.
pytest.register_assert_rewrite("sched_helpers")

SLOW_FACTOR = 10


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help=f"longer property-based runs: {SLOW_FACTOR}x the examples of tests/test_fuzz_*.py")


@pytest.fixture(scope="session")
def fuzz_examples(request):
    """``n -> `` the number of hypothesis examples to run (``n``, or ``SLOW_FACTOR x n`` with ``--slow``)."""
    factor = SLOW_FACTOR if request.config.getoption("--slow") else 1
    return lambda n: n * factor


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Runs the test at 1 and at 2 torch intra-op threads (the C++ kernels split work over them)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def model_config(model_dir):
    return ModelConfig.from_hf_folder(model_dir, name=DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

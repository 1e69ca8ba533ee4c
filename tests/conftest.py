"""Shared fixtures: the real model (dequantized once into the default cache)."""

from __future__ import annotations

from deploy.ray_env import use_loopback_ray

use_loopback_ray()  # local test clusters stay on loopback (before anything imports ray)

import pytest  # noqa: E402

from common.model_config import ModelConfig
from engine.model_loader import DEFAULT_MODEL, resolve_model

# Plain asserts in the shared scheduler helpers get pytest's introspection too.
pytest.register_assert_rewrite("sched_helpers")


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

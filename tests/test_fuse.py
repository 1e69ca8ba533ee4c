"""Merged projections (:mod:`engine.model.fuse`): a merged layer computes its parts' outputs end to end
(plain, int8 and Q4_1 layers, with and without biases), a whole tiny model gives the same logits merged
and unmerged (Qwen2 with q/k/v biases, Gemma 3 with q/k norms; plain and panel-packed weights), and
layers that cannot merge are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from common.model_config import ModelConfig
from engine.attention import SeqSlice, build_attention_metadata, get_attention_backend
from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import read_state
from engine.model.decoder import CausalLM
from engine.model.families import load_arch
from engine.model.fuse import CONCAT, merge_projections
from engine.model.linear import apply_linear_backend, default_linear_backend
from engine.model.quant import Int8Linear, Q4Linear


def _parts(bias: bool, sizes=(64, 32, 32), k: int = 96) -> list[nn.Linear]:
    g = torch.Generator().manual_seed(sum(sizes) + bias)
    parts = []
    for n in sizes:
        lin = nn.Linear(k, n, bias=bias).requires_grad_(False)
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
        parts.append(lin)
    return parts


@pytest.mark.parametrize("kind", ["dense", "int8", "q4"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_merged_layer_is_its_parts_end_to_end(kind, bias):
    parts = _parts(bias)
    if kind == "int8":
        parts = [Int8Linear.from_linear(p) for p in parts]
    elif kind == "q4":
        parts = [Q4Linear.from_linear(p) for p in parts]
    merged = CONCAT[type(parts[0])](parts)
    assert (merged.in_features, merged.out_features) == (96, 128)
    x = torch.randn(5, 96)
    with torch.inference_mode():
        want = torch.cat([p(x) for p in parts], dim=-1)
        got = merged(x)
    if kind == "dense":  # a BLAS may block a wider matrix differently: float rounding only
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    else:  # each output feature is computed alone by the quantized kernels
        assert torch.equal(got, want)


def _tiny(family: str, tmp_path, **overrides) -> tuple[ModelConfig, CausalLM]:
    from family_models import build_tiny

    folder = build_tiny(family, tmp_path / family, vocab_size=128, **overrides)
    cfg = ModelConfig.from_hf_folder(folder)
    model = CausalLM(cfg, load_arch(folder), get_attention_backend("torch")).requires_grad_(False)
    model.load_weights(read_state(folder))
    return cfg, model.eval()


def _logits(model: CausalLM, cfg: ModelConfig, prompts: list[list[int]]) -> torch.Tensor:
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=4, num_blocks=32), torch.device("cpu"))
    tables, at = [], 1
    for p in prompts:
        n = -(-len(p) // 4)
        tables.append(list(range(at, at + n)))
        at += n
    meta = build_attention_metadata([SeqSlice(0, len(p), t) for p, t in zip(prompts, tables)], 4,
                                    sliding_windows=model.sliding_windows)
    return model.compute_logits(model(torch.tensor([t for p in prompts for t in p]), meta, kv))


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", dict(use_sliding_window=False)),  # q/k/v biases
    ("gemma3", {}),  # q/k norms, sandwich norms
    ("llama3", {}),
])
@pytest.mark.parametrize("backend", ["torch", "default"])
def test_model_logits_are_the_same_merged(family, overrides, backend, tmp_path):
    cfg, model = _tiny(family, tmp_path, **overrides)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 1, 17)]
    merged = copy.deepcopy(model)
    assert merge_projections(merged) == 2 * cfg.num_layers
    for m in (model, merged):
        apply_linear_backend(m, default_linear_backend(torch.device("cpu"), torch.float32)
                             if backend == "default" else "torch")
    attn, mlp = merged.model.layers[0].self_attn, merged.model.layers[0].mlp
    assert attn.q_proj is None and attn.k_proj is None and attn.v_proj is None and attn.qkv_proj is not None
    assert mlp.gate_proj is None and mlp.up_proj is None and mlp.gate_up_proj is not None
    assert torch.allclose(_logits(merged, cfg, prompts), _logits(model, cfg, prompts), rtol=1e-4, atol=1e-4)


def test_layers_that_cannot_merge_stay_apart(tmp_path):
    _, model = _tiny("llama3", tmp_path)
    layer = model.model.layers[0]
    layer.self_attn.k_proj = Int8Linear.from_linear(layer.self_attn.k_proj)  # a mixed q/k/v
    layer.mlp.up_proj = nn.Identity()  # no concatenation rule
    assert merge_projections(model) == 2 * len(model.model.layers) - 2
    assert layer.self_attn.qkv_proj is None and layer.self_attn.q_proj is not None
    assert layer.mlp.gate_up_proj is None and layer.mlp.gate_proj is not None
    assert model.model.layers[1].self_attn.qkv_proj is not None

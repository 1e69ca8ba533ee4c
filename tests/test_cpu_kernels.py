"""The C++ CPU kernels (``engine/kernels/cpu/csrc``): fp32 GEMV (the int8 and Q4_1 ones:
``test_w8a8_kernel.py``, ``test_w4a8_kernel.py``) against float64 torch references over SmolLM2-135M's shapes and odd ones, at 1 and 2
threads, with and without bias; their argument checks; and the ``"gemv"`` linear backend
against HF (greedy tokens) on the real model.

Skipped, with the reason, where the extensions cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu.build import load
from engine.model.linear import GemvLinear

GEMV = load("gemv")
needs_gemv = pytest.mark.skipif(GEMV is None, reason="the gemv C++ extension could not be built here (see log)")

# (rows, out_features, in_features): SmolLM2's q/o, k/v, gate/up, down, a vocab slice; odd sizes
SHAPES = [(1, 576, 576), (3, 192, 576), (8, 1536, 576), (33, 576, 1536), (1, 4099, 576), (3, 7, 40),
          (8, 13, 1), (2, 5, 9)]


def _close(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    scale = ref.abs().max().item() + 1.0
    torch.testing.assert_close(y.double(), ref, atol=1e-6 * k ** 0.5 * scale, rtol=1e-5)


@needs_gemv
@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemv_f32_matches_reference(rows, n, k, with_bias, threads):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
    _close(GEMV.linear_f32(x, w, b), ref, k)


@needs_gemv
@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(2, 8, dtype=torch.float64)), "x must be"),
    (dict(x=torch.zeros(8)), "x must be"),
    (dict(w=torch.zeros(4, 9)), "K=9"),
    (dict(w=torch.zeros(8, 4).T), "weight must be contiguous"),
    (dict(w=torch.zeros(4, 8, dtype=torch.float16)), "weight must be"),
    (dict(b=torch.zeros(5)), "bias must be"),
])
def test_gemv_bad_arguments(bad, match):
    args = {"x": torch.zeros(2, 8), "w": torch.zeros(4, 8), "b": torch.zeros(4)} | bad
    with pytest.raises(RuntimeError, match=match):
        GEMV.linear_f32(args["x"], args["w"], args["b"])


@needs_gemv
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("rows", [1, 4, 5, 40])
def test_gemv_linear_module_any_rows(rows, packed):
    """GEMV below ``max_rows``, oneDNN / F.linear above: the same function of the input."""
    lin = torch.nn.Linear(576, 193)
    mod = GemvLinear(lin.weight, lin.bias, packed=packed)
    x = torch.randn(2, rows, 576)
    with torch.inference_mode():
        torch.testing.assert_close(mod(x), lin(x), atol=1e-4, rtol=1e-4)
    assert mod.weight is lin.weight  # a contiguous parameter is shared, not copied


def test_gemv_linear_rejects_non_float32():
    with pytest.raises(ValueError, match="CPU float32"):
        GemvLinear(torch.zeros(4, 8, dtype=torch.float64))


@needs_gemv
@pytest.mark.parametrize("backend", ["gemv", "gemv_packed", "panel"])
def test_gemv_backend_greedy_matches_hf(model_config, hf_model, tokenizer, backend):
    """Batch-1 greedy decode of SmolLM2-135M with the GEMV and panel backends: HF's tokens exactly."""
    from engine.config import CacheConfig
    from engine.kv_cache import allocate_kv_cache
    from engine.model import load_model
    from engine.model_runner import ModelRunner
    from engine.sampling import SamplingOptions
    from engine.step import ScheduledSeq, StepPlan

    model = load_model(model_config, torch.device("cpu"), torch.float32, linear_backend=backend)
    if backend != "panel":
        assert isinstance(model.lm_head, GemvLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    runner = ModelRunner(model, allocate_kv_cache(model_config, CacheConfig(block_size=16, num_blocks=8),
                                                  torch.device("cpu")), 16)
    ids = tokenizer("Once upon a time, in a small village at the edge of a dark forest,")["input_ids"]
    table, greedy, out = [0, 1, 2, 3], SamplingOptions(temperature=0.0), []
    for step in range(12):
        toks = ids if step == 0 else [out[-1]]
        num_computed = 0 if step == 0 else len(ids) + len(out) - 1
        res = runner.execute(StepPlan([ScheduledSeq("r", toks, num_computed, table, True, greedy)]))
        out.append(res.token_ids[0])
    with torch.inference_mode():  # plain argmax through HF's own KV cache (no generation-config processors)
        o = hf_model(torch.tensor([ids]), use_cache=True)
        ref = [int(o.logits[0, -1].argmax())]
        while len(ref) < len(out):
            o = hf_model(torch.tensor([[ref[-1]]]), cache=o.cache, use_cache=True)
            ref.append(int(o.logits[0, -1].argmax()))
    assert out == ref

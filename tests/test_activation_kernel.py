"""The C++ gated activation (``engine/kernels/cpu/csrc/activation.cpp``): ``silu_and_mul`` bit-identical to
``F.silu(gate) * up`` for decode and prefill row counts, sizes with and without elements left over after its
vector loop, special values and strided input, its argument check, and the
decoder's MLP taking it for SiLU on CPU (and not for Gemma's GELU).

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu.activation import silu_and_mul, silu_and_mul_reference, supports
from engine.kernels.cpu.build import load

pytestmark = pytest.mark.skipif(load("activation") is None, reason="the activation extension could not be built")


# intermediate sizes: whole pairs of AVX2 / AVX-512 vectors, and with elements left over for the scalar loop
@pytest.mark.parametrize("shape", [(1, 3072), (33, 3072), (4, 5, 16), (2, 2), (3, 66), (2, 200), (1, 2 * 6912),
                                   (512, 96)], ids=str)
def test_bit_identical_to_torch(shape, threads):
    for scale in (1.0, 4.0, 30.0):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * scale
        out = silu_and_mul(x)
        assert out.shape == (*shape[:-1], shape[-1] // 2) and torch.equal(out, silu_and_mul_reference(x)), scale
    strided = torch.randn(shape[-1], 3).T  # rows not contiguous
    assert torch.equal(silu_and_mul(strided), silu_and_mul_reference(strided))


@pytest.mark.parametrize("threads_n", [3, 5])
def test_bit_identical_where_a_thread_starts_inside_a_row(threads_n):
    """ATen splits the elements over threads, not the rows: with 3 threads, 8 rows of Qwen2.5-1.5B's 8960 split
    mid-row at an offset its vector loop then starts from."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads_n)
    try:
        for shape in ((8, 2 * 8960), (7, 2 * 6912), (64, 3072)):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 6
            assert torch.equal(silu_and_mul(x), silu_and_mul_reference(x)), shape
    finally:
        torch.set_num_threads(before)


def test_special_values_as_torch():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 88.0, -88.0, -104.0, 1e-40, -1e-40] * 4)
    x = torch.cat([x, x.flip(0)])[None]
    out, want = silu_and_mul(x), silu_and_mul_reference(x)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_odd_last_dimension_raises():
    assert supports(torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match=r"gate_up must be \[\.\.\., 2 \* intermediate\]"):
        silu_and_mul(torch.zeros(2, 5))


def test_mlp_uses_it_for_silu_only(monkeypatch):
    from common.model_config import ModelConfig
    from engine.model.decoder import MLP
    calls = []
    monkeypatch.setattr("engine.kernels.cpu.activation.silu_and_mul", lambda g: calls.append(g) or silu_and_mul(g))
    cfg = ModelConfig(name="t", path="", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32,
                      tie_word_embeddings=True)
    for activation, used in (("silu", True), ("gelu_pytorch_tanh", False)):
        arch = type("A", (), {"mlp_bias": False, "activation": activation})()
        mlp = MLP(cfg, arch)
        mlp.gate_up_proj = torch.nn.Linear(8, 24, bias=False)
        x = torch.randn(3, 8)
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        with torch.no_grad():
            assert torch.equal(mlp(x), mlp.down_proj(mlp.act(gate) * up))
        assert bool(calls) == used
        calls.clear()

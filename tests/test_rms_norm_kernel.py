"""The C++ RMSNorm kernel (``engine/kernels/cpu/csrc/rms_norm.cpp``): as close to a float64 RMSNorm as
HF's float32 expression is (Llama's and Gemma's forms, decode and prefill row counts, 1 and 2
threads), its argument checks, and the decoder's :class:`RMSNorm` taking it on CPU float32.

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu.build import load
from engine.kernels.cpu.rms_norm import add_rms_norm_cpu, rms_norm_cpu, rms_norm_reference, supports
from engine.model.decoder import RMSNorm

needs_kernel = pytest.mark.skipif(load("rms_norm") is None, reason="the rms_norm extension could not be built")

# (rows..., dim): SmolLM2 decode / prefill, q/k norm over heads (Qwen3, Gemma 3), Gemma's hidden, odd
SHAPES = [(1, 576), (7, 576), (300, 576), (4, 9, 64), (2, 4, 256), (3, 640), (5, 100), (2, 5)]


def _float64_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())


@needs_kernel
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_is_as_close_to_float64_as_hf(shape, offset, threads):
    g = torch.Generator().manual_seed(sum(shape))
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    exact = _float64_norm(x, w, 1e-6, offset)
    out = rms_norm_cpu(x, w, 1e-6, offset)
    ref = rms_norm_reference(x, w, 1e-6, offset)
    assert out.shape == x.shape and out.dtype == torch.float32
    scale = exact.abs().max().item()
    hf_err = (ref.double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= max(2 * hf_err, 4e-7 * scale)


@needs_kernel
def test_non_contiguous_input_and_zero_rows():
    x = torch.randn(6, 576)[::2]
    w = torch.randn(576)
    assert torch.allclose(rms_norm_cpu(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), atol=1e-5)
    assert rms_norm_cpu(torch.empty(0, 576), w, 1e-5).shape == (0, 576)


@needs_kernel
@pytest.mark.parametrize("x,w,eps,match", [
    (torch.randn(2, 8).double(), torch.ones(8), 1e-5, "x must be a contiguous CPU float32"),
    (torch.randn(2, 8), torch.ones(8).double(), 1e-5, "weight must be a contiguous CPU float32"),
    (torch.randn(2, 8), torch.ones(7), 1e-5, r"weight must be \[D = 8\]"),
    (torch.randn(2, 8), torch.ones(8), -1.0, "eps must be >= 0"),
], ids=["x-dtype", "w-dtype", "w-shape", "eps"])
def test_bad_arguments_raise_naming_them(x, w, eps, match):
    with pytest.raises(RuntimeError, match=match):
        rms_norm_cpu(x, w, eps)


@needs_kernel
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_decoder_norm_takes_the_kernel_on_cpu_float32(offset):
    norm = RMSNorm(576, 1e-5, offset)
    norm.weight.data = torch.randn(576)
    x = torch.randn(3, 576)
    assert supports(x, norm.weight)
    assert torch.equal(norm(x), rms_norm_cpu(x, norm.weight, 1e-5, offset))
    assert not supports(x.double(), norm.weight.double())  # other dtypes: HF's expression
    assert torch.equal(norm.double()(x.double()), rms_norm_reference(x.double(), norm.weight, 1e-5, offset))


@needs_kernel
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", [(1, 576), (300, 576), (4, 9, 64), (2, 5)], ids=str)
def test_fused_add_norm_adds_in_place_bit_for_bit(shape, offset, threads):
    """``add_rms_norm_cpu``: the residual becomes torch's ``residual + x`` bit for bit, and the norm is the
    plain kernel's of that sum, bit for bit."""
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x, residual, w = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g), torch.randn(shape[-1])
    expected_sum = residual + x
    out = add_rms_norm_cpu(x, residual, w, 1e-6, offset)
    assert torch.equal(residual, expected_sum)
    assert torch.equal(out, rms_norm_cpu(expected_sum, w, 1e-6, offset))


@needs_kernel
def test_fused_add_norm_bad_arguments():
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        add_rms_norm_cpu(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be a contiguous CPU float32"):
        add_rms_norm_cpu(torch.zeros(2, 8), torch.zeros(8, 2).T, torch.ones(8), 1e-6)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_decoder_add_norm_returns_the_norm_and_the_sum(kernel, monkeypatch):
    """:meth:`RMSNorm.add_norm`: ``(norm(residual + x), residual + x)``; with no residual, ``x`` is the sum."""
    if kernel and load("rms_norm") is None:
        pytest.skip("the rms_norm extension could not be built")
    if not kernel:
        monkeypatch.setattr("engine.kernels.cpu.rms_norm.supports", lambda x, w: False)
    norm = RMSNorm(16, 1e-6)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    expected = residual + x
    out, total = norm.add_norm(x, residual.clone())
    assert torch.equal(total, expected) and torch.equal(out, norm(expected))
    out, total = norm.add_norm(x, None)
    assert total is x and torch.equal(out, norm(x))

"""The C++ RMSNorm kernel (``engine/kernels/cpu/csrc/rms_norm.cpp``): as close to a float64 RMSNorm as
HF's float32 expression is (Llama's and Gemma's forms, decode and prefill row counts, 1 and 2
threads), its argument checks, and the decoder's :class:`RMSNorm` taking it on CPU float32.

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu.build import load
from engine.kernels.cpu.rms_norm import rms_norm_cpu, rms_norm_reference, supports
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

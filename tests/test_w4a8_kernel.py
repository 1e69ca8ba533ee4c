"""The Q4_1 kernel (``csrc/w4a8_gemm.cpp``): GGUF Q4_1 weights times per-call int8 activations.

Against float64 references built from :func:`quant_ops.quantize_activations_int8`'s codes in blocks of 32
(the integer dot products are exact, so only the per-block scaling rounds) over SmolLM2-135M's shapes and
odd ones (output features not a multiple of the 16-wide panels, one block per row, row counts past the
8-row tiles and the 256-row blocks), at 1 and 2 threads, with all 16 codes and negative minimums; the panel
layout's round trip; the argument checks; and :class:`Q4Linear` / the plain-torch fallback agreeing with
the kernel.

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import quant_ops
from engine.kernels.cpu.build import load
from engine.model.quant import Q4Linear

W4A8 = load("w4a8_gemm")
pytestmark = pytest.mark.skipif(W4A8 is None, reason="the w4a8_gemm C++ extension could not be built here")


def _blocks(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8),
            torch.rand(n, k // 32, generator=g) * 0.01, -torch.rand(n, k // 32, generator=g) * 0.08)


def _reference(x, qs, d, m, b):
    """float64 sum over blocks of sx * (d * exact integer dot of the codes + m * sum of x's codes)."""
    codes, sx = quant_ops.quantize_activations_int8(x, 32)
    rows, k = x.shape
    wcodes = torch.cat([qs & 0xF, qs >> 4], dim=2).double()  # [N, K/32, 32]
    xc = codes.double().reshape(rows, k // 32, 32)
    dots = torch.einsum("mgk,ngk->mng", xc, wcodes)
    y = (sx.double()[:, None, :] * (dots * d.double()[None] + m.double()[None] * xc.sum(2)[:, None, :])).sum(2)
    return y + (b.double() if b is not None else 0)


@pytest.mark.parametrize("rows,n,k", [
    (1, 576, 576), (3, 192, 576), (8, 1536, 576), (33, 576, 1536), (1, 4099, 576), (9, 17, 128), (300, 33, 64),
    (5, 7, 64), (2, 3, 32), (0, 16, 64)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_matches_exact_integer_reference(rows, n, k, with_bias, threads):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g) * 3
    qs, d, m = _blocks(n, k, g)
    b = torch.randn(n, generator=g) if with_bias else None
    y = W4A8.linear_w4a8(x, *quant_ops.pack_q4_1(qs, d, m), n, b)
    ref = _reference(x, qs, d, m, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), ref, atol=1e-5 * (ref.abs().max().item() if rows else 1) + 1e-6,
                               rtol=1e-5)


@pytest.mark.parametrize("n,k", [(1, 32), (17, 64), (33, 128), (16, 576)])
def test_pack_round_trip_and_layout(n, k):
    qs, d, m = _blocks(n, k, torch.Generator().manual_seed(n + k))
    wpack, dm = quant_ops.pack_q4_1(qs, d, m)
    panels = -(-n // 16)
    assert wpack.shape == (panels, k // 8, 16, 4) and wpack.dtype == torch.uint8
    assert dm.shape == (panels, k // 32, 2, 16)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(n, k)
    assert wpack[0, 0, 0, 1] == codes[0, 1] | (codes[0, 5] << 4)
    assert wpack[-1, -1, (n - 1) % 16, 3] == codes[n - 1, k - 5] | (codes[n - 1, k - 1] << 4)
    assert dm[0, 0, 0, 0] == d[0, 0] and dm[-1, -1, 1, (n - 1) % 16] == m[n - 1, -1]
    for got, want in zip(quant_ops.unpack_q4_1(wpack, dm, n), (qs, d, m)):
        assert torch.equal(got, want)


def _args(**bad):
    wpack, dm = quant_ops.pack_q4_1(torch.zeros(20, 2, 16, dtype=torch.uint8), torch.ones(20, 2), torch.zeros(20, 2))
    return {"x": torch.zeros(2, 64), "w": wpack, "dm": dm, "n": 20, "b": None} | bad


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(2, 64, dtype=torch.float64)), "x must be a 2-D CPU float32"),
    (dict(x=torch.zeros(2, 48)), "multiple of 32"),
    (dict(x=torch.zeros(2, 96)), "wpack must be"),
    (dict(w=torch.zeros(2, 8, 16, 4, dtype=torch.int8)), "wpack must be"),
    (dict(n=33), "n=33 does not match 2 panels"),
    (dict(n=16), "n=16 does not match"),
    (dict(dm=torch.ones(2, 2, 2, 16, dtype=torch.float64)), "dm must be"),
    (dict(dm=torch.ones(2, 3, 2, 16)), "dm must be"),
    (dict(b=torch.zeros(19)), "bias must be"),
])
def test_bad_arguments(bad, match):
    a = _args(**bad)
    with pytest.raises(RuntimeError, match=match):
        W4A8.linear_w4a8(a["x"], a["w"], a["dm"], a["n"], a["b"])


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_module_kernel_and_fallback_agree(rows):
    """:class:`Q4Linear` (kernel) and the plain-torch fallback compute the same function; both are within
    the quantization error of the float layer; :meth:`Q4Linear.blocks` unpacks what was given."""
    torch.manual_seed(rows)
    dense = torch.nn.Linear(128, 72)
    layer = Q4Linear.from_linear(dense)
    for got, want in zip(layer.blocks(), quant_ops.quantize_q4_1(dense.weight)):
        assert torch.equal(got, want)
    x = torch.randn(2, rows, 128)
    y = layer(x)
    fallback = quant_ops.linear_q4_1_reference(x.reshape(-1, 128), layer.wpack, layer.dm, 72, layer.bias)
    torch.testing.assert_close(y.reshape(-1, 72), fallback, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(y, dense(x), atol=0.25, rtol=0.1)  # 4-bit weights: ~1/15 of a block's range

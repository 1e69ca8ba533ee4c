"""The int8 kernel (``csrc/w8a8_gemm.cpp``): int8 weights times per-call int8 activations.

Against float64 references built from :func:`quant_ops.quantize_activations_int8`'s codes (the integer
dot products are exact, so only the per-group scaling rounds) over SmolLM2-135M's shapes and odd ones
(output features not a multiple of the 16-wide panels, input features not a multiple of 4, one group per
row, groups of 4 to 64, row counts past the 8-row tiles and the 256-row blocks), at 1 and 2 threads; the
activation codes bit for bit (half-to-even ties, all-zero groups); the panel layout's round trip; the
argument checks; and :class:`Int8Linear` / the plain-torch fallback agreeing with the kernel.

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import quant_ops
from engine.kernels.cpu.build import load
from engine.model.quant import Int8Linear

W8A8 = load("w8a8_gemm")
pytestmark = pytest.mark.skipif(W8A8 is None, reason="the w8a8_gemm C++ extension could not be built here")


def _weights(n: int, k: int, groups: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
            torch.rand(n, groups, generator=g, dtype=torch.float32) * 0.02)


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 sum over groups of sw * sx * (exact integer dot of the codes)."""
    groups = s.shape[1]
    codes, sx = quant_ops.quantize_activations_int8(x, x.shape[1] // groups)
    m, n, k = x.shape[0], q.shape[0], x.shape[1]
    dots = torch.einsum("mgk,ngk->mng", codes.double().reshape(m, groups, k // groups),
                        q.double().reshape(n, groups, k // groups))
    y = (dots * sx.double()[:, None, :] * s.double()[None]).sum(dim=2)
    return y + (b.double() if b is not None else 0)


@pytest.mark.parametrize("rows,n,k,groups", [
    (1, 576, 576, 9), (3, 192, 576, 9), (8, 1536, 576, 9), (33, 576, 1536, 24), (1, 4099, 576, 9),
    (9, 17, 128, 2), (300, 33, 64, 1), (5, 9, 96, 3), (2, 5, 40, 5), (3, 4, 24, 6), (4, 7, 40, 1),
    (8, 13, 1, 1), (2, 5, 9, 1), (0, 16, 64, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_matches_exact_integer_reference(rows, n, k, groups, with_bias, threads):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g) * 3
    q, s = _weights(n, k, groups, g)
    b = torch.randn(n, generator=g) if with_bias else None
    y = W8A8.linear_w8a8(x, *quant_ops.pack_int8(q, s), n, b)
    ref = _reference(x, q, s, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), ref, atol=1e-5 * (ref.abs().max().item() if rows else 1) + 1e-6,
                               rtol=1e-5)


def test_activation_codes_bit_for_bit():
    """With identity weights and unit scales the output is the activations' codes times their scale: ties
    round half to even (as torch.round), values clamp at +-127, an all-zero group gives 0."""
    k = 64
    x = (torch.rand(3, k, generator=torch.Generator().manual_seed(1)) * 2 - 1) * 100  # |x| < 127 but where set
    x[0, :6] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 126.5])  # amax 127: scale 1, ties at .5
    x[1] = 0.0
    eye = torch.eye(k, dtype=torch.int8)
    y = W8A8.linear_w8a8(x, *quant_ops.pack_int8(eye, torch.ones(k, 1)), k, None)
    codes, sx = quant_ops.quantize_activations_int8(x, k)
    assert codes[0, :6].tolist() == [127, 2, 4, 0, -2, 126] and sx[0, 0] == 1.0 and sx[1, 0] == 0.0
    assert torch.equal(y, codes.float() * sx)


@pytest.mark.parametrize("n,k,groups", [(1, 4, 1), (17, 9, 1), (33, 128, 2), (16, 576, 9)])
def test_pack_round_trip_and_layout(n, k, groups):
    g = torch.Generator().manual_seed(n + k)
    q, s = _weights(n, k, groups, g)
    wpack, spack, excess = quant_ops.pack_int8(q, s)
    panels, k4 = -(-n // 16), -(-k // 4) * 4
    assert wpack.shape == (panels, k4 // 4, 16, 4) and spack.shape == excess.shape == (panels, groups, 16)
    assert wpack[0, 0, 0, 0] == q[0, 0] and wpack[-1, -1, (n - 1) % 16, (k - 1) % 4] == q[n - 1, k - 1]
    assert excess[0, 0, 0] == 128 * int(q[0, :k // groups].int().sum())
    uq, us = quant_ops.unpack_int8(wpack, spack, n, k)
    assert torch.equal(uq, q) and torch.equal(us, s)


def _args(**bad):
    wpack, spack, excess = quant_ops.pack_int8(torch.zeros(20, 64, dtype=torch.int8), torch.ones(20, 2))
    return {"x": torch.zeros(2, 64), "w": wpack, "s": spack, "e": excess, "n": 20, "b": None} | bad


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(2, 64, dtype=torch.float64)), "x must be a 2-D CPU float32"),
    (dict(x=torch.zeros(2, 60)), "wpack must be"),
    (dict(w=torch.zeros(2, 16, 16, 4)), "wpack must be"),
    (dict(n=33), "n=33 does not match 2 panels"),
    (dict(n=16), "n=16 does not match"),
    (dict(s=torch.ones(2, 3, 16)), "ng dividing K=64"),
    (dict(s=torch.ones(2, 2, 16, dtype=torch.float64)), "spack must be"),
    (dict(e=torch.zeros(2, 2, 16)), "excess must be"),
    (dict(b=torch.zeros(19)), "bias must be"),
])
def test_bad_arguments(bad, match):
    a = _args(**bad)
    with pytest.raises(RuntimeError, match=match):
        W8A8.linear_w8a8(a["x"], a["w"], a["s"], a["e"], a["n"], a["b"])


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_module_kernel_and_fallback_agree(rows):
    """:class:`Int8Linear` (kernel) and the plain-torch fallback compute the same function; both are
    within the quantization error of the float layer; ``qweight``/``scale`` unpack what was given."""
    torch.manual_seed(rows)
    dense = torch.nn.Linear(128, 72)
    layer = Int8Linear.from_linear(dense)
    q, s = quant_ops.quantize_int8(dense.weight)
    assert torch.equal(layer.qweight, q) and torch.equal(layer.scale, s)
    x = torch.randn(2, rows, 128)
    y = layer(x)
    fallback = quant_ops.linear_int8_reference(x.reshape(-1, 128), layer.wpack, layer.spack, layer.excess, 72,
                                               layer.bias)
    torch.testing.assert_close(y.reshape(-1, 72), fallback, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(y, dense(x), atol=0.05, rtol=0.05)

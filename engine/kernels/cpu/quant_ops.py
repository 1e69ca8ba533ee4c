"""Quantized linear layers: int8 (weights and activations) with a scale per group, and GGUF's Q4_1.

Two weight formats:

* **int8** (symmetric, per group of :data:`INT8_GROUP_SIZE` input weights):
  ``W[n, k] ~= qweight[n, k] * scale[n, k // G]``, ``qweight`` int8 in [-127, 127], ``scale`` the
  group's absmax / 127 (:func:`quantize_int8`), stored in the kernel's panel layout (:func:`pack_int8`).
  The activations are quantized the same way per call (:func:`quantize_activations_int8`, per row and
  group) and each group's dot product is taken in integers: W8A8 with dynamic activation scales, as
  llama.cpp multiplies Q8_0 weights.
* **Q4_1** (llama.cpp's ``block_q4_1``, ``ggml-quants.c``): each row is cut into blocks of 32
  weights; block ``b`` of row ``n`` holds a scale ``d[n, b]``, a minimum ``m[n, b]`` and 32 4-bit
  codes packed two per byte in ``qs[n, b, :16]``: code ``j < 16`` is ``qs[n, b, j] & 0xF``, code
  ``j >= 16`` is ``qs[n, b, j - 16] >> 4``; ``W[n, 32 b + j] = d[n, b] * code + m[n, b]``, stored in the
  kernel's panel layout (:func:`pack_q4_1`). The activations are quantized per call in the same blocks
  of 32 and each block's dot product is taken in integers: W4A8, as llama.cpp multiplies Q4_1 weights
  (by Q8_1 activations).

:func:`linear_int8` / :func:`linear_q4_1` call the C++ kernels of ``csrc/w8a8_gemm.cpp`` /
``csrc/w4a8_gemm.cpp`` (:func:`engine.kernels.cpu.build.load`) for CPU float32 activations (any row
count) when that extension is built, and otherwise the plain-torch reference (quantize and dequantize the
activations, dequantize the weights, then ``F.linear``), which is also what the tests compare the kernels
against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


QK4_1 = 32
"""Weights per Q4_1 block (llama.cpp's ``QK4_1``)."""

GGUF_Q4_1_BLOCK_BYTES = 20
"""Bytes of one GGUF ``block_q4_1``: fp16 ``d``, fp16 ``m``, 16 bytes of packed codes."""

_KERNELS = {"int8": ("w8a8_gemm", "linear_w8a8"), "q4_1": ("w4a8_gemm", "linear_w4a8")}
"""Format -> (extension in ``csrc/``, its function)."""


@functools.cache
def kernel(fmt: str):
    """The built C++ kernel of ``fmt`` (shown in profiler traces as ``pdcluster::<function>``), or None
    where it is not built: ``"int8"``: ``fn(x, wpack, spack, excess, n, bias)``; ``"q4_1"``:
    ``fn(x, wpack, dm, n, bias)``; float32 CPU ``x`` only, as :func:`linear_int8` / :func:`linear_q4_1`
    call it."""
    from engine.kernels.cpu.build import load_function
    try:
        return load_function(*_KERNELS[fmt])
    except FileNotFoundError:  # no such source in this checkout
        return None


def kernel_available(fmt: str = "int8") -> bool:
    """Whether the C++ kernel of ``fmt`` (``"int8"`` or ``"q4_1"``) is built and loaded here."""
    return kernel(fmt) is not None


PANEL = 16
"""Output features per panel of the integer kernels' weight layouts (one AVX-512 register of int32 sums)."""


# ---------------------------------------------------------------------------------------- int8


INT8_GROUP_SIZE = 64
"""Input weights per int8 scale (a row whose length it does not divide gets one scale: per channel).

Chosen by measurement on SmolLM2-135M (whose float weights are its GGUF's Q4_1 blocks dequantized),
perplexity ratio to float32 on the first 2048 sonnet tokens: one scale per output channel 1.0154,
per group of 64 0.9985, per group of 32 1.0029 (``bench/results/quant_quality.md``). Groups of 64
cost 4 bytes of scale per 64 weights (+6% over 1 byte per weight); llama.cpp's Q8_0 uses 32."""


def int8_group_size(k: int, group_size: int = INT8_GROUP_SIZE) -> int:
    """The group size :func:`quantize_int8` uses for rows of ``k`` input weights: ``group_size``
    when it divides ``k``, else ``k`` (one scale per row)."""
    return group_size if k % group_size == 0 else k


def quantize_int8(weight: torch.Tensor, group_size: int = INT8_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one absmax scale per group of consecutive input weights.

    Row ``n``'s weights ``k`` in group ``g = k // G`` (``G = int8_group_size(K, group_size)``) become
    ``round(W[n, k] / scale[n, g])`` with ``scale[n, g] = max|W[n, gG:(g+1)G]| / 127`` (llama.cpp's
    Q8_0 rounding, with a float32 scale).

    Args:
        weight: ``[N, K]`` floating point.
        group_size: weights per scale (>= 1); ``K`` or more gives per-channel scales.

    Returns:
        ``(qweight, scale)``: ``[N, K]`` int8 in [-127, 127] and ``[N, K/G]`` float32 (0 for an all-zero
        group, whose codes are 0).

    Raises:
        ValueError: ``weight`` is not 2-D with ``K`` >= 1, or ``group_size`` < 1.
    """
    if weight.dim() != 2 or weight.shape[1] < 1:
        raise ValueError(f"weight must be 2-D [N, K] with K >= 1, got shape {tuple(weight.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n, k = weight.shape
    g = int8_group_size(k, group_size)  # k itself when group_size does not divide it (or exceeds it)
    w = weight.detach().float().reshape(n, k // g, g)
    scale = w.abs().amax(dim=2) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scale.contiguous()


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 and ``[N, K/G]`` float32 -> ``[N, K]`` float32 ``qweight * scale`` (each scale
    over its group of ``G`` consecutive weights)."""
    n, k = qweight.shape
    groups = scale.shape[1]
    return (qweight.float().reshape(n, groups, k // groups) * scale.float()[..., None]).reshape(n, k)


def quantize_activations_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations' int8 codes as :func:`linear_int8` computes them, per row and group of ``group_size``
    consecutive features: ``scale = max|x| / 127``, ``code = round(x * (1 / scale))`` (half to even)
    clamped to [-127, 127] (0, and a 0 scale, for an all-zero group): llama.cpp's ``quantize_row_q8_0``
    with a float32 scale.

    Args:
        x: ``[M, K]`` float32, ``group_size`` dividing ``K``.

    Returns:
        ``(codes, scale)``: ``[M, K]`` int8 and ``[M, K/group_size]`` float32.
    """
    m, k = x.shape
    xg = x.float().reshape(m, k // group_size, group_size)
    scale = xg.abs().amax(dim=2) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(xg * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(m, k), scale


def pack_int8(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 kernel's layout (``csrc/w8a8_gemm.cpp``) of ``(qweight, scale)`` from :func:`quantize_int8`.

    Output features go in panels of 16 and input features in quads: ``wpack[p, q, j, b] = qweight[16p + j,
    4q + b]``; ``spack[p, g, j] = scale[16p + j, g]``; ``excess[p, g, j] = 128 * sum`` of row ``16p + j``'s
    codes in group ``g`` (what the kernel's unsigned-times-signed dot adds). Rows past ``N`` and input
    features past ``K`` (up to ``K4``, ``K`` rounded up to 4) are 0.

    Args:
        qweight: ``[N, K]`` int8. scale: ``[N, K/G]`` float32.

    Returns:
        ``(wpack, spack, excess)``: ``[ceil(N/16), K4/4, 16, 4]`` int8, ``[ceil(N/16), K/G, 16]`` float32 and int32.
    """
    n, k = qweight.shape
    groups = scale.shape[1]
    k4, panels = -(-k // 4) * 4, -(-n // PANEL)
    q = torch.zeros(panels * PANEL, k4, dtype=torch.int8, device=qweight.device)
    q[:n, :k] = qweight
    s = torch.zeros(panels * PANEL, groups, dtype=torch.float32, device=qweight.device)
    s[:n] = scale
    sums = torch.zeros(panels * PANEL, groups, dtype=torch.int32, device=qweight.device)
    sums[:n] = qweight.to(torch.int32).reshape(n, groups, k // groups).sum(dim=2, dtype=torch.int32)

    def by_panel(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(panels, PANEL, groups).transpose(1, 2).contiguous()
    wpack = q.reshape(panels, PANEL, k4 // 4, 4).permute(0, 2, 1, 3).contiguous()
    return wpack, by_panel(s), by_panel(sums * 128)


def unpack_int8(wpack: torch.Tensor, spack: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_int8`: ``(qweight [n, k] int8, scale [n, K/G] float32)``, new tensors."""
    panels, quads = wpack.shape[:2]
    q = wpack.permute(0, 2, 1, 3).reshape(panels * PANEL, quads * 4)[:n, :k].contiguous()
    return q, spack.transpose(1, 2).reshape(panels * PANEL, -1)[:n].contiguous()


def linear_int8(x: torch.Tensor, wpack: torch.Tensor, spack: torch.Tensor, excess: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``quantized(x) @ dequantize_int8(qweight, scale).T + bias`` over :func:`pack_int8`'s layout: the
    activations are quantized per row and weight group (:func:`quantize_activations_int8`) and each group's
    dot product is taken in integers (W8A8, as llama.cpp's Q8_0).

    Args:
        x: ``[M, K]`` activations (float32 for the C++ kernel; otherwise the reference path).
        wpack, spack, excess: :func:`pack_int8` of an ``[n, K]`` weight. n: output features.
        bias: ``[n]`` float32 or None.

    Returns:
        ``[M, n]`` in ``x``'s dtype.
    """
    fn = kernel("int8")  # any row count; checked inline: this runs ~120 times a step
    if fn is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return fn(x, wpack, spack, excess, n, bias)  # the kernel makes x contiguous
    return linear_int8_reference(x, wpack, spack, excess, n, bias)


def linear_int8_reference(x, wpack, spack, excess, n, bias):
    """Plain-torch :func:`linear_int8` (quantize and dequantize ``x``, dequantize the weight, ``F.linear``);
    same arguments. Equal to the kernel up to float rounding: the kernel sums each group in integers."""
    k = x.shape[-1]
    qweight, scale = unpack_int8(wpack, spack, n, k)
    codes, xs = quantize_activations_int8(x, k // scale.shape[1])
    xq = dequantize_int8(codes, xs).to(x.dtype)
    w = dequantize_int8(qweight, scale).to(x.dtype)
    return F.linear(xq, w, None if bias is None else bias.to(x.dtype))


# ---------------------------------------------------------------------------------------- Q4_1


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 quantization, as llama.cpp's ``quantize_row_q4_1_ref`` (``ggml-quants.c``).

    Per block of 32: ``d = (max - min) / 15``, ``m = min``, ``code = min(15, floor((w - m) / d + 0.5))``
    (computed with the float32 ``d`` and ``min``); ``d`` and ``m`` are then stored rounded to
    float16, as in the GGUF file, and returned as float32.

    Args:
        weight: ``[N, K]`` floating point, ``K`` a multiple of 32.

    Returns:
        ``(qs, d, m)``: ``[N, K/32, 16]`` uint8 packed codes, ``[N, K/32]`` float32, ``[N, K/32]`` float32.

    Raises:
        ValueError: not 2-D, or ``K`` not a multiple of 32.
    """
    if weight.dim() != 2 or weight.shape[1] % QK4_1:
        raise ValueError(f"weight must be [N, K] with K a multiple of {QK4_1}, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QK4_1, QK4_1)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.floor((w - lo[..., None]) * inv[..., None] + 0.5).clamp_(0, 15).to(torch.uint8)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return qs.contiguous(), d.half().float().contiguous(), lo.half().float().contiguous()


def dequantize_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[N, B, 16]`` uint8, ``[N, B]`` float32 ``d`` and ``m`` -> ``[N, 32 B]`` float32 weights
    (``d * code + m``, the same float32 operations as gguf-py's ``dequantize``)."""
    n, b, _ = qs.shape
    codes = torch.cat([qs & 0xF, qs >> 4], dim=2).float()
    return (d.float()[..., None] * codes + m.float()[..., None]).reshape(n, b * QK4_1)


def q4_1_from_gguf(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a GGUF Q4_1 tensor's raw bytes into ``(qs, d, m)`` (no rounding: the fp16 ``d``/``m``
    become the same float32 values gguf-py and transformers dequantize with).

    Args:
        raw: ``[N, 20 * K/32]`` uint8 (``GGUFReader``'s ``tensor.data`` of a Q4_1 tensor: per block an
            fp16 ``d``, an fp16 ``m`` and 16 bytes of codes, little-endian).

    Returns:
        ``(qs, d, m)`` as :func:`quantize_q4_1`.

    Raises:
        ValueError: not a 2-D uint8 tensor of whole blocks.
    """
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % GGUF_Q4_1_BLOCK_BYTES:
        raise ValueError(f"raw Q4_1 data must be [N, 20*B] uint8, got {tuple(raw.shape)} {raw.dtype}")
    n = raw.shape[0]
    blocks = raw.contiguous().reshape(n, -1, GGUF_Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    return blocks[..., 4:].contiguous(), d.contiguous(), m.contiguous()


def pack_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q4_1 kernel's layout (``csrc/w4a8_gemm.cpp``) of ``(qs, d, m)`` (:func:`quantize_q4_1`).

    Output features go in panels of 16 and input features in octets, each byte holding two 4-bit codes:
    ``wpack[p, r, j, b] = code(16p + j, 8r + b) | code(16p + j, 8r + 4 + b) << 4``; ``dm[p, g, 0, j] =
    d[16p + j, g]``, ``dm[p, g, 1, j] = m[16p + j, g]``. Rows past ``N`` are 0.

    Args:
        qs: ``[N, K/32, 16]`` uint8. d, m: ``[N, K/32]`` float32.

    Returns:
        ``(wpack, dm)``: ``[ceil(N/16), K/8, 16, 4]`` uint8 and ``[ceil(N/16), K/32, 2, 16]`` float32.
    """
    n, blocks, _ = qs.shape
    k, panels = blocks * QK4_1, -(-n // PANEL)
    codes = torch.zeros(panels * PANEL, k, dtype=torch.uint8, device=qs.device)
    codes[:n] = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(n, k)
    octets = codes.reshape(panels, PANEL, k // 8, 2, 4)
    wpack = (octets[:, :, :, 0] | (octets[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    dm = torch.zeros(panels * PANEL, blocks, 2, dtype=torch.float32, device=qs.device)
    dm[:n, :, 0], dm[:n, :, 1] = d, m
    return wpack, dm.reshape(panels, PANEL, blocks, 2).permute(0, 2, 3, 1).contiguous()


def unpack_q4_1(wpack: torch.Tensor, dm: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack_q4_1`'s inverse: ``(qs, d, m)`` of an ``[n, K]`` weight (new tensors)."""
    panels, octets = wpack.shape[:2]
    k = octets * 8
    split = torch.stack([wpack & 0xF, wpack >> 4], dim=2)  # [P, K/8, 2, 16, 4]
    codes = split.permute(0, 3, 1, 2, 4).reshape(panels * PANEL, k)[:n].reshape(n, k // QK4_1, QK4_1)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).contiguous()
    per_row = dm.permute(0, 3, 1, 2).reshape(panels * PANEL, -1, 2)[:n]
    return qs, per_row[..., 0].contiguous(), per_row[..., 1].contiguous()


def linear_q4_1(x: torch.Tensor, wpack: torch.Tensor, dm: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``quantized(x) @ dequantize_q4_1(W).T + bias`` over :func:`pack_q4_1`'s layout: the activations are
    quantized per row and block of 32 (:func:`quantize_activations_int8`) and each block's dot product is
    taken in integers (W4A8, as llama.cpp's Q4_1 x Q8_1 dot).

    Args:
        x: ``[M, K]`` activations (float32 for the C++ kernel; otherwise the reference path).
        wpack, dm: :func:`pack_q4_1` of an ``[n, K]`` weight. n: output features.
        bias: ``[n]`` float32 or None.

    Returns:
        ``[M, n]`` in ``x``'s dtype.
    """
    fn = kernel("q4_1")
    if fn is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return fn(x, wpack, dm, n, bias)  # the kernel makes x contiguous
    return linear_q4_1_reference(x, wpack, dm, n, bias)


def linear_q4_1_reference(x, wpack, dm, n, bias):
    """Plain-torch :func:`linear_q4_1` (quantize and dequantize ``x``, dequantize the weight, ``F.linear``);
    same arguments. Equal to the kernel up to float rounding: the kernel sums each block in integers."""
    xq = dequantize_int8(*quantize_activations_int8(x, QK4_1)).to(x.dtype)
    w = dequantize_q4_1(*unpack_q4_1(wpack, dm, n)).to(x.dtype)
    return F.linear(xq, w, None if bias is None else bias.to(x.dtype))

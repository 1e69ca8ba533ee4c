"""fp32 matmul over panel-packed weights on CPU: the C++ kernel ``csrc/panel_gemm.cpp`` (any row
count, from batch-1 decode to prefill) and the packing.

A weight ``[N, K]`` is stored as ``ceil(N / 32)`` panels of 32 output features, each ``[K, 32]``
contiguous (the last zero-padded): :func:`pack` / :func:`unpack`. Algorithm: the outer-product
register-blocked GEMM of BLIS (Van Zee and van de Geijn, 2015) and oneDNN's AVX-512 kernels; see
the C++ file's comment. ``bench/gemv.py`` measures it against oneDNN's prepacked linear and the
row-major GEMV (``bench/results/gemv.md``).
"""

from __future__ import annotations

import torch

from engine.kernels.cpu.build import load, load_function

NAME = "panel_gemm"
PANEL = 32
"""Output features per panel (two AVX-512 registers)."""


def kernel():
    """The built kernel ``fn(x, panels, n, bias)`` (shown in profiler traces as ``pdcluster::panel_gemm``), or
    None where it is not built."""
    return load_function(NAME, "linear", "pdcluster::panel_gemm")


def available() -> bool:
    """Whether the C++ kernel is built (or can be built now) on this machine."""
    return load(NAME) is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float32 -> ``[ceil(N / 32), K, 32]`` float32 panels (a new tensor; rows past ``N``
    are zero).

    Raises:
        ValueError: not a 2-D CPU float32 tensor.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack needs a 2-D CPU float32 weight, got {weight.device} {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[P, K, 32]`` panels -> the ``[n, K]`` weight (a new tensor)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n].contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` packed by :func:`pack` (C++ kernel).

    Args:
        x: ``[M, K]`` float32 (made contiguous).
        panels: ``[ceil(n / 32), K, 32]`` float32, contiguous.
        n: output features ``N``.
        bias: ``[N]`` float32 or None.

    Returns:
        ``[M, N]`` float32.

    Raises:
        RuntimeError: the kernel is not built here, or a bad argument (named in the message).
    """
    ext = load(NAME)
    if ext is None:
        raise RuntimeError("the C++ panel_gemm kernel is not built on this machine")
    return ext.linear(x, panels, int(n), bias)

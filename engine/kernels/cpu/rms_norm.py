"""RMSNorm of float32 rows in one call on CPU: the C++ kernel ``csrc/rms_norm.cpp`` and its plain-torch
reference (HF ``transformers``' expression, as the decoder computes it without the kernel).

At decode a norm is a few hundred floats; torch runs it as about ten operators whose dispatch, not
their arithmetic, is the cost (SmolLM2: 61 norms, ~1 ms of a batch-1 decode step on this project's
machine). The kernel's sum of squares rounds differently from torch's reduction (a few ulp of the
norm); greedy outputs stay token-exact against HF (``tests/test_model.py``).
"""

from __future__ import annotations


import torch

from engine.kernels.cpu.build import load_function

NAME = "rms_norm"


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm_cpu` takes these: CPU float32 ``x`` and ``weight``, and the kernel built
    (or buildable now) on this machine."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and _kernel() is not None)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``(x * rsqrt(mean(x**2, -1) + eps)) * (offset + weight)`` over the last dimension.

    Args:
        x: ``[..., D]`` float32 (made contiguous).
        weight: ``[D]`` float32.
        eps: added to the mean square (>= 0).
        offset: added to ``weight``: 0 for Llama/Qwen, 1 for Gemma's zero-centred weights.

    Returns:
        ``[..., D]`` float32, a new tensor.

    Raises:
        RuntimeError: the kernel is not built here, or a bad argument (dtype, shape, a negative
            ``eps``), named in the message.
    """
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the C++ rms_norm kernel is not built on this machine")
    return kernel(x.contiguous(), weight.contiguous(), float(eps), float(offset))


def add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     offset: float = 0.0) -> torch.Tensor:
    """``residual += x`` (in place, the float32 sum torch's ``residual + x`` gives), then :func:`rms_norm_cpu`
    of ``residual``: a decoder block's residual add and the next norm in one call (vLLM's
    ``fused_add_rms_norm``).

    Args:
        x: ``[..., D]`` float32, contiguous. residual: same shape, contiguous; updated in place.
        weight, eps, offset: as :func:`rms_norm_cpu`.

    Returns:
        ``[..., D]`` float32, the norm of the updated ``residual`` (a new tensor).

    Raises:
        RuntimeError: the kernel is not built here, or a bad argument, named in the message.
    """
    kernel = _add_kernel()
    if kernel is None:
        raise RuntimeError("the C++ rms_norm kernel is not built on this machine")
    return kernel(x, residual, weight.contiguous(), float(eps), float(offset))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Plain torch, in float32 whatever ``x``'s dtype, cast back: HF's ``LlamaRMSNorm`` (``offset``
    0: ``weight * norm(x).to(dtype)``) and ``Gemma3RMSNorm`` (``(norm(x) * (offset + weight)).to(dtype)``)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (offset + weight.float())).to(dtype)
    return weight * x32.to(dtype)


def _kernel():
    return load_function(NAME, "rms_norm")


def _add_kernel():
    return load_function(NAME, "add_rms_norm_", "pdcluster::add_rms_norm")

"""A decode step's decoder layers in one C++ call (``csrc/decode_step.cpp``): the layer loop of
:class:`engine.model.decode_plan.DecodePlan` without Python between the kernels.

The C++ loop calls the other kernels' entry points directly: each kernel module exports its entry point as
a capsule (``<function>_abi``, signatures declared once in ``csrc/kernel_abi.h``), and :func:`new_step`
hands them to a ``DecodeStep``. The kernels, their order and their arguments are the Python loop's, so the
results are bit-identical (``tests/test_decode_plan.py``); what goes is ~2-3 ms of Python per batch-1 step
on SmolLM2-135M (30 layers, 2 AVX2 cores: pybind argument conversion, the GIL, tensor views made from
Python; measured with a model of 64-wide layers, whose kernels do almost nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from engine.kernels.cpu import panel_gemm, quant_ops
from engine.kernels.cpu.build import load

NAME = "decode_step"

# the C++ DecodeStep's kernel key -> (kernel extension, its exported capsule)
_ENTRY_POINTS = {
    "rms_norm": ("rms_norm", "rms_norm_abi"),
    "add_rms_norm_": ("rms_norm", "add_rms_norm__abi"),
    "rope_store": ("rope_cache", "rope_store_abi"),
    "paged_decode": ("paged_attention", "decode_abi"),
    "silu_and_mul": ("activation", "silu_and_mul_abi"),
    "panel_linear": ("panel_gemm", "linear_abi"),
    "linear_w8a8": ("w8a8_gemm", "linear_w8a8_abi"),
    "linear_w4a8": ("w4a8_gemm", "linear_w4a8_abi"),
}

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
"""The gate activations the C++ loop runs (``silu`` through ``csrc/activation.cpp``, the GELUs through ATen)."""


class ProjSpec(NamedTuple):
    """A projection as the C++ loop calls it: ``kind`` ``"f32_panels"`` (``tensors`` = panels,
    ``csrc/panel_gemm.cpp``), ``"w8a8"`` (wpack, spack, excess: ``csrc/w8a8_gemm.cpp``) or ``"w4a8"``
    (wpack, dm: ``csrc/w4a8_gemm.cpp``); ``n`` output features; ``bias`` ``[n]`` float32 or None."""

    kind: str
    tensors: tuple[torch.Tensor, ...]
    n: int
    bias: torch.Tensor | None


# a projection kind -> its kernel as Python calls it, ``fn(x, *tensors, n, bias)`` (None where not built)
_PYTHON_KERNELS: dict[str, Callable[[], Any]] = {
    "f32_panels": panel_gemm.kernel,
    "w8a8": lambda: quant_ops.kernel("int8"),
    "w4a8": lambda: quant_ops.kernel("q4_1"),
}


def python_call(spec: ProjSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    """``spec``'s projection with its weights bound, as the decode plan's Python loop calls it: ``[T, in]``
    float32 rows -> ``[T, n]``, the kernel the C++ loop calls for the same spec.

    Raises:
        RuntimeError: ``spec``'s kernel is not built here (a module gives no spec then).
    """
    kernel = _PYTHON_KERNELS[spec.kind]()
    if kernel is None:
        raise RuntimeError(f"the {spec.kind} projection kernel is not built on this machine")
    tensors, n, bias = spec.tensors, spec.n, spec.bias
    return lambda x: kernel(x, *tensors, n, bias)


def new_step() -> Any | None:
    """An empty C++ ``DecodeStep`` bound to every kernel's entry point, or None where this extension or one
    of the kernels it calls is not built here. Add layers with ``add_layer(in_norm, post_norm, qk_norms,
    ffn_norms, projs, dims, scale, act, k_cache, v_cache)``, then call ``run(x, ropes, kv_cache,
    slot_mapping, block_tables, seq_lens)`` (argument meanings: the source's comment)."""
    ext, capsules = load(NAME), entry_points()
    return None if ext is None or capsules is None else ext.DecodeStep(capsules)


def entry_points() -> dict[str, Any] | None:
    """The kernels' exported entry points (capsules) by the C++ ``DecodeStep``'s keys, or None where a
    kernel is not built here."""
    capsules = {}
    for key, (name, attr) in _ENTRY_POINTS.items():
        mod = load(name)
        if mod is None or not hasattr(mod, attr):
            return None
        capsules[key] = getattr(mod, attr)
    return capsules

"""A gated MLP's activation in one call on CPU: ``silu_and_mul`` (``csrc/activation.cpp``), vLLM's op of the
same name. Bit-identical to ``F.silu(gate) * up``: float32 rows are computed with ATen's own formula, exp and
vector width (checked against ATen on probe rows at first use), anything else through torch's ``silu`` and
``mul`` called from C++. It removes the Python side of three operators per layer and the two operators' set-up
(SmolLM2: 30 calls per decode step).
"""

from __future__ import annotations


import torch

from engine.kernels.cpu.build import load_function

NAME = "activation"


def supports(gate_up: torch.Tensor) -> bool:
    """Whether :func:`silu_and_mul` takes ``gate_up``: a CPU tensor, and the kernel built (or buildable now)."""
    return gate_up.device.type == "cpu" and _kernel() is not None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``.

    Args:
        gate_up: ``[..., 2 * I]`` (the merged gate/up projection's output), any float dtype.

    Returns:
        ``[..., I]``, ``gate_up``'s dtype, a new tensor.

    Raises:
        RuntimeError: the kernel is not built here, or an odd last dimension.
    """
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the C++ activation kernel is not built on this machine")
    return kernel(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain torch: ``F.silu(gate) * up`` over the two halves of the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _kernel():
    return load_function(NAME, "silu_and_mul")

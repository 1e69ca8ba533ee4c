"""Linear-layer backends on CPU: plain ``F.linear``, oneDNN-prepacked weights, this project's GEMV
kernel, or its panel GEMM (the CPU float32 default).

``"torch"`` leaves every ``nn.Linear`` as it is. ``"panel"`` (the default for CPU float32 where
its C++ kernel is built) replaces the decoder's ``nn.Linear`` modules and the LM head with
:class:`PanelLinear`: the weight packed once in panels of 32 output features and multiplied by the
register-blocked GEMM of ``engine/kernels/cpu/csrc/panel_gemm.cpp`` for every row count, one
weight copy. Measured on this project's 2-core machine (SmolLM2-135M's matrices, 1 thread, one
run; ``bench/results/gemv.md``): 1.39x oneDNN prepacked at 1 row, 1.31x at 8, 1.18x at 32,
1.0x at 64-256 and at prefill sizes; as a whole decode step at 2 threads it took 0.83-0.99x
oneDNN's step time at batch 1, 8 and 32 (``bench/results/decode.md`` has the quiet run).
``"onednn"`` (the default without the kernel) uses :class:`PackedLinear`, whose weight was
reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and is
multiplied with ``torch.ops.mkldnn._linear_pointwise`` — what PyTorch inductor's CPU weight
prepacking (``freezing``) and vLLM's CPU backend do: 1.1-2x faster than ``F.linear`` for 1 to 512
rows, max abs difference ~1e-4 (float rounding order).
``"gemv"`` replaces them with :class:`GemvLinear`: the plain row-major weight, multiplied by
the C++ GEMV kernel (``engine/kernels/cpu/csrc/gemv.cpp``) for up to :data:`GEMV_MAX_ROWS`
rows (decode) and by oneDNN on the same plain weight above that (prefill); no second copy of
the weights, and a tied LM head shares the embedding's tensor. ``"gemv_packed"`` also keeps a
oneDNN-prepacked copy for more rows (twice the weight memory). The panel GEMM is faster than the
GEMV at every row count measured (1.06x at 1 row, 2x at 8).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.kernels.cpu import panel_gemm
from engine.kernels.cpu.build import load_function
from engine.kernels.cpu.decode_step import ProjSpec

BATCH_HINT = 32
"""Rows oneDNN tunes the packed layout for (any row count works; 1-512 measured within 10%)."""


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear ops."""
    mk = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mk is not None
            and hasattr(mk, "_reorder_linear_weight") and hasattr(mk, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN (CPU, float32 only).

    Args:
        weight: ``[out_features, in_features]`` CPU float32; copied into the packed
            layout (the original can be dropped).
        bias: ``[out_features]`` or None.
        batch_hint: rows the packed layout is tuned for.

    Raises:
        ValueError: not a CPU float32 weight, or oneDNN unavailable.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        w = weight.detach()
        if w.device.type != "cpu" or w.dtype != torch.float32 or not onednn_available():
            raise ValueError(f"PackedLinear needs oneDNN and a CPU float32 weight, got {w.device} {w.dtype}")
        self.out_features, self.in_features = w.shape
        self.weight_nbytes = w.numel() * w.element_size()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, batch_hint))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dense_weight(self) -> torch.Tensor:
        """A plain ``[out_features, in_features]`` float32 copy of the weight."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` float32 -> ``[..., out_features]`` float32."""
        if x.dim() == 2:  # the engine's token-major rows: no reshapes (~1 us of a batch-1 call)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed_weight, self.bias,
                                               "none", [], "")
        return y.reshape(*lead, self.out_features)


GEMV_MAX_ROWS = 4
"""Most rows :class:`GemvLinear` sends to the GEMV kernel; more go to oneDNN (``bench/gemv.py``)."""


class GemvLinear(nn.Module):
    """``y = x @ W.T + b`` on CPU float32: the GEMV kernel for few rows, oneDNN (or
    ``F.linear`` without it) for more.

    Args:
        weight: ``[out_features, in_features]`` CPU float32; a contiguous ``nn.Parameter`` is
            kept as is (shared, e.g. with tied embeddings), anything else is copied.
        bias: ``[out_features]`` float32 or None.
        max_rows: most rows (product of the leading dimensions) sent to the GEMV kernel.
        packed: also keep a oneDNN-prepacked copy for more than ``max_rows`` rows (as fast
            as :class:`PackedLinear` there, for twice the weight memory); else oneDNN runs on
            the plain weight (measured 5-40% slower than prepacked for 8-256 rows).

    Raises:
        ValueError: not a CPU float32 weight.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 max_rows: int = GEMV_MAX_ROWS, packed: bool = False) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"GemvLinear needs a 2-D CPU float32 weight, got {weight.device} {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if not (isinstance(weight, nn.Parameter) and weight.is_contiguous()):
            weight = nn.Parameter(weight.detach().contiguous().clone(), requires_grad=False)
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self._gemv = load_function("gemv", "linear_f32", "pdcluster::gemv")
        self._onednn = onednn_available()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
                             if packed and self._onednn else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` float32 -> ``[..., out_features]`` float32."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._gemv is not None and x2.shape[0] <= self.max_rows:
            y = self._gemv(x2, self.weight, self.bias)
        elif self._onednn:
            w = self.weight if self.packed_weight is None else self.packed_weight
            y = torch.ops.mkldnn._linear_pointwise(x2, w, self.bias, "none", [], "")
        else:
            y = nn.functional.linear(x2, self.weight, self.bias)
        return y.reshape(*lead, self.out_features)


class PanelLinear(nn.Module):
    """``y = x @ W.T + b`` on CPU float32 with ``W`` packed in panels of 32 output features, by the
    C++ panel GEMM (:mod:`engine.kernels.cpu.panel_gemm`) for any row count.

    Args:
        weight: ``[out_features, in_features]`` CPU float32; copied into panels (the original can
            be dropped).
        bias: ``[out_features]`` or None.

    Raises:
        ValueError: not a 2-D CPU float32 weight.
        RuntimeError: the kernel cannot be built here (check ``panel_gemm.available()``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not panel_gemm.available():
            raise RuntimeError("PanelLinear needs the C++ panel_gemm kernel, which is not built on this machine")
        self.out_features, self.in_features = weight.shape
        self.weight_nbytes = weight.numel() * weight.element_size()
        self.register_buffer("panels", panel_gemm.pack(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous().clone())
        self._linear = panel_gemm.kernel()

    def dense_weight(self) -> torch.Tensor:
        """A plain ``[out_features, in_features]`` float32 copy of the weight."""
        return panel_gemm.unpack(self.panels, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` float32 -> ``[..., out_features]`` float32."""
        if x.dim() == 2:
            return self._linear(x, self.panels, self.out_features, self.bias)
        y = self._linear(x.reshape(-1, self.in_features), self.panels, self.out_features, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel_spec(self) -> ProjSpec:
        """This projection as a decode plan binds it, in its C++ or its Python loop
        (:mod:`engine.kernels.cpu.decode_step`)."""
        return ProjSpec("f32_panels", (self.panels,), self.out_features, self.bias)


def _convert_all(model: nn.Module, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> int:
    """Every ``nn.Linear`` becomes ``make(weight, bias)``; a model with tied embeddings
    (``lm_head is None``) also gets an LM head made from (a copy of) the embedding."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child.weight, child.bias))
                count += 1
    if getattr(model, "lm_head", False) is None:
        model.lm_head = make(model.model.embed_tokens.weight, None)
        count += 1
    return count


LINEAR_BACKENDS: dict[str, Callable[[nn.Module], int]] = {
    "torch": lambda model: 0,
    "onednn": lambda model: _convert_all(model, PackedLinear),
    # GemvLinear keeps an nn.Parameter as is: a tied LM head shares the embedding's tensor
    "gemv": lambda model: _convert_all(model, GemvLinear),
    "gemv_packed": lambda model: _convert_all(model, lambda w, b: GemvLinear(w, b, packed=True)),
    "panel": lambda model: _convert_all(model, PanelLinear),
}
"""Name -> function that converts a loaded model in place and returns the layers converted."""


def default_linear_backend(device: torch.device, dtype: torch.dtype) -> str:
    """CPU float32: ``"panel"`` where its C++ kernel is built, else ``"onednn"`` where this torch
    has it; otherwise ``"torch"``."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        if panel_gemm.available():
            return "panel"
        if onednn_available():
            return "onednn"
    return "torch"


def apply_linear_backend(model: nn.Module, name: str) -> int:
    """Convert ``model``'s linear layers to backend ``name``; returns how many were converted.

    Raises:
        KeyError: unknown backend (the message lists the registered ones).
    """
    try:
        fn = LINEAR_BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown linear backend {name!r}; registered: {sorted(LINEAR_BACKENDS)}") from None
    return fn(model)


def dense_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter plus every packed or quantized weight (as ``<module>.weight``, dense float
    copy: any module with a ``dense_weight()`` method), by name: the model's weights whatever its
    linear backend or quantization."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    for name, mod in model.named_modules():
        if callable(getattr(mod, "dense_weight", None)):
            out[f"{name}.weight"] = mod.dense_weight()
    return out

"""Quantized decoder projections (``--quantization int8|q4``).

:data:`QUANT_BACKENDS` maps each name of :data:`engine.config.QUANTIZATIONS` to a function
that replaces the decoder's projection matrices — attention ``q_proj``/``k_proj``/``v_proj``/
``o_proj`` and MLP ``gate_proj``/``up_proj``/``down_proj`` of every layer — with
:class:`Int8Linear` or :class:`Q4Linear`, whose weights stay quantized in memory and are multiplied
by :func:`engine.kernels.cpu.quant_ops.linear_int8` / ``linear_q4_1`` (C++ kernels, plain-torch
fallback). Both quantize the activations too, per call, and take each group's dot product in integers:
``int8`` as llama.cpp multiplies Q8_0 weights (W8A8), ``q4`` as it multiplies Q4_1 weights by Q8_1
activations (W4A8). Both also quantize the LM head to int8 (per group of 64, like the int8 projections;
a quantized copy where it is tied to the token embedding, which stays a float lookup table): the LM head
is a fifth of the float weights a batch-1 step reads, and the GGUF's Q4_1 blocks cover the decoder
projections only. Measured on SmolLM2-135M (``bench/results/quant_quality.md``): int8 as a whole
(activations included) changes perplexity by 0.4%.

``q4`` takes a GGUF's own Q4_1 blocks where the caller passes them (``q4_blocks``, read by
:func:`engine.gguf_blocks.read_q4_1_blocks`), so the served projection weights are the file's bit for bit;
every other projection is quantized from the loaded float weights with llama.cpp's Q4_1 rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from engine.config import QUANTIZATIONS, check_quantization
from engine.kernels.cpu import quant_ops
from engine.kernels.cpu.decode_step import ProjSpec

log = logging.getLogger(__name__)

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
"""Per decoder layer: sub-module -> the projections quantization replaces."""

Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(qs, d, m)`` of one Q4_1 matrix: ``[N, K/32, 16]`` uint8, ``[N, K/32]`` float32 twice."""


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().float().clone()


def _rows(fn: Callable[..., torch.Tensor], x: torch.Tensor, in_features: int, out_features: int,
          *weights: torch.Tensor | None) -> torch.Tensor:
    """``fn(rows, *weights)`` over ``x``'s rows: ``[..., in_features]`` -> ``[..., out_features]``.
    The engine's token-major ``[tokens, in_features]`` goes straight in (the reshapes cost ~2 us of
    a batch-1 call's ~8)."""
    if x.dim() == 2:
        return fn(x, *weights)
    return fn(x.reshape(-1, in_features), *weights).reshape(*x.shape[:-1], out_features)


class Int8Linear(nn.Module):
    """``y = quantized(x) @ W.T + bias`` with int8 weights, ``W[n, k] = qweight[n, k] * scale[n, k // G]``
    (one scale per group of ``G`` input weights: :data:`~engine.kernels.cpu.quant_ops.INT8_GROUP_SIZE`),
    and the activations quantized to int8 per row and group on each call (W8A8:
    :func:`~engine.kernels.cpu.quant_ops.linear_int8`). The weights are kept only in the kernel's panel
    layout (:func:`~engine.kernels.cpu.quant_ops.pack_int8`); :attr:`qweight` / :attr:`scale` unpack them.

    Args:
        qweight: ``[out_features, in_features]`` int8. scale: ``[out_features, in_features/G]`` float32.
        bias: ``[out_features]`` float32 or None.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        for name, t in zip(("wpack", "spack", "excess"), quant_ops.pack_int8(qweight, scale)):
            self.register_buffer(name, t)
        self.register_buffer("bias", bias)
        self.weight_nbytes = self.wpack.numel() + (self.spack.numel() + self.excess.numel()) * 4

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Quantize ``weight`` (``[out_features, in_features]``,
        :func:`~engine.kernels.cpu.quant_ops.quantize_int8`)."""
        return cls(*quant_ops.quantize_int8(weight), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize ``linear``'s weight; its bias stays float."""
        return cls.from_weight(linear.weight, _bias(linear))

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qweight, scale)`` as given: ``[out_features, in_features]`` int8 and ``[out_features,
        in_features/G]`` float32 (new tensors)."""
        return quant_ops.unpack_int8(self.wpack, self.spack, self.out_features, self.in_features)

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 codes of :meth:`unpacked`."""
        return self.unpacked()[0]

    @property
    def scale(self) -> torch.Tensor:
        """The scales of :meth:`unpacked`."""
        return self.unpacked()[1]

    def dense_weight(self) -> torch.Tensor:
        """The dequantized ``[out_features, in_features]`` float32 weight."""
        return quant_ops.dequantize_int8(*self.unpacked())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` (``x``'s dtype)."""
        if x.dim() == 2:  # the engine's token-major rows (a decode step's ~120 calls: no extra frame)
            return quant_ops.linear_int8(x, self.wpack, self.spack, self.excess, self.out_features, self.bias)
        return _rows(quant_ops.linear_int8, x, self.in_features, self.out_features, self.wpack, self.spack,
                     self.excess, self.out_features, self.bias)

    def kernel_spec(self) -> ProjSpec | None:
        """This projection as a decode plan binds it, in its C++ or its Python loop
        (:mod:`engine.kernels.cpu.decode_step`), or None where the kernel is not built."""
        if quant_ops.kernel("int8") is None:
            return None
        return ProjSpec("w8a8", (self.wpack, self.spack, self.excess), self.out_features, self.bias)


class Q4Linear(nn.Module):
    """``y = quantized(x) @ W.T + bias`` with ``W`` in llama.cpp's Q4_1 blocks (32 weights, float ``d`` and ``m``)
    and the activations quantized to int8 per row and block on each call (W4A8:
    :func:`~engine.kernels.cpu.quant_ops.linear_q4_1`). The weights are kept only in the kernel's panel layout
    (:func:`~engine.kernels.cpu.quant_ops.pack_q4_1`); :meth:`blocks` unpacks them.

    Args:
        qs: ``[out_features, in_features/32, 16]`` uint8. d, m: ``[out_features, in_features/32]`` float32.
        bias: ``[out_features]`` float32 or None.
    """

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = qs.shape[0]
        self.in_features = qs.shape[1] * quant_ops.QK4_1
        for name, t in zip(("wpack", "dm"), quant_ops.pack_q4_1(qs, d, m)):
            self.register_buffer(name, t)
        self.register_buffer("bias", bias)
        self.weight_nbytes = self.wpack.numel() + self.dm.numel() * 4

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Q4Linear":
        """Quantize ``linear``'s weight (:func:`~engine.kernels.cpu.quant_ops.quantize_q4_1`)."""
        return cls(*quant_ops.quantize_q4_1(linear.weight), _bias(linear))

    def blocks(self) -> Q4Blocks:
        """``(qs, d, m)`` as given (new tensors)."""
        return quant_ops.unpack_q4_1(self.wpack, self.dm, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The dequantized ``[out_features, in_features]`` float32 weight."""
        return quant_ops.dequantize_q4_1(*self.blocks())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` (``x``'s dtype)."""
        return _rows(quant_ops.linear_q4_1, x, self.in_features, self.out_features, self.wpack, self.dm,
                     self.out_features, self.bias)

    def kernel_spec(self) -> ProjSpec | None:
        """As :meth:`Int8Linear.kernel_spec`, for this layer's Q4_1 kernel."""
        if quant_ops.kernel("q4_1") is None:
            return None
        return ProjSpec("w4a8", (self.wpack, self.dm), self.out_features, self.bias)


def _projections(model: nn.Module):
    """``(hf_weight_name, parent, attr, linear)`` of every decoder projection still an ``nn.Linear``."""
    for i, layer in enumerate(model.model.layers):
        for sub, names in PROJECTIONS.items():
            parent = getattr(layer, sub)
            for attr in names:
                child = getattr(parent, attr, None)
                if type(child) is nn.Linear:
                    yield f"model.layers.{i}.{sub}.{attr}.weight", parent, attr, child


def _quantize_int8(model: nn.Module, q4_blocks: Mapping[str, Q4Blocks] | None = None) -> int:
    count = 0
    for _, parent, attr, child in list(_projections(model)):
        setattr(parent, attr, Int8Linear.from_linear(child))
        count += 1
    return count + _int8_lm_head(model)


def _int8_lm_head(model: nn.Module) -> int:
    """Quantize the LM head to int8 (a quantized copy when tied: the embedding lookup stays float): at
    batch 1 it is a fifth of SmolLM2's float32 weights and would be half of what an int8 step streams,
    more than all of a q4 step's projections. Returns 1."""
    tied = model.lm_head is None
    model.lm_head = Int8Linear.from_weight(model.model.embed_tokens.weight) if tied \
        else Int8Linear.from_linear(model.lm_head)
    return 1


def _quantize_q4(model: nn.Module, q4_blocks: Mapping[str, Q4Blocks] | None = None) -> int:
    count = kept = 0
    for name, parent, attr, child in list(_projections(model)):
        blocks = (q4_blocks or {}).get(name)
        if blocks is not None and blocks[0].shape[0] == child.out_features \
                and blocks[0].shape[1] * quant_ops.QK4_1 == child.in_features:
            setattr(parent, attr, Q4Linear(*(t.to(child.weight.device) for t in blocks), _bias(child)))
            kept += 1
        else:
            setattr(parent, attr, Q4Linear.from_linear(child))
        count += 1
    log.info("q4: %d decoder projections, %d from the GGUF's own Q4_1 blocks, %d quantized from floats; "
             "LM head int8", count, kept, count - kept)
    return count + _int8_lm_head(model)


QUANT_BACKENDS: dict[str, Callable[..., int]] = {"none": lambda model, q4_blocks=None: 0,
                                                 "int8": _quantize_int8, "q4": _quantize_q4}
"""Name (one of :data:`engine.config.QUANTIZATIONS`) -> ``fn(model, q4_blocks=None)`` that quantizes the
decoder projections of a loaded float model in place and returns how many it replaced."""

assert tuple(QUANT_BACKENDS) == QUANTIZATIONS  # one registry entry per declared choice


def apply_quantization(model: nn.Module, name: str, q4_blocks: Mapping[str, Q4Blocks] | None = None) -> int:
    """Quantize ``model``'s decoder projections with backend ``name``; returns how many were replaced.

    Args:
        model: a loaded :class:`engine.model.decoder.CausalLM` (float weights).
        name: one of :data:`engine.config.QUANTIZATIONS`.
        q4_blocks: for ``"q4"``, Q4_1 blocks by HF weight name to keep as they are.

    Raises:
        common.model_config.ConfigError: unknown name (the message lists the choices).
    """
    check_quantization(name)
    return QUANT_BACKENDS[name](model, q4_blocks)

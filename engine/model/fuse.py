"""Merged projections: each decoder layer's ``q_proj``/``k_proj``/``v_proj`` become one ``qkv_proj`` and its
``gate_proj``/``up_proj`` one ``gate_up_proj`` (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``), so a step runs 4 matmuls per layer instead of 7.

Done once after loading (and quantizing), before the linear backend packs the weights: the loaded
layers keep HF's names, so checkpoints, GGUF blocks and tensor-parallel shards map onto them
unchanged; the merged layer's output features are the parts' in order (``[q | k | v]``,
``[gate | up]``), and :class:`~engine.model.decoder.Attention` / :class:`~engine.model.decoder.MLP`
split them. Each input row is read once per layer instead of three (two) times, and at batch 1 each
call's fixed cost (Python, a thread fork and join) is paid 3 fewer times per layer: measured on
SmolLM2's matrices at 2 threads, one step's matmuls 5-10% faster (panel GEMM).

A layer type merges when :data:`CONCAT` has a rule for it (a plain ``nn.Linear`` and the quantized
layers of :mod:`engine.model.quant`); other layers are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.model.quant import Int8Linear, Q4Linear

MERGES = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}
"""Per decoder layer: sub-module -> (merged name, the parts in output order)."""


def _bias(parts: Sequence[nn.Module]) -> torch.Tensor | None:
    """The parts' biases end to end (zeros for a part without one), or None when none has one."""
    biases = [p.bias for p in parts]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(p.out_features, dtype=torch.float32)
                      for p, b in zip(parts, biases)])


def _cat_dense(parts: Sequence[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight.detach() for p in parts])
    bias = _bias(parts)
    merged = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
    merged.requires_grad_(False)
    merged.weight.copy_(w)
    if bias is not None:
        merged.bias.copy_(bias.to(w.dtype))
    return merged


def _cat_int8(parts: Sequence[Int8Linear]) -> Int8Linear:
    qweights, scales = zip(*(p.unpacked() for p in parts))
    return Int8Linear(torch.cat(qweights), torch.cat(scales), _bias(parts))


def _cat_q4(parts: Sequence[Q4Linear]) -> Q4Linear:
    return Q4Linear(*(torch.cat(ts) for ts in zip(*(p.blocks() for p in parts))), _bias(parts))


CONCAT: dict[type, Callable[[Sequence[nn.Module]], nn.Module]] = {
    nn.Linear: _cat_dense, Int8Linear: _cat_int8, Q4Linear: _cat_q4,
}
"""Layer type -> the function that stacks layers of that type along their output features."""


def merge_projections(model: nn.Module) -> int:
    """Merge every decoder layer's q/k/v and gate/up projections in place (see the module
    docstring); returns how many merged layers were made. Parts of different types, of different
    input widths or of a type without a :data:`CONCAT` rule stay separate."""
    count = 0
    for layer in model.model.layers:
        for sub, (merged_name, names) in MERGES.items():
            parent = getattr(layer, sub)
            parts = [getattr(parent, n, None) for n in names]
            kind = type(parts[0])
            if (kind not in CONCAT or any(type(p) is not kind for p in parts)
                    or len({p.in_features for p in parts}) != 1):
                continue
            setattr(parent, merged_name, CONCAT[kind](parts))
            for n in names:
                setattr(parent, n, None)
            count += 1
    return count

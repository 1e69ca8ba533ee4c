"""Qwen3 (dense): RMSNorm over ``head_dim`` of every query and key head before RoPE, no
q/k/v bias (unless ``attention_bias``, then on q/k/v/o), optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from common.model_arch import DecoderArch
from engine.model.families.registry import Family, layer_windows, register_family, rope_spec


def _arch(hf: Any) -> DecoderArch:
    bias = bool(hf.attention_bias)
    return DecoderArch(family="qwen3", rope=rope_spec(hf), layer_windows=layer_windows(hf), qkv_bias=bias,
                       o_bias=bias, qk_norm=True, activation=hf.hidden_act)


QWEN3 = register_family(Family(
    "qwen3", ("qwen3",), ("Qwen3ForCausalLM",), _arch, "q/k RMSNorm per head; RoPE scaling as Llama"))

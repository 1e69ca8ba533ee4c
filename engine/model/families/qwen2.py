"""Qwen2 / Qwen2.5: Llama's decoder with q/k/v biases (none on o_proj); with
``use_sliding_window`` the layers from ``max_window_layers`` on slide (HF ``layer_types``)."""

from __future__ import annotations

from typing import Any

from common.model_arch import DecoderArch
from engine.model.families.registry import Family, layer_windows, register_family, rope_spec


def _arch(hf: Any) -> DecoderArch:
    return DecoderArch(family="qwen2", rope=rope_spec(hf), layer_windows=layer_windows(hf), qkv_bias=True,
                       activation=hf.hidden_act)


QWEN2 = register_family(Family(
    "qwen2", ("qwen2",), ("Qwen2ForCausalLM",), _arch,
    "q/k/v biases; RoPE scaling as Llama; optional sliding-window layers"))

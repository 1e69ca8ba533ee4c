"""Llama (Llama 2/3.x, SmolLM2...) and Mistral: the plain pre-norm decoder.

RoPE: default, linear, dynamic NTK, Llama 3.1 (``llama3``) and YaRN. Biases as the
config says (``attention_bias`` on q/k/v/o, ``mlp_bias``); Mistral's ``sliding_window``
applies to every layer, as in HF's ``MistralModel``.
"""

from __future__ import annotations

from typing import Any

from common.model_arch import DecoderArch
from engine.model.families.registry import Family, layer_windows, register_family, rope_spec


def _arch(hf: Any) -> DecoderArch:
    bias = bool(getattr(hf, "attention_bias", False))
    return DecoderArch(family=hf.model_type, rope=rope_spec(hf), layer_windows=layer_windows(hf),
                       qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False)),
                       activation=hf.hidden_act)


LLAMA = register_family(Family(
    "llama", ("llama",), ("LlamaForCausalLM",), _arch,
    "GQA; RoPE default / linear / dynamic / llama3 (Llama 3.x) / yarn; optional attention and MLP biases"))
MISTRAL = register_family(Family(
    "mistral", ("mistral",), ("MistralForCausalLM",), _arch, "GQA; sliding window on every layer"))

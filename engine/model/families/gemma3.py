"""Gemma 3 (text, ``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Over the shared decoder: sliding-window local layers interleaved with global ones
(``layer_types``; 5 local : 1 global by default) and their own RoPE base
(``rope_parameters["sliding_attention"]``, 10 000; global 1 000 000, with the global
layers' scaling); q/k RMSNorm per head; Gemma's RMSNorm ``x * (1 + w)`` in float32;
four norms per layer (attention and MLP outputs normed before the residual add); token
embeddings times ``sqrt(hidden_size)``; gelu-tanh MLP; softmax scale
``query_pre_attn_scalar ** -0.5``; optional final logit soft-capping.
"""

from __future__ import annotations

from typing import Any

from common.model_arch import DecoderArch
from common.model_config import ConfigError
from engine.model.families.registry import Family, layer_windows, register_family, rope_spec


def _arch(hf: Any) -> DecoderArch:
    if hf.attn_logit_softcapping is not None:
        raise ConfigError(f"attn_logit_softcapping {hf.attn_logit_softcapping} is not supported")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ConfigError("use_bidirectional_attention is not supported (causal decoders only)")
    rope = hf.rope_parameters
    bias = bool(hf.attention_bias)
    return DecoderArch(
        family="gemma3", rope=rope_spec(hf, rope["full_attention"]), local_rope=rope_spec(hf, rope["sliding_attention"]),
        local_layers=tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"),
        layer_windows=layer_windows(hf), qkv_bias=bias, o_bias=bias, qk_norm=True, norm_offset=1.0,
        embed_scale=float(hf.hidden_size) ** 0.5, activation=hf.hidden_activation, sandwich_norm=True,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5, final_logit_softcap=hf.final_logit_softcapping,
    )


GEMMA3 = register_family(Family(
    "gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), _arch,
    "sliding-window local layers + global layers, local RoPE base, q/k norm, (1+w) RMSNorm, "
    "embedding scaling, gelu-tanh MLP"))

"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Written for this engine: it takes a flat token batch with one position per token
and an :class:`~engine.attention.AttentionMetadata`, writes each layer's K/V into
the paged cache at ``slot_mapping`` and attends through the block tables. The
math follows HF ``transformers``' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
(RMSNorm in float32, rotate-half RoPE, SwiGLU MLP) so greedy outputs match it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.model_config import ConfigError, ModelConfig
from engine.attention import AttentionMetadata
from engine.attention.registry import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table ``[max_pos, head_dim]`` (float32)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        scaling = cfg.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind not in ("default", None):
            raise ConfigError(f"rope scaling {kind!r} is not supported")
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeStep":
        """The rotation for one step's ``[T] int64`` positions, looked up once for all layers."""
        return RopeStep(self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: ``[T, H, D]``, k: ``[T, KH, D]``; returns both rotated, same dtype."""
        return self.for_positions(positions, q.dtype)(q, k)


class RopeStep:
    """cos/sin ``[T, 1, D]`` of one step's positions; rotates ``q``/``k`` of every layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos, self.sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, x, meta: AttentionMetadata, kv_cache: torch.Tensor, rope: RopeStep,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(q, k)
        k_cache, v_cache = kv_cache[self.layer, 0], kv_cache[self.layer, 1]
        kh, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, kh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = backend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, meta, kv_cache, rope, backend):
        x = x + self.self_attn(self.input_layernorm(x), meta, kv_cache, rope, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. Parameter names match HF checkpoints."""

    def __init__(self, cfg: ModelConfig, attention_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rope = RotaryEmbedding(cfg)
        self.backend = attention_backend
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run the new tokens of one step.

        Args:
            input_ids: ``[T] int64`` new tokens (flat batch).
            meta: the step's metadata (positions, slot mapping, block tables).
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
                written in place.
            on_layer_done: called with layer ``i`` once layer ``i`` wrote its K/V
                (layer-wise KV streaming).

        Returns:
            ``[T, hidden_size]`` final hidden states (after the last norm).
        """
        x = self.model.embed_tokens(input_ids)
        rope = self.rope.for_positions(meta.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, meta, kv_cache, rope, self.backend)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits."""
        if self.lm_head is None:  # tied embeddings
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF state dict in (``lm_head.weight`` ignored when embeddings are tied).

        Raises:
            KeyError: a parameter is missing from ``state``.
        """
        params = dict(self.named_parameters())
        for name, p in params.items():
            if name not in state:
                raise KeyError(f"checkpoint lacks {name}")
            with torch.no_grad():
                p.copy_(state[name].to(p.dtype))

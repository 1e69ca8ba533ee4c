"""The shared decoder (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3) over a paged KV cache.

Written for this engine: it takes a flat token batch with one position per token
and an :class:`~engine.attention.AttentionMetadata`, writes each layer's K/V into
the paged cache at ``slot_mapping`` and attends through the block tables. A family's
differences (biases, q/k norm, Gemma's norms and embedding scale, activation,
sliding-window layers, per-layer RoPE) come from its :class:`~common.model_arch.DecoderArch`;
the math follows HF ``transformers``' modelling code of each family (RMSNorm in
float32, rotate-half RoPE, gated MLP) so greedy outputs match it. On CPU in float32 some of its
steps take one C++ call each: RMSNorm (``rms_norm``, a few ulp from torch's rounding), a residual
add with the next RMSNorm (vLLM's ``fused_add_rms_norm``; layers pass ``(hidden, residual)`` as
vLLM's do), a layer's RoPE plus K/V write (``rope_cache``, bit-identical) and SiLU-and-multiply
(``activation``, bit-identical); at batch 1 their ~40 operators per layer were ~2.5 ms of a ~20 ms
decode step. As built, every projection is
its own ``nn.Linear`` (q/k/v, o, gate/up/down, LM head, HF's names), so checkpoints load by name
and a column- or row-parallel linear can replace any of them; after loading,
:func:`engine.model.fuse.merge_projections` merges q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj`` (one matmul each), which :class:`Attention` and :class:`MLP` then use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.model_arch import DecoderArch, RopeSpec
from common.model_config import ModelConfig
from engine.attention import AttentionMetadata
from engine.attention.registry import AttentionBackend
from engine.kernels.cpu import activation as activation_kernel
from engine.kernels.cpu import rms_norm as rms_norm_kernel
from engine.model.rope import RopeStep, RotaryEmbedding

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, in float32. ``offset == 0``: ``w * norm(x).to(dtype)`` (Llama);
    ``offset != 0``: ``(norm(x) * (offset + w)).to(dtype)`` with a zero-initialised ``w`` (Gemma).
    On CPU in float32 one C++ call (:mod:`engine.kernels.cpu.rms_norm`), else HF's expression."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rms_norm_kernel.supports(x, self.weight):
            return rms_norm_kernel.rms_norm_cpu(x, self.weight, self.eps, self.offset)
        return rms_norm_kernel.rms_norm_reference(x, self.weight, self.eps, self.offset)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's residual add and this norm (vLLM's ``fused_add_rms_norm``): ``residual + x`` (``x`` itself
        when ``residual`` is None) and its norm, as ``(norm, sum)``. On CPU float32 one C++ call that adds
        into ``residual`` in place; the sum is the same float add either way."""
        if residual is None:
            return self(x), x
        if rms_norm_kernel.supports(x, self.weight) and x.is_contiguous() and residual.is_contiguous():
            return rms_norm_kernel.add_rms_norm_cpu(x, residual, self.weight, self.eps, self.offset), residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: DecoderArch, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = arch.window(layer)
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, arch.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, arch.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.scale = arch.attn_scale if arch.attn_scale is not None else self.head_dim**-0.5
        self.qkv_proj: nn.Module | None = None  # q/k/v merged after loading (engine.model.fuse)
        self.qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                          self.num_kv_heads * self.head_dim)

    def forward(self, x, meta: AttentionMetadata, kv_cache: torch.Tensor, rope: RopeStep,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:  # [T, q | k | v]; the kernels take contiguous rows (a copy only when T > 1)
            q, k, v = (part.contiguous() for part in self.qkv_proj(x).split(self.qkv_sizes, dim=-1))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope.rotate_and_store(q, k, v, kv_cache, self.layer, meta.slot_mapping)
        out = backend(q, kv_cache[self.layer, 0], kv_cache[self.layer, 1], meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``gate_up_proj`` computes ``[gate | up]`` in one matmul once merged."""

    def __init__(self, cfg: ModelConfig, arch: DecoderArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=arch.mlp_bias)
        self.act = _ACT[arch.activation]
        self.gate_up_proj: nn.Module | None = None  # gate/up merged after loading (engine.model.fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and activation_kernel.supports(gate_up):  # one C++ call, the same bits
            return self.down_proj(activation_kernel.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP; with ``arch.sandwich_norm`` (Gemma) each block's output is
    normed before its residual add and the MLP has its own pre-norm."""

    def __init__(self, cfg: ModelConfig, arch: DecoderArch, layer: int) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, arch.norm_offset)  # noqa: E731
        self.self_attn = Attention(cfg, arch, layer)
        self.mlp = MLP(cfg, arch)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = arch.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, meta, kv_cache, rope, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual passing: the layer's input is ``residual + x`` (``x``, the embeddings, at layer 0
        where ``residual`` is None); returns ``(mlp_out, residual)`` with the MLP's output not yet added,
        so that each residual add goes into the next norm's call (:meth:`RMSNorm.add_norm`). The sums are
        HF's (``residual + hidden``), in HF's order."""
        normed, residual = self.input_layernorm.add_norm(x, residual)
        out = self.self_attn(normed, meta, kv_cache, rope, backend)
        if not self.sandwich:
            normed, residual = self.post_attention_layernorm.add_norm(out, residual)
            return self.mlp(normed), residual
        normed, residual = self.pre_feedforward_layernorm.add_norm(self.post_attention_layernorm(out), residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: DecoderArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, arch, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, arch.norm_offset)


class CausalLM(nn.Module):
    """The decoder plus LM head. Parameter names match HF checkpoints.

    Args:
        cfg: dimensions.
        arch: the family's layer differences (:func:`engine.model.families.load_arch`).
        attention_backend: a registered backend (:func:`engine.attention.get_attention_backend`).
    """

    def __init__(self, cfg: ModelConfig, arch: DecoderArch, attention_backend: AttentionBackend) -> None:
        super().__init__()
        self.config, self.arch = cfg, arch
        self.model = DecoderModel(cfg, arch)
        specs: list[RopeSpec] = list(dict.fromkeys(arch.rope_for(i) for i in range(cfg.num_layers)))
        self.ropes = [RotaryEmbedding(s, cfg.head_dim, cfg.max_position_embeddings) for s in specs]
        self.rope_of_layer = [specs.index(arch.rope_for(i)) for i in range(cfg.num_layers)]
        self.sliding_windows = arch.sliding_windows
        self.backend = attention_backend
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run the new tokens of one step.

        Args:
            input_ids: ``[T] int64`` new tokens (flat batch).
            meta: the step's metadata (positions, slot mapping, block tables; built with
                ``sliding_windows=self.sliding_windows`` when the model has any).
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
                written in place.
            on_layer_done: called with layer ``i`` once layer ``i`` wrote its K/V
                (layer-wise KV streaming).

        Returns:
            ``[T, hidden_size]`` final hidden states (after the last norm).
        """
        x = self.model.embed_tokens(input_ids)
        if self.arch.embed_scale != 1.0:
            x = x * torch.tensor(self.arch.embed_scale, dtype=torch.float32).to(x.dtype)  # as HF: fp32, then cast
        ropes = [r.for_step(meta, x.dtype) for r in self.ropes]
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, meta, kv_cache, ropes[self.rope_of_layer[i]], self.backend)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.model.norm.add_norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits."""
        logits = self.head_logits(hidden).float()
        cap = self.arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` raw LM-head output (model dtype; a
        tensor-parallel model gathers its ranks' vocab slices here)."""
        if self.lm_head is None:  # tied embeddings
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

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

"""Decode steps without walking the module tree: each decoder layer's calls bound once.

Why: at batch 1 a decode step is the weight stream plus the Python around it. On SmolLM2-135M with
int8 weights (``--quantization int8``, 2 threads) the matmuls stream ~150 MB in ~7 ms, and the
modules' forward added ~2 ms more: ~140 Python calls per layer (``nn.Module.__call__``, buffer and
submodule lookups through ``nn.Module.__getattr__``, the kernels' wrappers and ``supports`` checks),
which run cache-cold after each layer's weights went through the caches. A :class:`DecodePlan` looks
all of that up once and runs a decode step as one loop of about fifteen calls per layer (the same
idea as replaying a captured CUDA graph for decode, with Python as the replay).

The same kernels run with the same arguments in the same order as :meth:`CausalLM.forward
<engine.model.decoder.CausalLM.forward>`, so the hidden states are bit-identical
(``tests/test_decode_plan.py``); only the lookups moved.

Scope: steps whose every sequence has one new token (``meta.max_query_len == 1``) on CPU float32, for
models whose layers are plain pre-norm layers (no q/k norm, no sandwich norms, no embedding scale,
SiLU-gated MLP) with merged ``qkv_proj`` / ``gate_up_proj``, when the C++ RMSNorm, RoPE + cache write
and SiLU-and-multiply kernels are built (:func:`build_decode_plan`). Every other model (Gemma 3,
Qwen3...) and every step with a prompt chunk runs the modules. A projection runs through its module's
``kernel_call()`` where it has one (:class:`~engine.model.linear.PanelLinear`,
:class:`~engine.model.quant.Int8Linear`, :class:`~engine.model.quant.Q4Linear`), else through the module
itself (e.g. a tensor-parallel ``RowParallel``); attention through the C++ paged decode kernel where the
model's backend would call it, else through the backend.

The plan binds the model's weights and the KV cache as they are when it is built: build it after the
model is loaded, quantized, merged and packed (:class:`engine.model_runner.ModelRunner` builds it with
its KV cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.attention.torch_backend import paged_attention_torch
from engine.kernels.cpu import paged_attention
from engine.kernels.cpu.build import load_function
from engine.model.decoder import CausalLM, DecoderLayer

Rows = Callable[[torch.Tensor], torch.Tensor]
"""``[T, in]`` float32 rows -> ``[T, out]`` float32."""


@dataclass(frozen=True)
class LayerCalls:
    """One decoder layer, bound: norms' weights and eps, the projections, the attention shape."""

    in_norm: tuple[torch.Tensor, float, float]  # (weight, eps, offset) of input_layernorm
    post_norm: tuple[torch.Tensor, float, float]  # of post_attention_layernorm
    qkv: Rows
    o: Rows
    gate_up: Rows
    down: Rows
    sizes: tuple[int, int, int]  # q | k | v features of qkv's output
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int  # the layer's sliding window in tokens, 0 = the whole context
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], a view of the layer's K
    v_cache: torch.Tensor


def _rows(module: nn.Module) -> Rows:
    kernel_call = getattr(module, "kernel_call", None)
    return kernel_call() if callable(kernel_call) else module


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float, float]:
    return norm.weight.detach().contiguous(), float(norm.eps), float(norm.offset)


def _plain(layer: DecoderLayer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    return (not layer.sandwich and attn.q_norm is None and mlp.act is F.silu
            and attn.qkv_proj is not None and mlp.gate_up_proj is not None)


class DecodePlan:
    """A model's decode step as bound calls (see the module docstring). Call it as the model:
    ``plan(input_ids, meta)`` -> ``[T, hidden_size]`` final hidden states, the K/V of the new tokens
    written into the cache it was built with.

    Args:
        model: the loaded model (as :func:`build_decode_plan` checked it).
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` float32,
            contiguous: the cache every step writes into.
    """

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor) -> None:
        self.model, self.kv_cache = model, kv_cache
        self._rms_norm = load_function("rms_norm", "rms_norm")
        self._add_rms_norm = load_function("rms_norm", "add_rms_norm_", "pdcluster::add_rms_norm")
        self._rope_store = load_function("rope_cache", "rope_store")
        self._silu_and_mul = load_function("activation", "silu_and_mul")
        self._decode_kernel = (load_function("paged_attention", "decode", "pdcluster::paged_decode_attention")
                               if model.backend is paged_attention_torch else None)
        self.layers = [self._bind(i, layer) for i, layer in enumerate(model.model.layers)]
        self.final_norm = _norm(model.model.norm)

    def _bind(self, i: int, layer: DecoderLayer) -> LayerCalls:
        attn, mlp = layer.self_attn, layer.mlp
        return LayerCalls(
            in_norm=_norm(layer.input_layernorm), post_norm=_norm(layer.post_attention_layernorm),
            qkv=_rows(attn.qkv_proj), o=_rows(attn.o_proj), gate_up=_rows(mlp.gate_up_proj), down=_rows(mlp.down_proj),
            sizes=attn.qkv_sizes, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            scale=float(attn.scale), window=int(attn.window or 0),
            k_cache=self.kv_cache[i, 0], v_cache=self.kv_cache[i, 1])

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decode step: ``input_ids`` ``[T]`` int64 (one new token per sequence), ``meta`` its
        metadata (``max_query_len == 1``). Returns ``[T, hidden_size]`` float32, what the model's own
        forward returns for it.

        Raises:
            ValueError: ``meta`` has a sequence with more than one new token.
            RuntimeError: from a kernel, on a slot or block id outside the cache.
        """
        if meta.max_query_len != 1:
            raise ValueError(f"a decode plan runs one new token per sequence, got up to {meta.max_query_len}")
        model, kv_cache = self.model, self.kv_cache
        x = model.model.embed_tokens(input_ids)
        ropes = [r.for_step(meta, x.dtype) for r in model.ropes]
        rope_of, t = model.rope_of_layer, x.shape[0]
        slots, tables, lens = meta.slot_mapping, meta.block_tables.contiguous(), meta.seq_lens.contiguous()
        rope_store, add_rms_norm, silu_and_mul = self._rope_store, self._add_rms_norm, self._silu_and_mul
        decode_kernel, backend = self._decode_kernel, model.backend
        residual, out = x, None
        for i, c in enumerate(self.layers):
            h = self._rms_norm(x.contiguous(), *c.in_norm) if out is None else add_rms_norm(out, residual, *c.in_norm)
            q, k, v = c.qkv(h).split(c.sizes, dim=-1)
            if t > 1:  # one row's parts are contiguous already
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            q = q.view(t, c.num_heads, c.head_dim)
            rope = ropes[rope_of[i]]
            rope_store(q, k.view(t, c.num_kv_heads, c.head_dim), v.view(t, c.num_kv_heads, c.head_dim),
                       rope.cos, rope.sin, kv_cache, i, slots)
            if decode_kernel is not None:
                a = decode_kernel(q, c.k_cache, c.v_cache, tables, lens, c.scale, c.window, 1)
            else:
                a = backend(q, c.k_cache, c.v_cache, meta, c.scale, window=c.window or None)
            out = c.o(a.reshape(t, c.num_heads * c.head_dim))
            h = add_rms_norm(out, residual, *c.post_norm)
            out = c.down(silu_and_mul(c.gate_up(h)))
        return add_rms_norm(out, residual, *self.final_norm)


def build_decode_plan(model: CausalLM, kv_cache: torch.Tensor) -> DecodePlan | None:
    """A :class:`DecodePlan` of ``model`` over ``kv_cache``, or None where it does not apply (see the
    module docstring): another device or dtype, a non-contiguous cache, a layer that is not a plain
    pre-norm SiLU layer with merged projections, an embedding scale, or a kernel not built here."""
    layers = list(model.model.layers)
    if (kv_cache.device.type != "cpu" or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous()
            or model.arch.embed_scale != 1.0 or not layers or not all(_plain(layer) for layer in layers)
            or layers[0].input_layernorm.weight.dtype != torch.float32):
        return None
    if layers[0].self_attn.head_dim % 8 or not paged_attention.cpu_decode_available():
        return None
    kernels = [("rms_norm", "rms_norm"), ("rms_norm", "add_rms_norm_"), ("rope_cache", "rope_store"),
               ("activation", "silu_and_mul")]
    if any(load_function(*k) is None for k in kernels):
        return None
    return DecodePlan(model, kv_cache)

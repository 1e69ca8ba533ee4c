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

Scope: steps whose every sequence has one new token (``meta.max_query_len == 1``) on CPU float32, for every
family the decoder serves (Llama, Mistral, Qwen2/2.5, Qwen3's q/k norms, Gemma 3's sandwich norms, GELU and
embedding scale), once ``qkv_proj`` and ``gate_up_proj`` are merged, when the C++ RMSNorm, RoPE + cache write
and SiLU-and-multiply kernels are built (:func:`build_decode_plan`). Steps with a prompt chunk run the
modules. A projection runs through the kernel its module's ``kernel_spec()`` names where it has one
(:class:`~engine.model.linear.PanelLinear`, :class:`~engine.model.quant.Int8Linear`,
:class:`~engine.model.quant.Q4Linear`), else through the module itself (e.g. a tensor-parallel
``RowParallel``); attention through the C++ paged decode kernel where the model's backend would call it,
else through the backend.

Where every projection has a C++ kernel (``kernel_spec()``), attention goes through the paged decode kernel
and the activation is one the C++ loop runs, the plan hands its bound layers to
:mod:`engine.kernels.cpu.decode_step` and runs the whole layer loop as one C++ call (:attr:`DecodePlan.native`):
the same kernels in the same order, without the Python between them (measured on SmolLM2-135M at batch 1 on
2 AVX2 cores: the step's fixed cost from ~2.5 ms to ~1 ms). The Python loop below stays for the rest
(tensor-parallel projections, attention through a backend) and as the reference the C++ loop is tested against.

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
from engine.attention.torch_backend import paged_attention_batch_invariant, paged_attention_torch
from engine.kernels.cpu import decode_step, paged_attention
from engine.kernels.cpu.build import load_function
from engine.model.decoder import CausalLM, DecoderLayer

Rows = Callable[[torch.Tensor], torch.Tensor]
"""``[T, in]`` float32 rows -> ``[T, out]`` float32."""

Norm = tuple[torch.Tensor, float, float]
"""An RMSNorm's ``(weight, eps, offset)``, as its C++ kernel takes them."""


@dataclass(frozen=True)
class LayerCalls:
    """One decoder layer, bound: its norms, projections, attention shape and cache views."""

    in_norm: Norm  # input_layernorm (with the residual add before it, from the second layer on)
    post_norm: Norm  # post_attention_layernorm: the MLP's pre-norm, or (sandwich) the attention output's norm
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
    qk_norm: tuple[Norm, Norm] | None = None  # Qwen3 / Gemma 3: q_norm, k_norm over each head
    ffn_norms: tuple[Norm, Norm] | None = None  # Gemma 3's sandwich: pre_feedforward, post_feedforward
    act: Callable[[torch.Tensor], torch.Tensor] | None = None  # gate's activation; None: the SiLU-and-mul kernel


def _rows(module: nn.Module) -> Rows:
    spec = _spec(module)
    return module if spec is None else decode_step.python_call(spec)


def _spec(module: nn.Module) -> decode_step.ProjSpec | None:
    kernel_spec = getattr(module, "kernel_spec", None)
    return kernel_spec() if callable(kernel_spec) else None


def _norm(norm: nn.Module) -> Norm:
    return norm.weight.detach().contiguous(), float(norm.eps), float(norm.offset)


def _covered(layer: DecoderLayer) -> bool:
    """Merged projections (the plan runs one matmul for q/k/v and one for gate/up) and float32 norms."""
    return (layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
            and layer.input_layernorm.weight.dtype == torch.float32)


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
        # the backend's own kernel where it would call it (the decode rows of paged_attention_torch and
        # paged_attention_batch_invariant), else the backend
        takes = (model.backend in (paged_attention_torch, paged_attention_batch_invariant)
                 and paged_attention.cpu_decode_available() and model.config.head_dim % 8 == 0)
        self._decode_kernel = (load_function("paged_attention", "decode", "pdcluster::paged_decode_attention")
                               if takes else None)
        scale = model.arch.embed_scale  # as CausalLM.forward: a float32 scalar tensor, cast to the model's dtype
        self.embed_scale = None if scale == 1.0 else torch.tensor(scale, dtype=torch.float32)
        self.layers = [self._bind(i, layer) for i, layer in enumerate(model.model.layers)]
        self.final_norm = _norm(model.model.norm)
        self.native = self._native_step(model)

    def _native_step(self, model: CausalLM):
        """The layer loop as one C++ call (:mod:`engine.kernels.cpu.decode_step`), or None where attention
        goes through the backend, a projection has no ``kernel_spec`` (e.g. a tensor-parallel one) or none
        now, the activation is not one the C++ loop runs, or the extension is not built."""
        act = model.arch.activation
        if self._decode_kernel is None or act not in decode_step.ACTIVATIONS:
            return None
        specs = [[_spec(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                     layer.mlp.down_proj)] for layer in model.model.layers]
        step = None if any(s is None for layer in specs for s in layer) else decode_step.new_step()
        if step is None:
            return None
        for i, (c, projs) in enumerate(zip(self.layers, specs)):
            dims = [*c.sizes, c.num_heads, c.num_kv_heads, c.head_dim, c.window, model.rope_of_layer[i]]
            step.add_layer(c.in_norm, c.post_norm, list(c.qk_norm or ()), list(c.ffn_norms or ()), projs, dims,
                           c.scale, act, c.k_cache, c.v_cache)
        return step

    def _bind(self, i: int, layer: DecoderLayer) -> LayerCalls:
        attn, mlp = layer.self_attn, layer.mlp
        return LayerCalls(
            in_norm=_norm(layer.input_layernorm), post_norm=_norm(layer.post_attention_layernorm),
            qkv=_rows(attn.qkv_proj), o=_rows(attn.o_proj), gate_up=_rows(mlp.gate_up_proj), down=_rows(mlp.down_proj),
            sizes=attn.qkv_sizes, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            scale=float(attn.scale), window=int(attn.window or 0),
            k_cache=self.kv_cache[i, 0], v_cache=self.kv_cache[i, 1],
            qk_norm=None if attn.q_norm is None else (_norm(attn.q_norm), _norm(attn.k_norm)),
            ffn_norms=(_norm(layer.pre_feedforward_layernorm), _norm(layer.post_feedforward_layernorm))
            if layer.sandwich else None,
            act=None if mlp.act is F.silu else mlp.act)

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
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        ropes = [r.for_step(meta, x.dtype) for r in model.ropes]
        rope_of, t = model.rope_of_layer, x.shape[0]
        slots, tables, lens = meta.slot_mapping, meta.block_tables.contiguous(), meta.seq_lens.contiguous()
        rms_norm, add_rms_norm, rope_store = self._rms_norm, self._add_rms_norm, self._rope_store
        decode_kernel, backend = self._decode_kernel, model.backend
        if self.native is not None:  # the same calls as the loop below, from C++
            out = self.native.run(x, [(r.cos, r.sin) for r in ropes], kv_cache, slots, tables, lens)
            return add_rms_norm(out, x, *self.final_norm)
        residual, out = x, None
        for i, c in enumerate(self.layers):
            h = rms_norm(x.contiguous(), *c.in_norm) if out is None else add_rms_norm(out, residual, *c.in_norm)
            q, k, v = c.qkv(h).split(c.sizes, dim=-1)
            if t > 1:  # one row's parts are contiguous already
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            q = q.view(t, c.num_heads, c.head_dim)
            k = k.view(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm is not None:
                q, k = rms_norm(q, *c.qk_norm[0]), rms_norm(k, *c.qk_norm[1])
            rope = ropes[rope_of[i]]
            rope_store(q, k, v.view(t, c.num_kv_heads, c.head_dim), rope.cos, rope.sin, kv_cache, i, slots)
            if decode_kernel is not None:
                a = decode_kernel(q, c.k_cache, c.v_cache, tables, lens, c.scale, c.window, 1)
            else:
                a = backend(q, c.k_cache, c.v_cache, meta, c.scale, window=c.window or None)
            out = c.o(a.reshape(t, c.num_heads * c.head_dim))
            if c.ffn_norms is None:
                h = add_rms_norm(out, residual, *c.post_norm)
            else:
                h = add_rms_norm(rms_norm(out, *c.post_norm), residual, *c.ffn_norms[0])
            gate_up = c.gate_up(h)
            if c.act is None:
                out = c.down(self._silu_and_mul(gate_up))
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                out = c.down(c.act(gate) * up)
            if c.ffn_norms is not None:
                out = rms_norm(out, *c.ffn_norms[1])
        return add_rms_norm(out, residual, *self.final_norm)


def build_decode_plan(model: CausalLM, kv_cache: torch.Tensor) -> DecodePlan | None:
    """A :class:`DecodePlan` of ``model`` over ``kv_cache``, or None where it does not apply (see the
    module docstring): another device or dtype, a non-contiguous cache, a layer whose q/k/v or gate/up
    projections are not merged, or a kernel not built here."""
    layers = list(model.model.layers)
    if (kv_cache.device.type != "cpu" or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous()
            or not layers or not all(_covered(layer) for layer in layers)):
        return None
    kernels = [("rms_norm", "rms_norm"), ("rms_norm", "add_rms_norm_"), ("rope_cache", "rope_store"),
               ("activation", "silu_and_mul")]
    if any(load_function(*k) is None for k in kernels):
        return None
    return DecodePlan(model, kv_cache)

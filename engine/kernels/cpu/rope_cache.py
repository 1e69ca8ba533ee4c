"""One layer's RoPE of q and k plus the K/V write into the paged cache, in one call on CPU: the C++
kernel ``csrc/rope_cache.cpp`` and its plain-torch reference (the decoder's own expression).

At decode a layer's rotary embedding and cache write are about twenty torch operators of a few
hundred floats each; their dispatch, not their arithmetic, is the cost. The kernel does the same
arithmetic in one call and is bit-identical to the torch expression (rotate-half RoPE as HF
``transformers`` computes it, same roundings, no fused multiply-add).
"""

from __future__ import annotations


import torch

from engine.kernels.cpu.build import load, load_function

NAME = "rope_cache"


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`rope_store_cpu` takes these: CPU float32 queries and cache, a contiguous
    cache, and the kernel built (or buildable now) on this machine."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous() and load(NAME) is not None)


def rope_store_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate ``q`` in place and write rotated ``k`` and ``v`` into layer ``layer`` of the cache.

    Args:
        q: ``[T, num_heads, head_dim]`` float32, contiguous; rotated in place and returned.
        k, v: ``[T, num_kv_heads, head_dim]`` float32, contiguous (not modified).
        cos, sin: ``[T, 1, head_dim]`` (or ``[T, head_dim]``) float32, contiguous: each token's
            rotation (:class:`engine.model.rope.RopeStep`).
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` float32,
            contiguous; K goes to ``[layer, 0]``, V to ``[layer, 1]``.
        layer: the layer index.
        slot_mapping: ``[T]`` int64 flat slot (``block * block_size + offset``) of each token.

    Returns:
        ``q``, rotated.

    Raises:
        RuntimeError: the kernel is not built here, or a bad argument (dtype, shape, a non-contiguous
            tensor, an odd ``head_dim``, a layer or slot out of range), named in the message.
    """
    kernel = _rope_store()
    if kernel is None:
        raise RuntimeError("the C++ rope_cache kernel is not built on this machine")
    kernel(q, k, v, cos, sin, kv_cache, int(layer), slot_mapping)
    return q


def _rope_store():
    return load_function(NAME, "rope_store")


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Plain-torch :func:`rope_store_cpu` (same arguments and effect, any dtype or device; ``q`` is
    not modified: the rotated queries are returned), as the decoder computes it without the kernel."""
    cos, sin = cos.view(q.shape[0], 1, -1), sin.view(q.shape[0], 1, -1)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    kh, d = k.shape[1], k.shape[2]
    kv_cache[layer, 0].view(-1, kh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[layer, 1].view(-1, kh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
    return q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

"""Shared pieces of the paged-attention kernels: one online-softmax step over a K/V tile
gathered through a block table, and the host-side input checks.

The tile step is the inner loop of FlashAttention-2 (Dao, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning", 2023, Algorithm 1) in the
base-2 form of the Triton fused-attention tutorial: scores are scaled by
``scale * log2(e)`` so ``exp2`` replaces ``exp``. K/V rows are addressed token by token
through the block table (``block_tables[seq, pos // block_size]``), as in vLLM's Triton
unified attention (``vllm/attention/ops/triton_unified_attention.py``), so any block
size and any (non-contiguous) block order work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
NO_WINDOW = 1 << 30
"""The ``window`` the kernels take for a global-attention layer (longer than any context)."""


@triton.jit
def online_softmax_tile(
    q, acc, m_i, l_i,
    k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head,
    pos, pos_valid, score_mask, d, d_mask, scale_log2,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One FlashAttention-2 step: fold the context tokens ``pos`` into ``(acc, m_i, l_i)``.

    Args (all register tensors, fp32 unless said):
        q: ``[M, D_PAD]`` queries in the cache dtype (rows past the real ones are zeros).
        acc: ``[M, D_PAD]`` unnormalised output; m_i: ``[M]`` running max of the
            base-2 scores; l_i: ``[M]`` running sum of ``exp2(score - m_i)``.
        block_row_ptr: pointer to this sequence's row of the block table (int32).
        pos: ``[N]`` int32 context positions of the tile; pos_valid: ``[N]`` which exist.
        score_mask: ``[M, N]`` which (row, position) pairs may attend. A row may have
            all-False tiles anywhere (a sliding window starts after the tile): it stays
            at zero weight until its first True; a row with no True at all ends NaN.
        d / d_mask: ``[D_PAD]`` head-dim offsets and which are < head_dim.
        scale_log2: softmax scale times ``log2(e)``.

    Returns:
        The updated ``(acc, m_i, l_i)``.
    """
    blk = tl.load(block_row_ptr + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
    off = pos % BLOCK_SIZE
    kv_mask = pos_valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_kt
                + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: alpha = p = 0, not NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vt
                + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


def check_window(window: int | None) -> int:
    """The kernels' ``window`` argument: ``window``, or :data:`NO_WINDOW` for None.

    Raises:
        ValueError: a window below 1 token.
    """
    if window is None:
        return NO_WINDOW
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    return min(window, NO_WINDOW)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for a cache dtype: exact fp32 ("ieee", no TF32 rounding) for
    float32 caches so results match the torch path; 16-bit types ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor,
) -> tuple[int, int, int, int]:
    """Validate the common inputs of the paged kernels.

    Returns:
        ``(num_heads, num_kv_heads, head_dim, block_size)``.

    Raises:
        ValueError: wrong rank, shapes that do not agree, ``num_heads`` not a multiple of
            ``num_kv_heads``, index tensors not int32, a non-contiguous last dimension,
            or tensors on different devices.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"need q [T, H, D] and k/v caches [num_blocks, block_size, KH, D] of equal shape; "
            f"got q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k/v cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"need block_tables [B, max_blocks] and seq_lens [B]; got {tuple(block_tables.shape)}, "
            f"{tuple(seq_lens.shape)}"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return num_heads, num_kv_heads, head_dim, block_size

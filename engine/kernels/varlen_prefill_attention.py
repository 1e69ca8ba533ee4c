"""Varlen causal flash-attention forward over the paged KV cache (prefill and chunked prefill).

Algorithm: FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", 2023): each program owns a tile of query rows, streams
the K/V tiles of its sequence and keeps an online softmax in float32 (see
:func:`~engine.kernels.paged_kv_tile.online_softmax_tile`). Variable lengths as in
FlashAttention's varlen API: the new tokens of all sequences are packed flat and
sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``; the grid is
``(cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads)`` and programs past their
sequence's end exit at once.

Each sequence's context is ``seq_lens[i]`` tokens: a cached prefix of
``seq_lens[i] - num_new`` tokens followed by the ``num_new`` new ones, all already in the
paged cache, so every K/V row is read through the block table. New token ``j`` sits at
position ``prefix + j`` and attends to positions ``0..prefix + j`` (causal).

Grouped-query attention as in vLLM's Triton unified attention: a program's ``BLOCK_M``
rows are ``BLOCK_Q = BLOCK_M // group`` query tokens times the ``group`` query heads of
one KV head (row ``r`` = token ``r // group``, head ``r % group``), so each K/V tile is
loaded once for the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.paged_kv_tile import LOG2_E, check_paged_inputs, check_window, dot_precision, online_softmax_tile


@triton.jit
def _varlen_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok0 = q_tile * BLOCK_Q
    if tok0 >= q_len:
        return
    prefix = tl.load(seq_lens_ptr + seq) - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    tok = tok0 + r // GROUP  # new-token index inside the sequence
    heads = kv_head * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (tok < q_len)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0).to(k_cache_ptr.dtype.element_ty)
    q_pos = prefix + tok  # [BLOCK_M]; padding rows still see position 0, so no row is empty

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_row_ptr = block_tables_ptr + seq * stride_bt
    kv_end = prefix + tl.minimum(tok0 + BLOCK_Q, q_len)  # causal bound of the tile's last token
    kv_start = tl.maximum(prefix + tok0 - window + 1, 0)  # window bound of the tile's first token
    n = tl.arange(0, BLOCK_N)
    for kv0 in range(kv_start, kv_end, BLOCK_N):
        pos = kv0 + n
        pos_valid = pos < kv_end
        allowed = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = online_softmax_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head,
            pos, pos_valid, pos_valid[None, :] & allowed, d, d_mask, scale_log2,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, DOT_PRECISION,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows outside every window: 0, not NaN
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def _tile_config(head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``.

    16-bit inputs use the Triton fused-attention tutorial's 128 x 64 tiles up to
    head_dim 128. Float32 (exact "ieee" dot, no tensor cores) and head_dim > 128 use
    smaller tiles: chosen so that sm_90 builds (checked with ``cuobjdump
    --dump-resource-usage``) do not spill registers.
    """
    if dtype == torch.float32:
        if head_dim_pad <= 64:
            return 64, 32, 8, 2
        return (64, 16, 8, 2) if head_dim_pad <= 128 else (32, 16, 8, 2)
    return (128, 64, 8, 3) if head_dim_pad <= 128 else (64, 32, 8, 2)


def varlen_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    *, max_query_len: int | None = None, window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged context.

    Args:
        q: ``[T, num_heads, head_dim]`` fp32/fp16/bf16, the new tokens of all sequences
            packed by ``query_start_loc`` (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one dtype;
            the new tokens' K/V already written.
        query_start_loc: ``[B+1]`` int32 cu_seqlens of the new tokens (``[-1] == T``).
        seq_lens: ``[B]`` int32 context length per sequence after this step (tokens),
            ``>= num_new`` of that sequence.
        block_tables: ``[B, max_blocks]`` int32 physical block ids.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        max_query_len: ``max(num_new)`` as a python int (saves a device sync); computed
            from ``query_start_loc`` when None.
        window: sliding window in tokens (the token at position ``p`` attends to
            ``p - window + 1 .. p``); None = the whole causal context.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: see :func:`~engine.kernels.paged_kv_tile.check_paged_inputs`;
            ``query_start_loc`` not int32 ``[B+1]``; a ``window`` below 1.
    """
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be int32 [{num_seqs + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    out = torch.empty_like(q)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = _tile_config(head_dim_pad, k_cache.dtype)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _varlen_prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale * LOG2_E, check_window(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def varlen_prefill_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`varlen_prefill_attention` (same arguments), one
    sequence at a time: gather its blocks, repeat K/V per query head, causal softmax in
    float32 (within ``window`` tokens when set).

    Returns:
        ``[T, num_heads, head_dim]`` in ``q``'s dtype.
    """
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        qi = q[starts[i]:starts[i + 1]].float()  # [new, H, D]
        new = qi.shape[0]
        blocks = block_tables[i, : triton.cdiv(n, block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,lhd->hql", qi, k) * scale
        q_pos = (n - new) + torch.arange(new, device=q.device)
        kv_pos = torch.arange(n, device=q.device)[None, :]
        allowed = kv_pos <= q_pos[:, None]
        if window is not None:
            allowed &= kv_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hql,lhd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).to(q.dtype)

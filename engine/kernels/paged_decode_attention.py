"""Paged-attention decode kernel (one query token per sequence), split-K flash-decoding.

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", 2023) as in vLLM's ``paged_attention_v2`` (``csrc/attention/
paged_attention_v2.cu``): each sequence's context is cut into partitions of
``partition_size`` tokens that are processed by independent programs, each writing its
partial result (running max, sum of exponentials and normalised output); a second
kernel combines the partitions with a log-sum-exp weighted sum. With one partition the
first kernel writes the output directly (vLLM's v1 path).

Grouped-query attention: one program per ``(sequence, kv_head, partition)`` computes
all ``num_heads // num_kv_heads`` query heads of its group as the rows of one
``tl.dot`` (padded to 16 rows), so each K/V tile is read once per group and never
copied per query head (the layout of vLLM's Triton unified attention). Scores, the
softmax statistics and the output are accumulated in float32 for fp32/fp16/bf16 caches.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.paged_kv_tile import LOG2_E, check_paged_inputs, check_window, dot_precision, online_softmax_tile

BLOCK_N = 64  # context tokens per tile
MIN_PARTITION = 256  # a split covers at least this many tokens (several tiles)
MAX_SPLITS = 64  # upper bound on partitions per sequence (the reduce holds them in registers)


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, partition_size, window,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ps, stride_ph, stride_pp, stride_ms, stride_mh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = tl.maximum(seq_len - window, 0) + split * partition_size  # partitions cover the window only
    if start >= seq_len:
        return
    end = tl.minimum(start + partition_size, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    block_row_ptr = block_tables_ptr + seq * stride_bt
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):  # every tile holds >= 1 valid token
        pos = tile + n
        pos_valid = pos < end
        acc, m_i, l_i = online_softmax_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head,
            pos, pos_valid, pos_valid[None, :], d, d_mask, scale_log2,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, DOT_PRECISION,
        )

    out = acc / l_i[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        tl.store(part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pp + d[None, :],
                 out, mask=out_mask)
        tl.store(part_max_ptr + seq * stride_ms + heads * stride_mh + split, m_i, mask=g_mask)
        tl.store(part_sum_ptr + seq * stride_ms + heads * stride_mh + split, l_i, mask=g_mask)
    else:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, partition_size, window,
    stride_os, stride_oh, stride_ps, stride_ph, stride_pp, stride_ms, stride_mh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    span = tl.minimum(seq_len, window)
    num_parts = (span + partition_size - 1) // partition_size
    p = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    p_mask = p < num_parts
    d_mask = d < HEAD_DIM
    m = tl.load(part_max_ptr + seq * stride_ms + head * stride_mh + p, mask=p_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + seq * stride_ms + head * stride_mh + p, mask=p_mask, other=0.0)
    # log-sum-exp combination: partition p weighs l_p * 2^(m_p - max_p m_p)
    w = tl.where(p_mask, l * tl.exp2(m - tl.max(m, 0)), 0.0)
    o = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + p[:, None] * stride_pp + d[None, :],
                mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Tokens per split (a multiple of ``BLOCK_N``).

    Heuristic in the spirit of FlashAttention's ``num_splits_heuristic``: split only when
    ``num_seqs * num_kv_heads`` programs would give fewer than 4 programs per streaming
    multiprocessor (``num_sms``), keep at least ``MIN_PARTITION`` tokens per split and at
    most ``MAX_SPLITS`` splits. Returns a size covering the whole context (one split,
    no reduce) when splitting does not pay.
    """
    whole = triton.cdiv(max(max_seq_len, 1), BLOCK_N) * BLOCK_N
    wanted = triton.cdiv(4 * num_sms, max(num_seqs * num_kv_heads, 1))
    splits = max(1, min(wanted, max_seq_len // MIN_PARTITION, MAX_SPLITS))
    if splits == 1:
        return whole
    return triton.cdiv(triton.cdiv(max_seq_len, splits), BLOCK_N) * BLOCK_N


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention of one new token per sequence over its paged context.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` fp32/fp16/bf16 (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one dtype;
            the new token's K/V already written.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 physical block ids.
        seq_lens: ``[num_seqs]`` int32 context lengths in tokens (new token included), >= 1.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        max_seq_len: ``max(seq_lens)`` as a python int (saves a device sync); read from
            ``seq_lens`` when None.
        partition_size: tokens per split, a positive multiple of ``BLOCK_N`` (64); None
            chooses one with :func:`choose_partition_size`.
        window: sliding window in tokens (the new token attends to its last ``window``
            positions, itself included); None = the whole context.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: see :func:`~engine.kernels.paged_kv_tile.check_paged_inputs`; a
            ``partition_size`` that is not a positive multiple of ``BLOCK_N``; a ``window`` below 1.
    """
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = q.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {num_seqs} sequences")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    window = check_window(window)
    span = min(max_seq_len, window)  # the most tokens one sequence attends to
    partition_size = _partition_size(q, num_kv_heads, span, partition_size)
    num_splits = triton.cdiv(span, partition_size)
    split = num_splits > 1
    part_out, part_max, part_sum = _split_buffers(q, num_splits)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    _launch_partitions(q, k_cache, v_cache, block_tables, seq_lens, out, (part_out, part_max, part_sum),
                       scale, (partition_size, window), num_splits, num_kv_heads, block_size, head_dim_pad)
    if split:
        _reduce_splits(out, part_out, part_max, part_sum, seq_lens, (partition_size, window), head_dim_pad)
    return out


def _launch_partitions(q, k_cache, v_cache, block_tables, seq_lens, out, parts, scale: float,
                       partition: tuple[int, int], num_splits: int, num_kv_heads: int, block_size: int,
                       head_dim_pad: int) -> None:
    """Launch the per-split kernel over ``(num_seqs, num_kv_heads, num_splits)`` programs
    (arguments as in :func:`paged_decode_attention`; ``parts`` from :func:`_split_buffers`;
    ``partition`` = ``(partition_size, window)``, the window as
    :func:`~engine.kernels.paged_kv_tile.check_window` gives it)."""
    part_out, part_max, part_sum = parts
    partition_size, window = partition
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    split = num_splits > 1
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_max, part_sum,
        scale * LOG2_E, partition_size, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, SPLIT=split,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=8 if k_cache.dtype == torch.float32 and head_dim_pad > 128 else 4,  # no sm_90 spills
    )


def _split_buffers(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 partial output ``[S, H, splits, D]``, running max and sum ``[S, H, splits]``
    of a split launch (1-element placeholders when ``num_splits == 1``)."""
    num_seqs, num_heads, head_dim = q.shape
    split = num_splits > 1
    f32 = torch.float32
    part_out = q.new_empty((num_seqs, num_heads, num_splits, head_dim) if split else (1, 1, 1, 1), dtype=f32)
    part_max = q.new_empty((num_seqs, num_heads, num_splits) if split else (1, 1, 1), dtype=f32)
    return part_out, part_max, torch.empty_like(part_max)


def _partition_size(q: torch.Tensor, num_kv_heads: int, max_seq_len: int, partition_size: int | None) -> int:
    """``partition_size`` checked, or chosen by :func:`choose_partition_size` when None.

    Raises:
        ValueError: not a positive multiple of ``BLOCK_N``.
    """
    if partition_size is None:
        num_sms = _num_sms(q.device) if q.is_cuda else 1
        partition_size = choose_partition_size(q.shape[0], num_kv_heads, max_seq_len, num_sms)
    if partition_size <= 0 or partition_size % BLOCK_N:
        raise ValueError(f"partition_size must be a positive multiple of {BLOCK_N}, got {partition_size}")
    return partition_size


def _reduce_splits(out: torch.Tensor, part_out: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                   seq_lens: torch.Tensor, partition: tuple[int, int], head_dim_pad: int) -> None:
    """Flash-decoding reduce: combine the per-split partial outputs into ``out`` (in place);
    ``partition`` = ``(partition_size, window)``."""
    num_seqs, num_heads, num_splits, head_dim = part_out.shape
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out, part_out, part_max, part_sum, seq_lens, *partition,
        out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
    )


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`paged_decode_attention` (same arguments), one
    sequence at a time: gather its blocks, repeat K/V per query head, softmax in float32
    over the last ``window`` positions (all when None).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype.
    """
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    group = num_heads // num_kv_heads
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : triton.cdiv(n, block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        if window is not None:
            scores[:, : max(n - window, 0)] = float("-inf")
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(outs).to(q.dtype)

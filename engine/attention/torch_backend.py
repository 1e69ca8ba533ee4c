"""Attention over the paged KV cache on CPU: the ``"torch"`` backend (the CPU serving path) and
its plain-torch part, the ``"sdpa"`` backend.

:func:`paged_attention_sdpa`: one gather of every sequence's context through its block table,
then one ``scaled_dot_product_attention`` call over the padded ``[B, H, max_q, max_kv]`` batch
with grouped-query attention (``enable_gqa``: K/V heads are shared, never copied per query
head). Covers prefill, chunked prefill over a cached prefix and decode with one code path; no
per-sequence Python loop.

:func:`paged_attention_torch`: the decode rows of a step (sequences with one new token: every
row of a decode step, those of a mixed step) go to the C++ paged decode kernel
(:mod:`engine.kernels.cpu.paged_attention`, K/V read in place, no gathered copy) when it is
built and takes the inputs (CPU float32); the other rows, or all of them without the kernel,
go to :func:`paged_attention_sdpa`.

:func:`paged_attention_batch_invariant`: every row to the C++ paged decode kernel, each new token
attending as a decode row of its own (its sequence's block table, its position + 1 as its length).
A row's output is then computed the same way whatever the step holds: alone or batched, in a
whole-prompt prefill, a chunk, after a cached prefix, or as a decode row (batch invariance, as in
vLLM's batch-invariant mode; He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines Lab, 2025). With the row-invariant linear kernels, a prefix-cache hit, chunked prefill,
a preempted request's recompute and a migrated request's new prefill write bit-identical KV, which
int8 / Q4_1 models need: their per-call activation quantization turns SDPA's shape-dependent
rounding (~1e-6) into logit changes of ~0.1. Its cost: each row folds its own context, O(T^2) K/V
reads per prompt of T tokens as with SDPA, but in the decode kernel's block-by-block online softmax;
the kernel shares each block among 4 consecutive rows of a prompt (read from L1), which changes no
row's arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu.paged_attention import paged_decode_attention_cpu, paged_rows_attention_cpu, supports


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens over their sequences' cached context: decode rows by
    the C++ paged decode kernel when it is built and supports the inputs, the rest by
    :func:`paged_attention_sdpa` (arguments, result and errors as there)."""
    if not supports(q, k_cache):
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale, window)
    if meta.max_query_len == 1:  # a decode step: T == num_seqs
        return paged_decode_attention_cpu(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window)
    dec, pre = meta.decode_seqs, meta.prefill_seqs
    if dec is None or pre is None or dec.numel() == 0:
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale, window)
    out = paged_attention_sdpa(q, k_cache, v_cache, meta, scale, window, seqs=pre)
    rows = meta.query_start_loc.index_select(0, dec).long()  # each decode sequence's one token
    out[rows] = paged_decode_attention_cpu(q.index_select(0, rows), k_cache, v_cache,
                                           meta.block_tables.index_select(0, dec), meta.seq_lens.index_select(0, dec),
                                           scale, window)
    return out


def paged_attention_batch_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens, each as a decode row of its own through the C++ paged
    attention kernel (see the module docstring); :func:`paged_attention_sdpa` where the kernel is not
    built or does not take the inputs (not batch-invariant then). Arguments, result and errors as
    :func:`paged_attention_sdpa`."""
    if not supports(q, k_cache):
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale, window)
    if meta.max_query_len == 1:  # a decode step: T == num_seqs
        return paged_decode_attention_cpu(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window)
    seq_of_row, lens = meta.rows_as_sequences
    return paged_rows_attention_cpu(q, k_cache, v_cache, meta.block_tables, seq_of_row, lens, scale, window)


def paged_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens over their sequences' cached context (gather + SDPA).

    Args:
        q: ``[T, num_heads, head_dim]`` queries of the new tokens (flat batch).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the
            new tokens' K/V must already be written at ``meta.slot_mapping``.
        meta: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: sliding window in tokens (the query at position ``p`` attends to
            ``p - window + 1 .. p``); None = the whole causal context.
        seqs: ``[n] int64`` indices of the sequences to compute (the rows of the others are
            left zero); None = all.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        KeyError: ``window`` is shorter than the step's context but ``meta`` was built
            without it (``build_attention_metadata(..., sliding_windows=...)``).
    """
    _, h, d = q.shape
    b, max_q = meta.num_seqs, meta.max_query_len
    kh = k_cache.shape[2]
    pick = (lambda x: x) if seqs is None else (lambda x: x.index_select(0, seqs))  # noqa: E731
    gather = pick(meta.kv_gather_index)
    n = gather.shape[0]
    # index_select on the flattened slots: ~5x faster than advanced indexing on CPU
    keys = k_cache.reshape(-1, kh, d).index_select(0, gather.view(-1)).view(n, -1, kh, d).transpose(1, 2)
    values = v_cache.reshape(-1, kh, d).index_select(0, gather.view(-1)).view(n, -1, kh, d).transpose(1, 2)
    if max_q == 1:
        q_pad = q.view(b, 1, h, d)
    else:
        q_pad = q.new_zeros(b * max_q, h, d)
        q_pad[meta.query_pad_index] = q
        q_pad = q_pad.view(b, max_q, h, d)
    mask, kind = meta.attn_mask, meta.mask_kind
    if window is not None and window < meta.max_seq_len:
        if window not in meta.window_masks:
            raise KeyError(f"sliding window {window} missing from the step's metadata "
                           f"(built for {sorted(meta.window_masks)})")
        mask, kind = meta.window_masks[window], "mask"
    out = F.scaled_dot_product_attention(
        pick(q_pad).transpose(1, 2), keys, values, attn_mask=pick(mask) if kind == "mask" else None,
        is_causal=kind == "causal", scale=scale, enable_gqa=kh != h,
    ).transpose(1, 2)  # [n, max_q, H, D]
    if seqs is not None:
        out = out.new_zeros(b, max_q, h, d).index_copy_(0, seqs, out)
    out = out.reshape(b * max_q, h, d)
    return out if max_q == 1 else out.index_select(0, meta.query_pad_index)

"""The ``"triton"`` attention backend: per step, the split-K decode kernel when every
sequence brings one new token, else the varlen prefill kernel (which also serves mixed
steps of prefill chunks and decodes)."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kernels.paged_decode_attention import paged_decode_attention
from engine.kernels.varlen_prefill_attention import varlen_prefill_attention


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens over their sequences' paged context.

    Args:
        q: ``[T, num_heads, head_dim]`` queries of the new tokens (flat batch).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the new
            tokens' K/V must already be written at ``meta.slot_mapping``.
        meta: the step's :class:`~engine.attention.AttentionMetadata` (its int32
            ``query_start_loc``, ``seq_lens``, ``block_tables`` and python-int
            ``max_query_len`` / ``max_seq_len`` are used; no device sync).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: sliding window in tokens (the token at position ``p`` attends to
            ``p - window + 1 .. p``); None = the whole causal context.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: inputs the kernels reject (shapes, dtypes, devices).
    """
    if meta.max_query_len == 1:  # T == num_seqs: q is already [num_seqs, H, D]
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                      max_seq_len=meta.max_seq_len, window=window)
    return varlen_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                    meta.block_tables, scale, max_query_len=meta.max_query_len,
                                    window=window)

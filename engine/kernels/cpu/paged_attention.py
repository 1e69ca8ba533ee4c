"""Paged decode attention on CPU: the C++ kernel ``csrc/paged_attention.cpp`` and its
plain-torch reference.

One query token per sequence attends over its context read in place from the paged KV cache
through its block table (no gathered copy of the context). Algorithm: Flash-Decoding's online
softmax (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023) as in
vLLM's CPU paged attention (``csrc/cpu/attention.cpp``): one work item per (sequence, kv head)
folds the context block by block into a running max, sum and unnormalised output, all the query
heads of the kv head's group together (grouped-query attention without repeating K/V), AVX2/FMA
over ``head_dim``, items split over torch's intra-op threads (``torch.set_num_threads``).
:func:`paged_rows_attention_cpu` runs a prompt's rows through the same per-row folds (the
``"batch-invariant"`` backend), consecutive rows of a sequence sharing each K/V block.
"""

from __future__ import annotations


import torch

from engine.kernels.cpu.build import load, load_function

NAME = "paged_attention"


def cpu_decode_available() -> bool:
    """Whether the C++ kernel is built (or can be built now) on this machine."""
    return load(NAME) is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_attention_cpu` takes these inputs: CPU float32 query and cache,
    a contiguous cache, ``head_dim`` a multiple of 8, and the kernel built."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and q.shape[-1] % 8 == 0 and cpu_decode_available())


def paged_decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None = None,
    heads_per_item: int = 1,
) -> torch.Tensor:
    """Decode attention of one new token per sequence over its paged context (C++ kernel).

    Args:
        q: ``[B, num_heads, head_dim]`` float32 (made contiguous here).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32, contiguous,
            the new token's K/V already written.
        block_tables: ``[B, max_blocks]`` int32 physical block ids (entries past a sequence's
            blocks are ignored).
        seq_lens: ``[B]`` int32 context lengths in tokens (new token included), >= 1.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        window: sliding window in tokens (the token attends to its last ``window`` positions,
            itself included); None = the whole context.
        heads_per_item: kv heads one work item covers, a divisor of ``num_kv_heads`` (several:
            each block's rows of those heads are read in memory order; one, the default, was as
            fast on SmolLM2's shapes and gives more items to share over the threads).

    Returns:
        ``[B, num_heads, head_dim]`` float32.

    Raises:
        RuntimeError: the kernel cannot be built here (check :func:`cpu_decode_available`).
        ValueError: dtypes, shapes, a non-contiguous cache, ``head_dim`` not a multiple of 8,
            ``num_heads`` not a multiple of ``num_kv_heads``, a window below 1, a
            ``heads_per_item`` that does not divide ``num_kv_heads``, or a length / block id out
            of range.
    """
    kernel, window_arg = _built(_decode(), window)
    return kernel(q.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
                  float(scale), window_arg, int(heads_per_item))


def paged_rows_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_of_row: torch.Tensor, row_lens: torch.Tensor, scale: float, window: int | None = None,
    rows_per_item: int = 4,
) -> torch.Tensor:
    """Attention of query rows of several sequences, each row as a decode row of its own (C++ kernel):
    row ``t`` attends the first ``row_lens[t]`` tokens of sequence ``seq_of_row[t]`` (its position + 1),
    with the arithmetic :func:`paged_decode_attention_cpu` applies to that row alone, so its output
    is bit-identical to a one-row decode call's. Consecutive rows of one sequence share a work item
    of up to ``rows_per_item`` rows, which reads each K/V block once for all of them.

    Args:
        q: ``[T, num_heads, head_dim]`` float32 (made contiguous here).
        k_cache, v_cache: as :func:`paged_decode_attention_cpu`, every row's K/V already written.
        block_tables: ``[S, max_blocks]`` int32/int64 physical block ids per sequence.
        seq_of_row: ``[T]`` int32 each row's sequence, in ``[0, S)``.
        row_lens: ``[T]`` int32 each row's context length in tokens (position + 1), >= 1.
        scale, window: as :func:`paged_decode_attention_cpu`.
        rows_per_item: rows per work item, 1..8 (4: as fast as 8 here, and more items to share).

    Returns:
        ``[T, num_heads, head_dim]`` float32.

    Raises:
        RuntimeError: the kernel cannot be built here.
        ValueError: as :func:`paged_decode_attention_cpu`, and for a ``seq_of_row`` entry outside
            ``[0, S)`` or a ``rows_per_item`` outside 1..8.
    """
    kernel, window_arg = _built(load_function(NAME, "rows", "pdcluster::paged_rows_attention"), window)
    return kernel(q.contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                  seq_of_row.to(torch.int32).contiguous(), row_lens.to(torch.int32).contiguous(),
                  float(scale), window_arg, int(rows_per_item))


def _built(kernel, window: int | None):
    """``kernel`` (an entry point of the kernel, None where it is not built) and ``window`` as the kernel
    takes it (0: no window). Raises RuntimeError where the kernel is not built, ValueError for a window < 1."""
    if kernel is None:
        raise RuntimeError("the C++ paged-attention kernel is not built on this machine")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    return kernel, 0 if window is None else int(window)


def _decode():
    return load_function(NAME, "decode", "pdcluster::paged_decode_attention")


def paged_decode_attention_cpu_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`paged_decode_attention_cpu` (same arguments and result),
    one sequence at a time: gather its blocks, repeat K/V per query head, softmax in float64
    over the last ``window`` positions (all when None)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].double().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        if window is not None:
            scores[:, : max(n - window, 0)] = float("-inf")
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(outs).to(q.dtype)

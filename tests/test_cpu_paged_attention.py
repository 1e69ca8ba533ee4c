"""The C++ paged decode attention kernel (engine/kernels/cpu/csrc/paged_attention.cpp) vs its
plain-torch reference, and the ``"torch"`` backend's use of it (decode and mixed steps) vs the
plain gather + SDPA backend."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SeqSlice, build_attention_metadata, get_attention_backend
from engine.kernels.cpu.paged_attention import (
    cpu_decode_available,
    paged_decode_attention_cpu,
    paged_decode_attention_cpu_reference,
    paged_rows_attention_cpu,
)

pytestmark = pytest.mark.skipif(not cpu_decode_available(),
                                reason="the C++ paged-attention kernel cannot be built here (no compiler)")


def _paged(gen: torch.Generator, lens: list[int], num_kv_heads: int, head_dim: int, block_size: int):
    """Random caches and shuffled, non-contiguous block tables (never block 0) for ``lens``."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 7
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(need) + 2, dtype=torch.int32)  # padded past the used blocks
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    return k, v, tables


CASES = [  # (batch, max context, q heads, kv heads, head_dim, block_size, window)
    (1, 1, 9, 3, 64, 16, None),
    (3, 17, 4, 1, 64, 16, None),
    (33, 1100, 9, 3, 64, 16, None),  # SmolLM2's heads
    (7, 1100, 9, 3, 64, 16, 100),
    (16, 600, 4, 1, 256, 16, 512),  # Gemma 3 1B: 4/1 heads of 256, sliding window 512
    (9, 1024, 8, 8, 128, 32, None),
    (5, 300, 14, 2, 64, 8, 33),  # Qwen2.5-0.5B's heads
    (2, 130, 4, 2, 72, 16, None),  # a head_dim not a multiple of 16
    # contexts over 512 tokens: attended in parts of 512, merged at the end
    (1, 1024, 9, 3, 64, 16, None),
    (1, 1300, 9, 3, 64, 16, 700),  # the window's tokens in two parts
    (4, 1600, 4, 1, 64, 16, None),  # shorter sequences among them: empty parts
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-ctx{}-h{}/{}-d{}-bs{}-w{}".format(*c))
def test_kernel_matches_reference(case, threads):
    batch, max_ctx, heads, kv_heads, head_dim, block_size, window = case
    gen = torch.Generator().manual_seed(batch * 1000 + max_ctx)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen).tolist()
    lens[0] = max_ctx  # the longest context is always present; others include non-multiples of block_size
    k, v, tables = _paged(gen, lens, kv_heads, head_dim, block_size)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = paged_decode_attention_cpu(q, k, v, tables, seq_lens, scale, window)
    ref = paged_decode_attention_cpu_reference(q, k, v, tables, seq_lens, scale, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_a_sequence_gets_the_same_output_whatever_it_is_batched_with():
    """Bit for bit: alone, beside a sequence long enough to be split in parts, at 1 and 2 threads
    (migration and seeded sampling compare outputs across batches)."""
    gen = torch.Generator().manual_seed(9)
    lens = [700, 1500, 90]
    k, v, tables = _paged(gen, lens, 3, 64, 16)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(paged_decode_attention_cpu(q, k, v, tables, seq_lens, 0.125))
            for i in (0, 2):
                alone = paged_decode_attention_cpu(q[i:i + 1], k, v, tables[i:i + 1], seq_lens[i:i + 1], 0.125)
                assert torch.equal(alone[0], outs[-1][i])
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("heads_per_item", [3, 1])
def test_several_kv_heads_per_item(heads_per_item, threads):
    gen = torch.Generator().manual_seed(4)
    lens = [300, 17, 1, 64, 129]
    k, v, tables = _paged(gen, lens, 3, 64, 16)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention_cpu(q, k, v, tables, seq_lens, 0.125, 50, heads_per_item=heads_per_item)
    torch.testing.assert_close(out, paged_decode_attention_cpu_reference(q, k, v, tables, seq_lens, 0.125, 50),
                               atol=2e-5, rtol=1e-4)


def test_noncontiguous_query_is_accepted(threads):
    gen = torch.Generator().manual_seed(1)
    k, v, tables = _paged(gen, [40, 5], 3, 64, 16)
    q = torch.randn(9, 2, 64, generator=gen).transpose(0, 1)  # [2, 9, 64], not contiguous
    seq_lens = torch.tensor([40, 5], dtype=torch.int32)
    torch.testing.assert_close(paged_decode_attention_cpu(q, k, v, tables, seq_lens, 0.125),
                               paged_decode_attention_cpu_reference(q, k, v, tables, seq_lens, 0.125),
                               atol=2e-5, rtol=1e-4)


def test_bad_inputs_raise_value_error():
    gen = torch.Generator().manual_seed(2)
    k, v, tables = _paged(gen, [20], 1, 64, 16)
    q = torch.randn(1, 4, 64, generator=gen)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention_cpu(q.double(), k, v, tables, lens, 0.1)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_cpu(q, k, v, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention_cpu(q, k, v, tables, torch.tensor([tables.shape[1] * 16 + 1], dtype=torch.int32), 0.1)
    bad = tables.clone()
    bad[0, 0] = k.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention_cpu(q, k, v, bad, lens, 0.1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention_cpu(torch.randn(1, 3, 64), torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64),
                                   tables, lens, 0.1)
    with pytest.raises(ValueError, match="heads_per_item"):
        paged_decode_attention_cpu(q, k, v, tables, lens, 0.1, heads_per_item=2)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention_cpu(q, k, v, tables, lens, 0.1, window=0)


ROW_CASES = [  # (prompts as (cached, new) tokens, q heads, kv heads, head_dim, window)
    ([(0, 37)], 9, 3, 64, None),
    ([(0, 1100), (17, 2), (5, 60)], 9, 3, 64, None),  # over 512 tokens: parts; a prefix hit leaving 2 rows
    ([(30, 700), (0, 9)], 4, 1, 256, 512),  # a sliding window: one row per item
    ([(3, 41)], 14, 2, 64, None),
]


@pytest.mark.parametrize("rows_per_item", [1, 3, 4, 8])
@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: "{}-h{}/{}-d{}-w{}".format(*c))
def test_rows_equal_one_row_decode_calls_bit_for_bit(case, rows_per_item, threads):
    """The "batch-invariant" backend's kernel: each row of a prompt, attended in items of several rows,
    gives exactly what a one-row decode call for that token gives (the same folds), and matches the
    reference."""
    slices, heads, kv_heads, head_dim, window = case
    gen = torch.Generator().manual_seed(len(slices) * 7 + heads)
    k, v, tables = _paged(gen, [nc + nn for nc, nn in slices], kv_heads, head_dim, 16)
    seq_of_row = torch.cat([torch.full((nn,), i, dtype=torch.int32) for i, (_, nn) in enumerate(slices)])
    lens = torch.cat([torch.arange(nc + 1, nc + nn + 1, dtype=torch.int32) for nc, nn in slices])
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    out = paged_rows_attention_cpu(q, k, v, tables, seq_of_row, lens, head_dim**-0.5, window, rows_per_item)
    for t in range(len(lens)):
        s = int(seq_of_row[t])
        alone = paged_decode_attention_cpu(q[t:t + 1], k, v, tables[s:s + 1], lens[t:t + 1], head_dim**-0.5, window)
        assert torch.equal(out[t], alone[0]), f"row {t}"
    ref = paged_decode_attention_cpu_reference(q, k, v, tables.index_select(0, seq_of_row.long()), lens,
                                               head_dim**-0.5, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_rows_bad_inputs_raise_value_error():
    gen = torch.Generator().manual_seed(5)
    k, v, tables = _paged(gen, [20], 1, 64, 16)
    q = torch.randn(2, 4, 64, generator=gen)
    lens = torch.tensor([19, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_of_row\[1\] = 1 outside \[0, 1\)"):
        paged_rows_attention_cpu(q, k, v, tables, torch.tensor([0, 1]), lens, 0.1)
    with pytest.raises(ValueError, match="rows_per_item 9 outside"):
        paged_rows_attention_cpu(q, k, v, tables, torch.tensor([0, 0]), lens, 0.1, rows_per_item=9)
    with pytest.raises(ValueError, match="seq_of_row"):
        paged_rows_attention_cpu(q, k, v, tables, torch.tensor([0]), lens, 0.1)


def _step(gen: torch.Generator, slices: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
          windows: tuple[int, ...]):
    """A step's metadata (via the engine's builder), caches holding every token and the new queries."""
    block_size = 16
    k, v, tables = _paged(gen, [nc + nn for nc, nn in slices], kv_heads, head_dim, block_size)
    seqs = [SeqSlice(nc, nn, tables[i, : -(-(nc + nn) // block_size)].tolist()) for i, (nc, nn) in enumerate(slices)]
    meta = build_attention_metadata(seqs, block_size, sliding_windows=windows)
    q = torch.randn(sum(nn for _, nn in slices), heads, head_dim, generator=gen)
    return q, k, v, meta


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("slices", [
    [(0, 1), (37, 1), (1023, 1)],  # a decode step
    [(0, 12), (37, 1), (60, 5), (199, 1)],  # a mixed step: prefill chunks and decode rows
    [(0, 7), (20, 3)],  # no decode rows
], ids=["decode", "mixed", "prefill"])
def test_torch_backend_matches_sdpa(slices, window, threads):
    gen = torch.Generator().manual_seed(len(slices))
    q, k, v, meta = _step(gen, slices, 9, 3, 64, (24,))
    fast = get_attention_backend("torch")(q, k, v, meta, 0.125, window=window)
    plain = get_attention_backend("sdpa")(q, k, v, meta, 0.125, window=window)
    torch.testing.assert_close(fast, plain, atol=2e-5, rtol=1e-4)


def test_torch_backend_falls_back_for_other_dtypes():
    gen = torch.Generator().manual_seed(3)
    q, k, v, meta = _step(gen, [(5, 1), (30, 1)], 4, 1, 64, ())
    out = get_attention_backend("torch")(q.double(), k.double(), v.double(), meta, 0.125)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.float(), get_attention_backend("sdpa")(q, k, v, meta, 0.125), atol=1e-5, rtol=1e-4)

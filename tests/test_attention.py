"""Attention metadata values and the torch paged-attention backend vs a naive reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SeqSlice, build_attention_metadata, get_attention_backend
from engine.attention.torch_backend import paged_attention_torch

# ---- metadata on a hand-made step ------------------------------------------------------

def _hand_made():
    # block_size 4:
    #   seq0: fresh prefill of 3 tokens into block 5           -> slots 20 21 22
    #   seq1: 5 cached, 2 new (positions 5, 6) in blocks [2, 7] -> block 7 offsets 1, 2 -> 29 30
    #   seq2: 6 cached, 1 new (position 6) in blocks [3, 1]     -> block 1 offset 2 -> 6
    seqs = [SeqSlice(0, 3, [5]), SeqSlice(5, 2, [2, 7]), SeqSlice(6, 1, [3, 1])]
    return build_attention_metadata(seqs, block_size=4)


def test_metadata_values():
    m = _hand_made()
    assert m.positions.tolist() == [0, 1, 2, 5, 6, 6]
    assert m.slot_mapping.tolist() == [20, 21, 22, 29, 30, 6]
    assert m.query_start_loc.tolist() == [0, 3, 5, 6]
    assert m.seq_lens.tolist() == [3, 7, 7]
    assert m.block_tables.tolist() == [[5, 0], [2, 7], [3, 1]]
    assert m.logits_index.tolist() == [2, 4, 5]
    assert (m.max_query_len, m.max_seq_len, m.num_seqs) == (3, 7, 3)
    assert m.kv_gather_index.tolist() == [
        [20, 21, 22, 0, 0, 0, 0],
        [8, 9, 10, 11, 28, 29, 30],
        [12, 13, 14, 15, 4, 5, 6],
    ]
    assert m.query_pad_index.tolist() == [0, 1, 2, 3, 4, 6]
    assert m.positions.dtype == m.slot_mapping.dtype == m.logits_index.dtype == torch.int64
    assert m.query_start_loc.dtype == m.seq_lens.dtype == m.block_tables.dtype == torch.int32
    assert m.attn_mask.dtype == torch.bool


def test_metadata_mask():
    m = _hand_made()
    assert tuple(m.attn_mask.shape) == (3, 1, 3, 7)
    mask = m.attn_mask[:, 0].int().tolist()
    assert mask[0] == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]]
    assert mask[1] == [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0]]
    assert mask[2] == [[1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]


def test_metadata_single_decode_seq():
    m = build_attention_metadata([SeqSlice(16, 1, [9, 4, 2])], block_size=8)
    assert m.positions.tolist() == [16]
    assert m.slot_mapping.tolist() == [2 * 8 + 0]
    assert m.query_start_loc.tolist() == [0, 1]
    assert m.seq_lens.tolist() == [17]
    assert m.logits_index.tolist() == [0]
    assert m.kv_gather_index.tolist() == [list(range(72, 80)) + list(range(32, 40)) + [16]]


@pytest.mark.parametrize(
    ("seqs", "match"),
    [
        ([], "at least one sequence"),
        ([SeqSlice(0, 2, [1]), SeqSlice(3, 0, [2])], "at least one new token"),
        ([SeqSlice(3, 2, [1])], "cannot hold 5 tokens"),
    ],
)
def test_metadata_rejects_malformed_steps(seqs, match):
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(seqs, block_size=4)


# ---- paged_attention_torch vs a naive per-sequence reference --------------------------

def _naive_attention(q_seqs, k_seqs, v_seqs, num_computed, scale, window=None):
    """Plain causal softmax attention (within the last ``window`` positions when set), one
    sequence at a time, GQA by repeating K/V heads."""
    outs = []
    for q, k, v, nc in zip(q_seqs, k_seqs, v_seqs, num_computed):
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)  # [L, H, D]; query head h uses KV head h // rep
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale  # [H, new, context]
        # causal: new token i (position nc + i) sees positions 0..nc + i
        q_pos = nc + torch.arange(q.shape[0])[:, None]
        allowed = torch.arange(k.shape[0])[None, :] <= q_pos
        if window is not None:  # sliding window: position p sees p - window + 1 .. p
            allowed &= torch.arange(k.shape[0])[None, :] > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hql,lhd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def _run_case(lens, num_heads, num_kv_heads, block_size, head_dim=16, seed=0, window=None):
    """``lens``: (num_computed, num_new) per sequence. Blocks are drawn from a shuffled
    pool (non-contiguous tables) and every other cache slot holds garbage."""
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-(nc + nn) // block_size) for nc, nn in lens) + 3
    num_blocks = total_blocks + 1
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # never block 0
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 3
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 3

    slices, q_seqs, k_seqs, v_seqs = [], [], [], []
    for nc, nn in lens:
        n_blocks = -(-(nc + nn) // block_size)
        table = [free.pop() for _ in range(n_blocks)]
        k = torch.randn(nc + nn, num_kv_heads, head_dim, generator=g)
        v = torch.randn(nc + nn, num_kv_heads, head_dim, generator=g)
        # cached prefix and this step's new K/V at their slots
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(nc + nn)])
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        slices.append(SeqSlice(nc, nn, table))
        q_seqs.append(torch.randn(nn, num_heads, head_dim, generator=g))
        k_seqs.append(k)
        v_seqs.append(v)

    meta = build_attention_metadata(slices, block_size, sliding_windows=(window,) if window else ())
    scale = head_dim**-0.5
    q = torch.cat(q_seqs)
    out = paged_attention_torch(q, k_cache, v_cache, meta, scale, window=window)
    ref = _naive_attention(q_seqs, k_seqs, v_seqs, [nc for nc, _ in lens], scale, window=window)
    assert out.shape == (sum(nn for _, nn in lens), num_heads, head_dim)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    multi = [s.block_table for s in slices if len(s.block_table) > 1]
    if multi:  # the shuffled pool gives out-of-order tables
        assert any(t != list(range(t[0], t[0] + len(t))) for t in multi)
    return meta


CASES = {
    "prefill": [(0, 1), (0, 5), (0, 17), (0, 9), (0, 32)],
    "chunked": [(8, 5), (3, 7), (16, 16), (1, 2)],
    "decode": [(0, 1), (4, 1), (15, 1), (33, 1), (16, 1)],
    "mixed": [(0, 11), (20, 1), (7, 6), (2, 1), (0, 3)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_naive(case, num_heads, num_kv_heads, block_size):
    meta = _run_case(CASES[case], num_heads, num_kv_heads, block_size)
    assert meta.max_query_len == max(nn for _, nn in CASES[case])  # decode: the max_q == 1 path


WINDOW_CASES = {**CASES, "one_prefill": [(0, 19)], "one_decode": [(20, 1)]}  # + the single-sequence fast paths


@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("window", [1, 3, 6, 64])
def test_sliding_window_matches_naive(case, window):
    """Windows shorter than the contexts, crossing 4-token blocks (64: longer than every
    context, no mask needed)."""
    meta = _run_case(WINDOW_CASES[case], 6, 2, 4, seed=2, window=window)
    assert (window in meta.window_masks) == (window < meta.max_seq_len)


def test_metadata_window_mask():
    m = build_attention_metadata([SeqSlice(0, 3, [5]), SeqSlice(5, 2, [2, 7]), SeqSlice(6, 1, [3, 1])],
                                 block_size=4, sliding_windows=(2, 9))
    assert list(m.window_masks) == [2]  # 9 >= max_seq_len 7: the causal mask already is the window
    mask = m.window_masks[2][:, 0].int().tolist()
    assert mask[0] == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0]]
    assert mask[1] == [[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0]]
    assert mask[2] == [[0, 0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    q = torch.randn(6, 2, 8)
    cache = torch.randn(8, 4, 2, 8)
    with pytest.raises(KeyError, match="sliding window 3 missing"):
        paged_attention_torch(q, cache, cache, m, 0.3, window=3)


def test_decode_tables_are_non_contiguous():
    # the reverse-ordered table 7 -> 3 -> 5 is the interesting case for decode
    g = torch.Generator().manual_seed(1)
    h, kh, d, bs = 6, 2, 8, 4
    k_cache = torch.randn(9, bs, kh, d, generator=g)
    v_cache = torch.randn(9, bs, kh, d, generator=g)
    table = [7, 3, 5]
    q = torch.randn(1, h, d, generator=g)
    meta = build_attention_metadata([SeqSlice(9, 1, table)], bs)
    k = torch.stack([k_cache[table[p // bs], p % bs] for p in range(10)])
    v = torch.stack([v_cache[table[p // bs], p % bs] for p in range(10)])
    out = paged_attention_torch(q, k_cache, v_cache, meta, d**-0.5)
    ref = _naive_attention([q], [k], [v], [9], d**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # garbage elsewhere in the cache must not leak in: changing unused blocks changes nothing
    for b in (0, 1, 2, 4, 6, 8):
        k_cache[b] = 1e3
        v_cache[b] = -1e3
    k_cache[5, 2:] = 1e3  # slots past the context in the last block
    torch.testing.assert_close(paged_attention_torch(q, k_cache, v_cache, meta, d**-0.5), ref,
                               atol=1e-5, rtol=1e-5)


def test_registry_serves_torch_backend():
    assert get_attention_backend("torch") is paged_attention_torch
    with pytest.raises(KeyError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope")


@pytest.mark.parametrize("num_computed,num_new,kind", [(0, 37, "causal"), (36, 1, "none"), (20, 17, "mask")])
def test_single_sequence_fast_paths_match_the_explicit_mask(num_computed, num_new, kind):
    """One sequence: ``is_causal`` (no cached context) or no mask (one decode token) gives
    exactly what the explicit boolean mask gives."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(3)
    bs, kh, h, d = 8, 2, 6, 16
    k_cache = torch.randn(12, bs, kh, d, generator=g)
    v_cache = torch.randn(12, bs, kh, d, generator=g)
    meta = build_attention_metadata([SeqSlice(num_computed, num_new, [7, 2, 9, 4, 11, 1])], bs)
    assert meta.mask_kind == kind
    q = torch.randn(num_new, h, d, generator=g)
    fast = paged_attention_torch(q, k_cache, v_cache, meta, d**-0.5)
    masked = paged_attention_torch(q, k_cache, v_cache, replace(meta, mask_kind="mask"), d**-0.5)
    torch.testing.assert_close(fast, masked, rtol=1e-5, atol=1e-5)

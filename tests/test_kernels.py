"""Triton paged-attention kernels (engine/kernels/) against their plain-torch references.

Where the tests run:

* on a CUDA machine: in this process, on the GPU, compiled (``scripts/gpu_check.sh``);
* with ``TRITON_INTERPRET=1`` already set in the environment: in this process, on CPU,
  under the Triton interpreter;
* otherwise (CPU, plain ``pytest``): one test re-runs this file in a child ``pytest``
  with ``TRITON_INTERPRET=1``, and the kernel tests are not collected in this process.

Why a child process rather than setting ``os.environ["TRITON_INTERPRET"]`` at the top
of this module: Triton reads the variable when ``@triton.jit`` decorates a kernel, i.e.
when ``engine.kernels`` is first imported. In a shared pytest process that silently
depends on import order (any earlier import of ``engine.kernels``, e.g. another test
resolving the ``"triton"`` backend, yields compiled kernels that cannot run on CPU), and
the variable would leak into every later kernel and every subprocess later tests spawn
(Ray workers, gRPC servers). Unsetting it again after the import is not safe either:
``triton.language`` consults it at run time (``constexpr_function``). The child costs a
few seconds of start-up and keeps the parent process untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRET
RUN_HERE = ON_CUDA or INTERPRET
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
REPO = Path(__file__).resolve().parents[1]

if RUN_HERE:
    import triton

    from engine.attention import SeqSlice, build_attention_metadata, get_attention_backend
    from engine.kernels import paged_decode_attention as decode_mod
    from engine.kernels.paged_decode_attention import (
        paged_decode_attention,
        paged_decode_attention_reference,
    )
    from engine.kernels.triton_backend import paged_attention_triton
    from engine.kernels.varlen_prefill_attention import (
        varlen_prefill_attention,
        varlen_prefill_attention_reference,
    )
    from engine.model import default_attention_backend


@pytest.mark.skipif(RUN_HERE, reason="kernel tests run in this process")
def test_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    report = proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout, report


# ---- shared set-up ------------------------------------------------------------------------

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
POISON = 50.0  # value of every cache slot no sequence owns: a stray read shows up at once
BF16_INTERPRETER = pytest.mark.skipif(
    INTERPRET, reason="the Triton 3.9 interpreter computes bfloat16 tl.dot on raw bits "
    "(triton-lang/triton#11584; bf16 is unsupported there); bf16 runs on CUDA")


def _paged_step(lens, num_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.float32, seed=0, windows=()):
    """A step over a real-layout cache: ``lens`` = (num_computed, num_new) per sequence.

    Blocks come from a shuffled pool (non-contiguous, never block 0), the caches are
    layer slices of a ``[layers, 2, num_blocks, block_size, KH, D]`` tensor (non-zero base
    offset, as the model passes them) and every slot no sequence owns holds ``POISON``.

    Returns:
        ``(q [T, H, D], k_cache, v_cache, meta)``.
    """
    g = torch.Generator().manual_seed(seed)
    need = [triton.cdiv(nc + nn, block_size) for nc, nn in lens]
    num_blocks = sum(need) + 4
    pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    kv = torch.full((2, 2, num_blocks, block_size, num_kv_heads, head_dim), POISON)
    slices = []
    for (nc, nn), nb in zip(lens, need):
        table = [pool.pop() for _ in range(nb)]
        slices.append(SeqSlice(nc, nn, table))
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(nc + nn)])
        for kind in (0, 1):
            kv[1, kind].view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                nc + nn, num_kv_heads, head_dim, generator=g) * (2.0 if kind == 0 else 1.0)
    multi = [s.block_table for s in slices if len(s.block_table) > 1]
    if multi:  # the shuffled pool gives out-of-order tables
        assert any(t != list(range(t[0], t[0] + len(t))) for t in multi)
    kv = kv.to(device=DEVICE, dtype=dtype)
    q = torch.randn(sum(nn for _, nn in lens), num_heads, head_dim, generator=g).to(DEVICE, dtype)
    meta = build_attention_metadata(slices, block_size, device=DEVICE, sliding_windows=windows)
    return q, kv[1, 0], kv[1, 1], meta


def _close(out, ref, dtype):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


HEADS = {"mha": (4, 4), "gqa3": (6, 2), "gqa8": (8, 1)}


# ---- decode -------------------------------------------------------------------------------

class TestDecode:
    __test__ = RUN_HERE  # collected only where the kernels can run (see the module docstring)

    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("heads", list(HEADS))
    @pytest.mark.parametrize("partition_size", [None, 64], ids=["auto", "part64"])
    def test_boundary_lengths(self, heads, head_dim, partition_size):
        # context lengths 1, block_size - 1, block_size, block_size + 1 and 2.5 partitions
        lens = [(0, 1), (14, 1), (15, 1), (16, 1), (159, 1)]
        h, kh = HEADS[heads]
        q, k, v, meta = _paged_step(lens, h, kh, head_dim)
        assert meta.seq_lens.tolist() == [1, 15, 16, 17, 160]
        out = paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, head_dim**-0.5,
                                     max_seq_len=meta.max_seq_len, partition_size=partition_size)
        ref = paged_decode_attention_reference(q, k, v, meta.block_tables, meta.seq_lens, head_dim**-0.5)
        _close(out, ref, torch.float32)

    @pytest.mark.parametrize("heads", list(HEADS))
    def test_long_context_splits(self, heads):
        h, kh = HEADS[heads]
        q, k, v, meta = _paged_step([(999, 1)], h, kh, 64, seed=1)
        part = decode_mod.choose_partition_size(1, kh, 1000, num_sms=132)  # an H200's split
        assert triton.cdiv(1000, part) > 1
        for p in (part, 256):
            out = paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.125, partition_size=p)
            ref = paged_decode_attention_reference(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
            _close(out, ref, torch.float32)

    @pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_INTERPRETER)])
    def test_half_precision(self, dtype):
        q, k, v, meta = _paged_step([(0, 1), (16, 1), (300, 1)], 6, 2, 64, dtype=dtype, seed=2)
        for p in (None, 64):
            out = paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.125, partition_size=p)
            ref = paged_decode_attention_reference(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
            _close(out, ref, dtype)

    def test_reads_only_the_sequences_blocks(self):
        q, k, v, meta = _paged_step([(40, 1), (7, 1)], 6, 2, 64, seed=3)
        out = paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.125, partition_size=64)
        assert torch.isfinite(out).all()
        # the poison is the same everywhere unused: flipping it must change nothing
        k.masked_fill_(k == POISON, -POISON)
        v.masked_fill_(v == POISON, -POISON)
        again = paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.125, partition_size=64)
        torch.testing.assert_close(again, out, atol=0, rtol=0)

    @pytest.mark.parametrize("window", [1, 5, 16, 100])
    def test_sliding_window(self, window):
        # contexts shorter and longer than the window; 8-token blocks, so windows cross blocks
        lens = [(0, 1), (6, 1), (16, 1), (40, 1), (159, 1)]
        q, k, v, meta = _paged_step(lens, 6, 2, 64, block_size=8, seed=8)
        ref = paged_decode_attention_reference(q, k, v, meta.block_tables, meta.seq_lens, 0.125, window=window)
        for p in (None, 64):  # one partition, and several over the window (100 = 2 partitions)
            out = paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.125,
                                         max_seq_len=meta.max_seq_len, partition_size=p, window=window)
            _close(out, ref, torch.float32)
        if window < 160:  # the window drops context: the result differs from full attention
            full = paged_decode_attention_reference(q, k, v, meta.block_tables, meta.seq_lens, 0.125)
            assert not torch.allclose(full[-1], ref[-1])

    def test_choose_partition_size(self):
        bn = decode_mod.BLOCK_N
        assert decode_mod.choose_partition_size(128, 8, 4096, 132) == 4096  # 1024 programs: no split
        assert decode_mod.choose_partition_size(1, 8, 100, 132) == 128  # short: one split
        part = decode_mod.choose_partition_size(1, 8, 32768, 132)
        assert part % bn == 0 and 1 < triton.cdiv(32768, part) <= decode_mod.MAX_SPLITS
        assert part >= decode_mod.MIN_PARTITION

    def test_rejects_bad_inputs(self):
        q, k, v, meta = _paged_step([(3, 1)], 4, 4, 64)
        with pytest.raises(ValueError, match="int32"):
            paged_decode_attention(q, k, v, meta.block_tables.long(), meta.seq_lens, 0.1)
        with pytest.raises(ValueError, match="multiple of 64"):
            paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.1, partition_size=100)
        with pytest.raises(ValueError, match="multiple of num_kv_heads"):
            paged_decode_attention(q[:, :3], k, v, meta.block_tables, meta.seq_lens, 0.1)
        with pytest.raises(ValueError, match="window"):
            paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.1, window=0)


# ---- prefill ------------------------------------------------------------------------------

PREFILL = {
    "fresh": [(0, 1), (0, 5), (0, 17), (0, 70)],
    "prefix": [(8, 5), (3, 7), (16, 16), (40, 1), (70, 33)],
    "mixed": [(0, 11), (20, 1), (7, 6), (0, 1)],
}


class TestPrefill:
    __test__ = RUN_HERE

    @pytest.mark.parametrize("case", list(PREFILL))
    @pytest.mark.parametrize("heads", ["mha", "gqa3"])
    def test_matches_reference(self, case, heads):
        h, kh = HEADS[heads]
        q, k, v, meta = _paged_step(PREFILL[case], h, kh, 64, seed=4)
        out = varlen_prefill_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       0.125, max_query_len=meta.max_query_len)
        ref = varlen_prefill_attention_reference(q, k, v, meta.query_start_loc, meta.seq_lens,
                                                 meta.block_tables, 0.125)
        _close(out, ref, torch.float32)

    @pytest.mark.parametrize("window", [1, 7, 33])
    def test_sliding_window(self, window):
        # query tiles longer than the window: rows whose window starts past the tile's first
        # K/V tile (all masked there) must stay finite; 4-token blocks, windows cross them
        lens = PREFILL["prefix"] + [(0, 70)]
        q, k, v, meta = _paged_step(lens, 6, 2, 64, block_size=4, seed=9)
        out = varlen_prefill_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       0.125, max_query_len=meta.max_query_len, window=window)
        ref = varlen_prefill_attention_reference(q, k, v, meta.query_start_loc, meta.seq_lens,
                                                 meta.block_tables, 0.125, window=window)
        assert torch.isfinite(out).all()
        _close(out, ref, torch.float32)

    def test_head_dim_128_gqa8(self):
        q, k, v, meta = _paged_step([(5, 20), (0, 9)], 8, 1, 128, seed=5)
        out = varlen_prefill_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.09)
        ref = varlen_prefill_attention_reference(q, k, v, meta.query_start_loc, meta.seq_lens,
                                                 meta.block_tables, 0.09)
        _close(out, ref, torch.float32)

    @pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_INTERPRETER)])
    def test_half_precision(self, dtype):
        q, k, v, meta = _paged_step(PREFILL["prefix"], 6, 2, 64, dtype=dtype, seed=6)
        out = varlen_prefill_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
        ref = varlen_prefill_attention_reference(q, k, v, meta.query_start_loc, meta.seq_lens,
                                                 meta.block_tables, 0.125)
        _close(out, ref, dtype)

    def test_rejects_bad_query_start_loc(self):
        q, k, v, meta = _paged_step([(0, 3)], 4, 4, 64)
        with pytest.raises(ValueError, match="query_start_loc"):
            varlen_prefill_attention(q, k, v, meta.query_start_loc.long(), meta.seq_lens,
                                     meta.block_tables, 0.1)


# ---- the "triton" attention backend --------------------------------------------------------

class TestBackend:
    __test__ = RUN_HERE

    @pytest.mark.parametrize("case", ["mixed", "decode"])
    def test_agrees_with_torch_backend(self, case):
        lens = {"mixed": [(0, 9), (30, 1), (5, 12), (17, 1)], "decode": [(0, 1), (30, 1), (16, 1)]}[case]
        q, k, v, meta = _paged_step(lens, 6, 2, 64, seed=7)
        assert (meta.max_query_len == 1) == (case == "decode")
        triton_out = get_attention_backend("triton")(q, k, v, meta, 0.125)
        torch_out = get_attention_backend("torch")(q, k, v, meta, 0.125)
        _close(triton_out, torch_out, torch.float32)

    @pytest.mark.parametrize("case", ["mixed", "decode"])
    def test_window_agrees_with_torch_backend(self, case):
        lens = {"mixed": [(0, 21), (30, 1), (5, 12), (17, 1)], "decode": [(0, 1), (30, 1), (16, 1)]}[case]
        q, k, v, meta = _paged_step(lens, 6, 2, 64, block_size=4, seed=10, windows=(6,))
        assert 6 in meta.window_masks
        triton_out = get_attention_backend("triton")(q, k, v, meta, 0.125, window=6)
        torch_out = get_attention_backend("torch")(q, k, v, meta, 0.125, window=6)
        _close(triton_out, torch_out, torch.float32)
        assert not torch.allclose(torch_out, get_attention_backend("torch")(q, k, v, meta, 0.125))

    def test_registry_and_device_choice(self):
        assert get_attention_backend("triton") is paged_attention_triton
        assert default_attention_backend(torch.device("cpu")) == "torch"
        assert default_attention_backend(torch.device("cuda")) == "triton"

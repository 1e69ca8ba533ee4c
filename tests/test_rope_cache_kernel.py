"""The C++ RoPE + KV-write kernel (``engine/kernels/cpu/csrc/rope_cache.cpp``): bit-identical to the
decoder's torch expression (rotate-half RoPE, ``index_copy_`` into the paged cache) over SmolLM2's,
Qwen's and Gemma's head shapes, decode and prefill token counts, 1 and 2 threads; its argument
checks.

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu.build import load
from engine.kernels.cpu.rope_cache import rope_store_cpu, rope_store_reference, supports

needs_kernel = pytest.mark.skipif(load("rope_cache") is None, reason="the rope_cache extension could not be built")

# (tokens, heads, kv heads, head_dim): SmolLM2 decode/prefill, Qwen2.5-ish, Gemma 3 270M, odd
SHAPES = [(1, 9, 3, 64), (4, 9, 3, 64), (300, 9, 3, 64), (3, 14, 2, 64), (2, 4, 1, 256), (5, 2, 2, 6)]


def _inputs(t: int, h: int, kh: int, d: int, blocks: int = 24, block_size: int = 16):
    g = torch.Generator().manual_seed(t * 1000 + h * 10 + d)
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (h, kh, kh))
    angle = torch.randn(t, 1, d // 2, generator=g) * 50
    angle = torch.cat([angle, angle], dim=-1)
    cos, sin = angle.cos() * 1.1, angle.sin() * 1.1  # a YaRN-style scale: not unit length
    cache = torch.randn(3, 2, blocks, block_size, kh, d, generator=g)
    slots = torch.randperm(blocks * block_size, generator=g)[:t]
    return q, k, v, cos, sin, cache, slots


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_is_bit_identical_to_torch(shape, threads):
    q, k, v, cos, sin, cache, slots = _inputs(*shape)
    ref_cache = cache.clone()
    ref_q = rope_store_reference(q, k, v, cos, sin, ref_cache, 1, slots)
    k_before, v_before, q_in = k.clone(), v.clone(), q.clone()
    out = rope_store_cpu(q_in, k, v, cos, sin, cache, 1, slots)
    assert out.data_ptr() == q_in.data_ptr()  # rotated in place
    assert torch.equal(out, ref_q)
    assert torch.equal(cache, ref_cache)  # K and V of layer 1 at the slots, nothing else touched
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


@needs_kernel
def test_supports_only_cpu_float32_contiguous_cache():
    q, _, _, _, _, cache, _ = _inputs(1, 9, 3, 64)
    assert supports(q, cache)
    assert not supports(q.double(), cache.double())
    assert not supports(q, cache.transpose(2, 3))


@needs_kernel
@pytest.mark.parametrize("bad,match", [
    (lambda a: a.update(slots=torch.tensor([384])), r"slot_mapping\[0\] = 384 outside \[0, 384\)"),
    (lambda a: a.update(slots=torch.tensor([-1])), r"slot_mapping\[0\] = -1 outside"),
    (lambda a: a.update(slots=torch.tensor([0, 1])), "slot_mapping must be"),
    (lambda a: a.update(slots=torch.tensor([0], dtype=torch.int32)), "slot_mapping must be"),
    (lambda a: a.update(layer=3), r"layer 3 outside \[0, 3\)"),
    (lambda a: a.update(q=a["q"].double()), "q must be a contiguous CPU float32"),
    (lambda a: a.update(k=a["k"][:, :, :32]), "k must be a contiguous"),
    (lambda a: a.update(cos=a["cos"][:, :, :32].contiguous()), "cos and sin must hold"),
    (lambda a: a.update(cache=a["cache"][:, :, :, :, :1].contiguous()), "kv_cache must be"),
], ids=["slot-high", "slot-negative", "slot-count", "slot-dtype", "layer", "q-dtype", "k-strided", "cos-shape",
        "cache-heads"])
def test_bad_arguments_raise_naming_them(bad, match):
    q, k, v, cos, sin, cache, slots = _inputs(1, 9, 3, 64)
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, cache=cache, layer=1, slots=slots)
    bad(args)
    before = args["cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        rope_store_cpu(args["q"], args["k"], args["v"], args["cos"], args["sin"], args["cache"], args["layer"],
                       args["slots"])
    assert torch.equal(args["cache"], before)  # checked before anything is written


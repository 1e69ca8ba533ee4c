"""BlockPool: allocation order, reference counts, error paths, the null block."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, NoFreeBlocksError, blocks_needed


def _state(pool: BlockPool) -> tuple[list[int], list[int]]:
    return list(pool._free), list(pool._ref)


def test_fresh_pool_geometry():
    pool = BlockPool(8)
    assert pool.num_blocks == 8
    assert pool.num_usable == 7
    assert pool.num_free == 7
    assert list(pool._free) == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("n", [0, 1])
def test_too_small_pool_rejected(n):
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(n)


def test_allocate_takes_from_head_with_refcount_one():
    pool = BlockPool(8)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    assert pool.num_free == 2
    assert [pool._ref[b] for b in range(8)] == [0, 1, 1, 1, 1, 1, 0, 0]
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    got = pool.allocate(4)
    assert got == [1, 2, 3, 4] and 0 not in got
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(got)
    # many cycles in shuffled free order: block 0 never appears
    for _ in range(10):
        blocks = pool.allocate(4)
        assert 0 not in blocks and sorted(blocks) == [1, 2, 3, 4]
        pool.free(blocks[::-1])
    assert pool.num_free == pool.num_usable


def test_no_free_blocks_leaves_pool_unchanged():
    pool = BlockPool(6)
    held = pool.allocate(3)
    before = _state(pool)
    with pytest.raises(NoFreeBlocksError, match="asked for 3 KV blocks, 2 free"):
        pool.allocate(3)
    assert _state(pool) == before
    assert pool.num_free == 2
    assert pool.allocate(2) == [4, 5]  # the two that were free are still there, in order
    pool.free(held + [4, 5])
    assert pool.num_free == pool.num_usable


def test_freed_blocks_go_to_tail():
    pool = BlockPool(8)
    assert pool.allocate(3) == [1, 2, 3]
    assert list(pool._free) == [4, 5, 6, 7]
    pool.free([2])
    pool.free([3, 1])
    assert list(pool._free) == [4, 5, 6, 7, 2, 3, 1]
    assert pool.allocate(5) == [4, 5, 6, 7, 2]
    assert pool.allocate(2) == [3, 1]


def test_refcount_block_freed_only_at_zero():
    pool = BlockPool(4)
    b = pool.allocate(2)  # [1, 2]
    pool.touch([1])  # a second and third holder (a shared prefix block)
    pool.touch([1])
    assert pool._ref[1] == 3
    pool.free(b)  # 1 -> 2 refs, 2 -> free
    assert list(pool._free) == [3, 2]
    pool.free([1])
    assert list(pool._free) == [3, 2]
    assert pool._ref[1] == 1
    pool.free([1])
    assert list(pool._free) == [3, 2, 1]
    assert pool._ref == [0, 0, 0, 0]


@pytest.mark.parametrize("bad", [0, -1, 4])
def test_touch_invalid_block_raises(bad):
    pool = BlockPool(4)
    before = _state(pool)
    with pytest.raises(ValueError, match=f"invalid block {bad}"):
        pool.touch([1, bad])
    assert _state(pool) == before


def test_double_free_raises_and_keeps_free_list():
    pool = BlockPool(4)
    b = pool.allocate(1)
    pool.free(b)
    before = _state(pool)
    with pytest.raises(ValueError, match="double free or invalid block 1"):
        pool.free(b)
    assert _state(pool) == before
    assert list(pool._free).count(1) == 1


@pytest.mark.parametrize("bad", [0, -1, 3])
def test_free_invalid_or_unallocated_block_raises(bad):
    pool = BlockPool(4)
    before = _state(pool)
    with pytest.raises(ValueError, match=f"double free or invalid block {bad}"):
        pool.free([bad])
    assert _state(pool) == before


@pytest.mark.parametrize(
    ("tokens", "block_size", "want"),
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3),
     (1, 1, 1), (7, 1, 7), (40, 4, 10), (41, 4, 11)],
)
def test_blocks_needed(tokens, block_size, want):
    assert blocks_needed(tokens, block_size) == want

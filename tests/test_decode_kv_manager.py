"""DecodeKvManager: watermark admission, transfer reservations, growth, preemption
choice, free. No model: requests are plain :class:`Request` objects."""

from __future__ import annotations

import pytest

from decode_worker.kv_manager import DecodeKvManager
from engine.block_pool import NoFreeBlocksError
from engine.config import CacheConfig
from engine.request import Request, RequestParams
from engine.sampling import SamplingOptions

BS = 4


def _kv(num_blocks: int = 11, watermark: float = 0.0) -> DecodeKvManager:
    return DecodeKvManager(CacheConfig(block_size=BS, num_blocks=num_blocks), watermark)


def _req(rid: str, prompt_len: int, generated: int = 0) -> Request:
    params = RequestParams(max_tokens=16, sampling=SamplingOptions(temperature=0.0))
    return Request(rid, list(range(prompt_len)), params, output_token_ids=list(range(generated)))


def test_geometry_and_watermark_blocks():
    kv = _kv(num_blocks=11, watermark=0.25)
    assert kv.num_usable == kv.num_free == 10
    assert kv.watermark_blocks == 2  # int(0.25 * 10)
    assert kv.num_in_transfer == 0


def test_watermark_admission():
    kv = _kv(num_blocks=11, watermark=0.25)  # 10 usable, 2 kept free once something runs
    # an idle pool ignores the watermark: 36 tokens + 1 of growth = 10 blocks, all of them
    assert kv.can_allocate(9 * BS)
    assert not kv.can_allocate(10 * BS)  # 41 tokens: 11 blocks never fit
    a = _req("a", 2 * BS)
    kv.allocate(a, 2 * BS)
    assert kv.num_free == 8
    assert kv.can_allocate(6 * BS - 1)  # 23 tokens + 1 of growth = 6 blocks: 8 - 6 = 2 stay free
    assert not kv.can_allocate(6 * BS)  # 24 + 1 of growth = 7 blocks: 8 - 7 = 1 < 2
    kv.free(a)
    assert kv.can_allocate(9 * BS)  # idle again


def test_allocate_sets_block_table_and_counts_transfers():
    kv = _kv()
    a, b = _req("a", 5), _req("b", 8)
    blocks = kv.allocate(a, 5, in_transfer=True)
    assert blocks is a.block_table and len(blocks) == 2 and 0 not in blocks
    kv.allocate(b, 8)
    assert len(b.block_table) == 2
    assert kv.num_in_transfer == 2 and kv.num_free == 6
    kv.transfer_ended(a)  # the KV landed: a keeps its blocks
    assert kv.num_in_transfer == 0 and a.block_table == blocks
    kv.transfer_ended(a)  # idempotent
    with pytest.raises(ValueError, match="already holds 2 KV blocks"):
        kv.allocate(a, 5)
    with pytest.raises(NoFreeBlocksError):
        kv.allocate(_req("c", 40), 40)
    assert kv.num_free == 6


def test_grow_appends_a_block_only_at_a_block_boundary():
    kv = _kv(num_blocks=4)  # 3 usable
    r = _req("r", BS, generated=0)
    kv.allocate(r, BS - 1)  # the prompt's last token is not cached yet
    assert len(r.block_table) == 1
    assert kv.grow(r) and len(r.block_table) == 1  # position BS - 1 is in block 0
    r.output_token_ids.append(7)  # position BS starts block 1
    assert kv.grow(r) and len(r.block_table) == 2
    assert kv.grow(r) and len(r.block_table) == 2  # already has room: nothing taken
    other = _req("o", BS)
    kv.allocate(other, BS)
    assert kv.num_free == 0
    r.output_token_ids += [8] * BS  # needs a third block: none free
    before = list(r.block_table)
    assert not kv.grow(r)
    assert r.block_table == before and kv.num_free == 0
    kv.free(other)
    assert kv.grow(r) and len(r.block_table) == 3


def test_choose_victim_is_the_most_recently_admitted():
    kv = _kv()
    assert kv.choose_victim(["a", "b", "c"]) == "c"
    assert kv.choose_victim(["a"]) == "a"
    with pytest.raises(ValueError, match="no running request"):
        kv.choose_victim([])


def test_free_returns_every_block():
    kv = _kv(num_blocks=11)
    reqs = [_req(f"r{i}", 3 + i) for i in range(4)]
    for i, r in enumerate(reqs):
        kv.allocate(r, 3 + i, in_transfer=i % 2 == 0)
    reqs[1].output_token_ids += [1] * 6
    assert kv.grow(reqs[1])
    assert kv.num_free < kv.num_usable and kv.num_in_transfer == 1 + 2  # r0 and r2
    for r in reqs:
        kv.free(r)
        assert r.block_table == []
    assert kv.num_free == kv.num_usable and kv.num_in_transfer == 0
    kv.free(reqs[0])  # no blocks: no-op
    assert kv.num_free == kv.num_usable
    # every block can be handed out again, the null block never
    big = _req("big", 10 * BS)
    assert sorted(kv.allocate(big, 10 * BS)) == list(range(1, 11))

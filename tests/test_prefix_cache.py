"""Prefix caching: chained block hashes, LRU eviction, exact cached-token accounting,
and blocks visible only once their KV is written."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from common.prefix_hash import block_hashes
from engine.block_pool import BlockPool
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import allocate_kv_cache
from engine.model_runner import ModelRunner
from engine.request import Request, RequestParams
from engine.sampling import SamplingOptions
from prefill_worker.scheduler import PrefillScheduler

from sched_helpers import model, text_ids  # noqa: F401 - fixtures


def test_block_hashes_chain_and_salt():
    a = block_hashes(list(range(40)), 16, "m")
    assert len(a) == 2 and all(len(h) == 8 for h in a)
    assert block_hashes(list(range(32)), 16, "m") == a  # the partial third block has no hash
    b = block_hashes([99] + list(range(1, 40)), 16, "m")
    assert b[0] != a[0] and b[1] != a[1]  # a change in block 0 changes every later hash
    assert block_hashes(list(range(40)), 16, "other") != a
    assert block_hashes(list(range(16, 32)), 16, "m", parent=a[0]) == [a[1]]


def test_pool_cache_lookup_touch_and_lru_eviction():
    pool = BlockPool(5)  # 4 usable
    blocks = pool.allocate(2)
    pool.cache(blocks[0], b"h0")
    pool.cache(blocks[1], b"h1")
    assert pool.lookup([b"h0", b"h1", b"h2"]) == blocks
    pool.free(blocks)
    assert pool.num_free == 4 and pool.num_cached == 2  # evictable, still findable
    pool.touch([blocks[0]])  # a hit pulls it off the free list
    assert pool.num_free == 3 and pool.ref_count(blocks[0]) == 1
    pool.free([blocks[0]])
    # the two never-used blocks go first, then the least recently freed cached block (h1)
    taken = pool.allocate(3)
    assert blocks[1] in taken and blocks[0] not in taken
    assert pool.lookup([b"h1"]) == [] and pool.lookup([b"h0"]) == [blocks[0]]
    pool.free(taken)
    assert pool.num_free == pool.num_usable


def _runner(model, model_config, num_blocks, block_size=16):
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    return ModelRunner(model, allocate_kv_cache(model_config, cache, torch.device("cpu")), block_size)


def _req(rid, prompt):
    return Request(rid, list(prompt), RequestParams(max_tokens=4, sampling=SamplingOptions(temperature=0.0)))


def _run(sched, req):
    fut = sched.submit(req, lambda r, progress: 123)
    while not fut.done():
        sched.step()
    return fut.result()


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("length", [63, 64, 65, 128])
def test_second_send_is_a_prefix_hit_with_exact_cached_tokens(model, model_config, text_ids, block_size, length):
    prompt = (text_ids * 4)[:length]
    runner = _runner(model, model_config, num_blocks=32, block_size=block_size)
    sched = PrefillScheduler(runner, CacheConfig(block_size=block_size, num_blocks=32),
                             SchedulerConfig(max_num_batched_tokens=512), model_id="smol")
    first = _run(sched, _req("a", prompt))
    second = _run(sched, _req("b", prompt))
    full_blocks = length // block_size
    expected = (full_blocks - (1 if full_blocks * block_size == length else 0)) * block_size
    assert first.cached_tokens == 0
    assert second.cached_tokens == expected  # always recomputes at least the last token
    assert 0 <= second.cached_tokens < length
    assert second.first_token_id == first.first_token_id
    assert sched.pool.num_free == sched.pool.num_usable  # nothing held, cached blocks evictable
    sched.shutdown()


def test_block_whose_write_failed_is_not_visible(model, model_config, text_ids):
    prompt = (text_ids * 2)[:48]
    runner = _runner(model, model_config, num_blocks=16)
    sched = PrefillScheduler(runner, CacheConfig(block_size=16, num_blocks=16), SchedulerConfig(), model_id="m")
    real = runner.execute

    def broken(plan):
        runner.kv_cache[:, :, 1:4] = float("nan")  # a partial write, then the step dies
        raise RuntimeError("device fault")

    runner.execute = broken
    fut: Future = sched.submit(_req("x", prompt), lambda r, progress: 0)
    sched.step()
    with pytest.raises(Exception, match="prefill step failed"):
        fut.result(timeout=1)
    assert sched.pool.num_cached == 0  # nothing from the failed step is findable
    runner.execute = real
    res = _run(sched, _req("y", prompt))
    assert res.cached_tokens == 0
    assert sched.pool.num_cached == 3
    sched.shutdown()

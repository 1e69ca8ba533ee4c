"""DecodeScheduler driven step by step over the real model runner.

The run loop is never started: each test calls ``step()`` by hand. The scheduler
receives real KV computed by a colocated runner and written through its
:class:`TransferTable`. Shared helpers and the ``model`` / ``text_ids`` fixtures:
``sched_helpers.py``.
"""

from __future__ import annotations

import queue
import time

import grpc
import pytest
import torch

from decode_worker.events import Failed, Reserved, Tokens
from engine.block_pool import blocks_needed
from engine.request import RequestStatus
from kvtransfer.errors import StaleTransferError

from sched_helpers import (  # noqa: F401 - fixtures
    BS,
    _collect_tokens,
    _colocated,
    _decode_sched,
    _deliver,
    _events,
    _no_decode_leak,
    _req,
    _reserve,
    model,
    text_ids,
)


def test_decode_reserve_write_complete_until_length(model, model_config, text_ids):
    prompt = text_ids[:21]
    kv, want = _colocated(model, model_config, prompt, 5)
    runner, sched = _decode_sched(model, model_config)
    req = _req("d", prompt, max_tokens=5)
    stream, res = _reserve(sched, req)
    assert res.transfer_id == "xfer-d"
    assert len(res.block_ids) == blocks_needed(21, BS) == 2 and 0 not in res.block_ids
    assert req.status == RequestStatus.TRANSFERRING
    assert sched.transfers.is_open("xfer-d", res.generation)
    assert sched.kv.num_free == sched.kv.num_usable - 2

    _deliver(sched, res, kv, want[0])
    torch.testing.assert_close(runner.kv_cache[:, :, res.block_ids], kv, atol=0, rtol=0)
    events = _collect_tokens(sched, stream)
    assert [e.token_ids for e in events] == [[t] for t in want]
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    assert all(e.logprobs == [None] for e in events)
    assert sched.step_count == 4  # the first token came from the prefill side
    assert req.output_token_ids == want and req.status == RequestStatus.FINISHED
    assert not sched.has_request("d")
    _no_decode_leak(sched)


def test_decode_batches_two_requests_and_grows_blocks(model, model_config, text_ids):
    # r1 crosses a block boundary while decoding (15-token prompt: block 2 is allocated on step 2)
    p1, p2 = text_ids[:15], text_ids[3:30]
    kv1, want1 = _colocated(model, model_config, p1, 4)
    kv2, want2 = _colocated(model, model_config, p2, 3)
    runner, sched = _decode_sched(model, model_config)
    s1, r1 = _reserve(sched, _req("r1", p1, max_tokens=4))
    s2, r2 = _reserve(sched, _req("r2", p2, max_tokens=3))
    assert len(r1.block_ids) == 1 and len(r2.block_ids) == 2
    _deliver(sched, r1, kv1, want1[0])
    _deliver(sched, r2, kv2, want2[0])
    e2 = _collect_tokens(sched, s2)
    e1 = _collect_tokens(sched, s1)
    assert [t for e in e1 for t in e.token_ids] == want1
    assert [t for e in e2 for t in e.token_ids] == want2
    assert sched.step_count == 3  # both ran in the same steps; r1 alone for its last one
    _no_decode_leak(sched)


def test_decode_admission_backpressure(model, model_config, text_ids):
    # 7 usable blocks: a holds blocks_needed(17) = 2, b needs blocks_needed(90 + 1) = 6 > 5 free
    runner, sched = _decode_sched(model, model_config, num_blocks=8)
    pa = text_ids[:17]
    kv_a, want_a = _colocated(model, model_config, pa, 4)
    sa, ra = _reserve(sched, _req("a", pa, max_tokens=4))
    sb: queue.Queue = queue.Queue()
    b = _req("b", (text_ids * 2)[:90], max_tokens=10)
    sched.submit_reserve(b, sb)
    sched.step()
    assert _events(sb) == []  # waits: 2 + 6 > 7
    assert b.status == RequestStatus.WAITING and b.block_table == []
    load = sched.load()  # a awaits its KV, b blocks: neither is in the batch (running means in the batch, as vLLM's)
    assert (load["num_waiting"], load["num_running"]) == (2, 0)
    _deliver(sched, ra, kv_a, want_a[0])
    events = _collect_tokens(sched, sa)
    assert [t for e in events for t in e.token_ids] == want_a
    assert _events(sb) == []  # a's last step released it; b is admitted on the next step
    sched.step()
    ev = _events(sb)
    assert len(ev) == 1 and isinstance(ev[0], Reserved)
    assert len(ev[0].block_ids) == blocks_needed(90, BS) == 6
    assert (sched.load()["num_waiting"], sched.load()["num_running"]) == (1, 0)  # b awaits its KV
    sched.submit_abort("b")
    sched.step()
    assert _events(sb) == [Tokens([], [], "abort")]
    _no_decode_leak(sched)


def test_decode_request_that_never_fits_is_invalid_argument(model, model_config, text_ids):
    runner, sched = _decode_sched(model, model_config, num_blocks=8)
    stream: queue.Queue = queue.Queue()
    sched.submit_reserve(_req("huge", text_ids[:60], max_tokens=100), stream)  # 10 blocks > 7
    sched.step()
    (ev,) = _events(stream)
    assert isinstance(ev, Failed) and ev.code == grpc.StatusCode.INVALID_ARGUMENT  # HTTP 400, not a retryable 429
    assert "10 KV blocks" in ev.message and "max_tokens (100)" in ev.message and "(7 blocks)" in ev.message
    assert not sched.has_request("huge")
    _no_decode_leak(sched)
    # a second reservation under a live request id is refused; the first one is untouched
    first, res = _reserve(sched, _req("twice", text_ids[:10]))
    again: queue.Queue = queue.Queue()
    sched.submit_reserve(_req("twice", text_ids[:10]), again)
    sched.step()
    (ev,) = _events(again)
    assert isinstance(ev, Failed) and ev.code == grpc.StatusCode.ALREADY_EXISTS
    assert sched.transfers.is_open(res.transfer_id, res.generation)
    # the refused call's end aborts its own reservation only, even under the same transfer id
    sched.submit_abort("twice", res.transfer_id, again)
    sched.step()
    assert sched.transfers.is_open(res.transfer_id, res.generation) and _events(first) == []
    # another request under a transfer id in use is refused: the first one's transfer stays its own
    clash: queue.Queue = queue.Queue()
    other = _req("other", text_ids[:10])
    other.transfer_id = res.transfer_id
    sched.submit_reserve(other, clash)
    sched.step()
    (ev,) = _events(clash)
    assert isinstance(ev, Failed) and ev.code == grpc.StatusCode.ALREADY_EXISTS and "in use" in ev.message
    assert sched.transfers.is_open(res.transfer_id, res.generation) and not sched.has_request("other")
    sched.submit_abort("twice", stream=first)
    sched.step()
    assert _events(first) == [Tokens([], [], "abort")]
    _no_decode_leak(sched)


def test_decode_lease_expiry_reclaims_blocks(model, model_config, text_ids):
    runner, sched = _decode_sched(model, model_config, lease_s=0.2)
    req = _req("slow", text_ids[:40], max_tokens=3)
    stream, res = _reserve(sched, req)
    assert sched.kv.num_free == sched.kv.num_usable - 3
    time.sleep(0.25)
    sched.step()
    (ev,) = _events(stream)
    assert isinstance(ev, Failed) and ev.code == grpc.StatusCode.UNAVAILABLE
    assert "lease expired" in ev.message
    assert sched.num_failed_transfers == 1
    _no_decode_leak(sched)
    # the late prefill worker is turned away and its completion is ignored
    kv = torch.ones(runner.kv_cache.shape[0], 2, 3, *runner.kv_cache.shape[3:])
    before = runner.kv_cache.clone()
    with pytest.raises(StaleTransferError):
        sched.transfers.write(res.transfer_id, res.generation, 0, kv.shape[0], res.block_ids, kv)
    sched.kv_complete(res.transfer_id, res.generation, 7, None)
    sched.step()
    assert _events(stream) == []
    assert torch.equal(runner.kv_cache, before)
    _no_decode_leak(sched)


def test_decode_kv_failed_is_unavailable(model, model_config, text_ids):
    runner, sched = _decode_sched(model, model_config)
    stream, res = _reserve(sched, _req("x", text_ids[:10]))
    sched.kv_failed(res.transfer_id, res.generation, "checksum mismatch")
    sched.step()
    (ev,) = _events(stream)
    assert isinstance(ev, Failed) and ev.code == grpc.StatusCode.UNAVAILABLE
    assert "checksum mismatch" in ev.message
    _no_decode_leak(sched)


def test_decode_stale_write_after_abort(model, model_config, text_ids):
    runner, sched = _decode_sched(model, model_config)
    stream, res = _reserve(sched, _req("s", text_ids[:20]))
    layers = runner.kv_cache.shape[0]
    kv = torch.full((layers, 2, len(res.block_ids), *runner.kv_cache.shape[3:]), 5.0)
    # a write with another generation or into foreign blocks is refused while open
    with pytest.raises(StaleTransferError):
        sched.transfers.write(res.transfer_id, res.generation + 1, 0, layers, res.block_ids, kv)
    foreign = [b for b in range(1, 32) if b not in res.block_ids][:len(res.block_ids)]
    with pytest.raises(StaleTransferError):
        sched.transfers.write(res.transfer_id, res.generation, 0, layers, foreign, kv)
    assert float(runner.kv_cache.abs().sum()) == 0.0

    sched.submit_abort("s")
    sched.step()
    assert _events(stream) == [Tokens([], [], "abort")]
    _no_decode_leak(sched)
    # the blocks now belong to someone else: the late chunk must not land in them
    stream2, res2 = _reserve(sched, _req("s2", text_ids[:20]))
    before = runner.kv_cache.clone()
    with pytest.raises(StaleTransferError):
        sched.transfers.write(res.transfer_id, res.generation, 0, layers, res.block_ids, kv)
    assert torch.equal(runner.kv_cache, before)
    sched.submit_abort("s2")
    sched.step()
    assert _events(stream2) == [Tokens([], [], "abort")]
    _no_decode_leak(sched)


def test_decode_abort_while_running_and_while_waiting(model, model_config, text_ids):
    prompt = text_ids[:12]
    kv, want = _colocated(model, model_config, prompt, 2)
    runner, sched = _decode_sched(model, model_config, num_blocks=8)
    stream, res = _reserve(sched, _req("run", prompt, max_tokens=50))  # holds 1 of 7 blocks
    waiting: queue.Queue = queue.Queue()
    sched.submit_reserve(_req("wait", (text_ids * 2)[:100], max_tokens=10), waiting)  # needs 7: waits
    _deliver(sched, res, kv, want[0])
    sched.step()  # first token + one decode step
    ev = _events(stream)
    assert [e.token_ids for e in ev] == [[want[0]], [want[1]]]
    assert _events(waiting) == []
    sched.submit_abort("wait")
    sched.submit_abort("run")
    sched.step()
    assert _events(waiting) == [Tokens([], [], "abort")]
    assert _events(stream) == [Tokens([], [], "abort")]
    assert sched.step_count == 1
    assert not sched.has_request("run") and not sched.has_request("wait")
    _no_decode_leak(sched)

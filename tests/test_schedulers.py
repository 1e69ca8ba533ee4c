"""PrefillScheduler and DecodeScheduler driven step by step over the real model runner.

The run loops are never started: each test calls ``step()`` by hand. The prefill
side's KV sender is a fake that records what it was handed (the one stand-in of
this file); the decode side receives real KV computed by a colocated runner and
written through its :class:`TransferTable`.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
import torch

from decode_worker.events import Failed, Reserved, Tokens
from decode_worker.scheduler import DecodeScheduler
from engine.block_pool import blocks_needed
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.request import Request, RequestParams, RequestStatus
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan
from kvtransfer.errors import StaleTransferError
from prefill_worker.scheduler import PrefillError, PrefillResult, PrefillScheduler

CPU = torch.device("cpu")
BS = 16
TEXT = (
    "In the early morning the harbour was quiet, and the fishing boats rocked gently against the "
    "old wooden pier while gulls circled overhead, waiting for the first catch of the day to be "
    "unloaded onto the cold stone quay by the tired fishermen who had been out since midnight. "
    "Later the market opened, and the smell of salt, tar and fresh bread filled the narrow streets."
)


@pytest.fixture(scope="module")
def model(model_config):
    return load_model(model_config, CPU, torch.float32)


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 64
    return ids


def _runner(model, model_config, num_blocks=32) -> ModelRunner:
    kv = allocate_kv_cache(model_config, CacheConfig(block_size=BS, num_blocks=num_blocks), CPU)
    return ModelRunner(model, kv, BS)


def _req(rid: str, prompt: list[int], max_tokens: int = 4, logprobs: int = 0) -> Request:
    params = RequestParams(max_tokens=max_tokens, sampling=SamplingOptions(temperature=0.0, logprobs=logprobs),
                           ignore_eos=True)
    return Request(rid, list(prompt), params, transfer_id=f"xfer-{rid}")


def _no_leak(sched) -> None:
    assert sched.pool.num_free == sched.pool.num_usable


# ---- prefill ---------------------------------------------------------------------------

class FakeSend:
    """KV sender stand-in: records the block table it was handed (and a copy of those
    blocks' KV), returns a byte count, optionally blocks on a gate or raises."""

    def __init__(self, runner: ModelRunner, gate: threading.Event | None = None,
                 error: BaseException | None = None) -> None:
        self.runner = runner
        self.gate = gate
        self.error = error
        self.calls: list[tuple[str, list[int], int]] = []
        self.kv: dict[str, torch.Tensor] = {}
        self.entered = threading.Event()

    def bytes_for(self, blocks: list[int]) -> int:
        per_block = self.runner.kv_cache[:, :, 0].numel() * self.runner.kv_cache.element_size()
        return len(blocks) * per_block

    def __call__(self, request: Request, first_token: int, first_logprobs) -> int:
        blocks = list(request.block_table)
        self.calls.append((request.request_id, blocks, first_token))
        self.kv[request.request_id] = self.runner.kv_cache[:, :, blocks].clone()
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test never opened the gate"
        if self.error is not None:
            raise self.error
        return self.bytes_for(blocks)


class PlanRecorder:
    """Wraps the real runner's ``execute`` to keep every step plan."""

    def __init__(self, runner: ModelRunner) -> None:
        self.plans: list[StepPlan] = []
        self._execute = runner.execute
        runner.execute = self  # instance attribute shadows the method

    def __call__(self, plan: StepPlan):
        self.plans.append(plan)
        return self._execute(plan)


def _prefill_sched(model, model_config, budget=2048, num_blocks=32, max_num_seqs=64, prefix_caching=False):
    runner = _runner(model, model_config, num_blocks)
    sched = PrefillScheduler(runner, CacheConfig(block_size=BS, num_blocks=num_blocks,
                                                 enable_prefix_caching=prefix_caching),
                             SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs))
    return runner, sched


def _pump(sched, done, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "scheduler made no progress"
        sched.step()


def _first_token(model, model_config, prompt: list[int], logprobs: int = 0):
    """Unchunked greedy first token (and its logprobs) from a bare runner."""
    runner = _runner(model, model_config)
    table = list(range(1, blocks_needed(len(prompt), BS) + 1))
    out = runner.execute(StepPlan([ScheduledSeq("ref", prompt, 0, table, True,
                                                SamplingOptions(temperature=0.0, logprobs=logprobs))]))
    return out.token_ids[0], out.logprobs[0], runner.kv_cache[:, :, table].clone()


@pytest.fixture
def prefill_env(model, model_config):
    made = []

    def make(**kw):
        runner, sched = _prefill_sched(model, model_config, **kw)
        made.append(sched)
        return runner, sched

    yield make
    for s in made:
        s.shutdown()


def test_prefill_batches_waiting_requests_into_one_step(prefill_env, model, model_config, text_ids):
    runner, sched = prefill_env()
    rec = PlanRecorder(runner)
    send = FakeSend(runner)
    prompts = {"a": text_ids[:10], "b": text_ids[5:25], "c": text_ids[:33]}
    futs = {rid: sched.submit(_req(rid, p), send) for rid, p in prompts.items()}
    sched.step()
    assert len(rec.plans) == 1
    plan = rec.plans[0]
    assert [s.request_id for s in plan.seqs] == ["a", "b", "c"]
    assert [s.num_computed for s in plan.seqs] == [0, 0, 0]
    assert [s.sample for s in plan.seqs] == [True, True, True]
    assert plan.num_tokens == 10 + 20 + 33
    # distinct blocks, as many as each prompt needs
    tables = [s.block_table for s in plan.seqs]
    assert [len(t) for t in tables] == [1, 2, 3]
    assert len({b for t in tables for b in t}) == 6 and 0 not in {b for t in tables for b in t}

    _pump(sched, lambda: all(f.done() for f in futs.values()))
    assert len(rec.plans) == 1  # nothing else was computed
    sent = {rid: (blocks, tok) for rid, blocks, tok in send.calls}
    for (rid, prompt), table in zip(prompts.items(), tables):
        res = futs[rid].result()
        assert isinstance(res, PrefillResult)
        want_tok, _, want_kv = _first_token(model, model_config, prompt)
        assert res.first_token_id == want_tok
        assert sent[rid] == (table, want_tok)
        assert res.kv_bytes_sent == send.bytes_for(table)
        assert res.first_logprobs is None
        assert res.prefill_s > 0 and res.transfer_s >= 0
        # the KV the sender read is the prompt's KV (positions past the prompt stay zero)
        torch.testing.assert_close(send.kv[rid].flatten(2, 3)[:, :, :len(prompt)],
                                   want_kv.flatten(2, 3)[:, :, :len(prompt)], atol=1e-4, rtol=0)
    assert sched.num_finished == 3
    assert not any(sched.has_request(r) for r in prompts)
    _no_leak(sched)


def test_prefill_respects_token_budget_and_max_num_seqs(prefill_env, text_ids):
    runner, sched = prefill_env(budget=32, max_num_seqs=2)
    rec = PlanRecorder(runner)
    send = FakeSend(runner)
    futs = [sched.submit(_req(r, text_ids[:n]), send) for r, n in (("a", 10), ("b", 20), ("c", 30))]
    _pump(sched, lambda: all(f.done() for f in futs))
    shape = [[(s.request_id, s.num_computed, len(s.token_ids), s.sample) for s in p.seqs] for p in rec.plans]
    assert shape == [
        [("a", 0, 10, True), ("b", 0, 20, True)],  # max_num_seqs=2 keeps c out (30 tokens fit 2 of budget)
        [("c", 0, 30, True)],
    ]
    assert all(p.num_tokens <= 32 for p in rec.plans)
    _no_leak(sched)

    runner2, sched2 = prefill_env(budget=32)
    rec2 = PlanRecorder(runner2)
    futs = [sched2.submit(_req(r, text_ids[:n]), send) for r, n in (("a", 10), ("b", 20), ("c", 30))]
    _pump(sched2, lambda: all(f.done() for f in futs))
    shape = [[(s.request_id, s.num_computed, len(s.token_ids), s.sample) for s in p.seqs] for p in rec2.plans]
    assert shape == [
        [("a", 0, 10, True), ("b", 0, 20, True), ("c", 0, 2, False)],  # c chunked at the budget
        [("c", 2, 28, True)],
    ]
    assert [p.num_tokens for p in rec2.plans] == [32, 28]
    _no_leak(sched2)


def test_chunked_prefill_three_steps_same_first_token(prefill_env, model, model_config, text_ids):
    prompt = text_ids[:40]
    runner, sched = prefill_env(budget=16)
    rec = PlanRecorder(runner)
    send = FakeSend(runner)
    fut = sched.submit(_req("long", prompt, logprobs=2), send)
    for k in range(3):
        sched.step()
        assert len(rec.plans) == k + 1
        assert not send.calls or k == 2
    assert [(s.num_computed, len(s.token_ids), s.sample) for p in rec.plans for s in p.seqs] == [
        (0, 16, False), (16, 16, False), (32, 8, True)]
    _pump(sched, fut.done)
    res = fut.result()
    want_tok, want_lp, want_kv = _first_token(model, model_config, prompt, logprobs=2)
    assert res.first_token_id == want_tok
    assert res.first_logprobs.logprob == pytest.approx(want_lp.logprob, abs=1e-4)
    assert [t for t, _ in res.first_logprobs.top] == [t for t, _ in want_lp.top]
    assert send.calls[0][1] == rec.plans[0].seqs[0].block_table and len(send.calls[0][1]) == 3
    torch.testing.assert_close(send.kv["long"].flatten(2, 3)[:, :, :40], want_kv.flatten(2, 3)[:, :, :40],
                               atol=1e-4, rtol=0)
    _no_leak(sched)


def test_prefill_abort_while_waiting_and_mid_chunks(prefill_env, text_ids):
    runner, sched = prefill_env(budget=16)
    rec = PlanRecorder(runner)
    send = FakeSend(runner)
    fut = sched.submit(_req("w", text_ids[:20]), send)
    sched.submit_abort("w")
    sched.step()
    with pytest.raises(PrefillError) as e:
        fut.result(0)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert rec.plans == [] and send.calls == []
    _no_leak(sched)

    fut = sched.submit(_req("p", text_ids[:40]), send)
    sched.step()  # first 16-token chunk: blocks allocated
    assert sched.pool.num_free == sched.pool.num_usable - 3
    sched.submit_abort("p")
    sched.step()
    with pytest.raises(PrefillError) as e:
        fut.result(0)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert len(rec.plans) == 1 and send.calls == []
    assert not sched.has_request("p")
    _no_leak(sched)


def test_prefill_abort_while_transferring_frees_after_send_returns(prefill_env, text_ids):
    runner, sched = prefill_env()
    gate = threading.Event()
    send = FakeSend(runner, gate=gate)
    fut = sched.submit(_req("t", text_ids[:40]), send)
    sched.step()
    assert send.entered.wait(10)
    sched.submit_abort("t")
    sched.step()  # abort seen while the sender still reads the blocks
    assert not fut.done()
    assert sched.pool.num_free == sched.pool.num_usable - 3
    assert sched.has_request("t")
    gate.set()
    _pump(sched, fut.done)
    with pytest.raises(PrefillError) as e:
        fut.result(0)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert sched.num_finished == 0
    _no_leak(sched)


def test_prefill_send_failure_is_unavailable_and_frees(prefill_env, text_ids):
    runner, sched = prefill_env()
    send = FakeSend(runner, error=ConnectionError("decode worker gone"))
    fut = sched.submit(_req("f", text_ids[:20]), send)
    _pump(sched, fut.done)
    with pytest.raises(PrefillError) as e:
        fut.result(0)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "decode worker gone" in str(e.value)
    assert sched.num_failed_transfers == 1 and sched.num_finished == 0
    assert len(send.calls) == 1
    _no_leak(sched)

    # a sender that already knows the status passes it through
    send2 = FakeSend(runner, error=PrefillError(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow"))
    fut = sched.submit(_req("g", text_ids[:20]), send2)
    _pump(sched, fut.done)
    with pytest.raises(PrefillError) as e:
        fut.result(0)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sched.num_failed_transfers == 2
    _no_leak(sched)


def test_prefill_waits_for_blocks_held_by_a_transfer(prefill_env, text_ids):
    # 7 usable blocks: a (64 tokens, 4 blocks) in flight leaves 3, b needs 4
    runner, sched = prefill_env(num_blocks=8)
    rec = PlanRecorder(runner)
    gate = threading.Event()
    send = FakeSend(runner, gate=gate)
    fa = sched.submit(_req("a", text_ids[:64]), send)
    fb = sched.submit(_req("b", text_ids[:60]), send)
    sched.step()
    assert [s.request_id for p in rec.plans for s in p.seqs] == ["a"]
    assert send.entered.wait(10)
    sched.step()  # b still cannot get blocks
    assert [s.request_id for p in rec.plans for s in p.seqs] == ["a"]
    assert sched.pool.num_free == 3 and not fb.done()
    gate.set()
    _pump(sched, lambda: fa.done() and fb.done())
    assert [s.request_id for p in rec.plans for s in p.seqs] == ["a", "b"]
    assert fa.result().kv_bytes_sent > 0 and fb.result().kv_bytes_sent > 0
    _no_leak(sched)


def test_prefill_rejects_oversized_and_duplicate(prefill_env, text_ids):
    runner, sched = prefill_env(num_blocks=4)  # 3 usable blocks = 48 tokens
    send = FakeSend(runner)
    big = sched.submit(_req("big", text_ids[:49]), send)
    gate = threading.Event()
    slow = FakeSend(runner, gate=gate)
    ok = sched.submit(_req("dup", text_ids[:5]), slow)
    dup = sched.submit(_req("dup", text_ids[:5]), send)
    sched.step()
    with pytest.raises(PrefillError) as e:
        big.result(0)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(PrefillError) as e:
        dup.result(0)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    gate.set()
    _pump(sched, ok.done)
    assert ok.result().first_token_id == slow.calls[0][2]
    assert send.calls == []
    _no_leak(sched)


# ---- decode ----------------------------------------------------------------------------

def _colocated(model, model_config, prompt: list[int], n: int):
    """Prefill + greedy decode of ``n`` tokens on one runner: the prompt's KV
    ``[L, 2, blocks, BS, kh, d]`` and the ``n`` tokens a colocated engine produces."""
    runner = _runner(model, model_config)
    table = list(range(1, blocks_needed(len(prompt) + n, BS) + 1))
    greedy = SamplingOptions(temperature=0.0)
    toks = runner.execute(StepPlan([ScheduledSeq("c", prompt, 0, table, True, greedy)])).token_ids
    kv = runner.kv_cache[:, :, table[:blocks_needed(len(prompt), BS)]].clone()
    while len(toks) < n:
        pos = len(prompt) + len(toks) - 1
        toks += runner.execute(StepPlan([ScheduledSeq("c", [toks[-1]], pos, table, True, greedy)])).token_ids
    return kv, toks


def _decode_sched(model, model_config, num_blocks=32, lease_s=30.0, max_num_seqs=8):
    runner = _runner(model, model_config, num_blocks)
    sched = DecodeScheduler(runner, CacheConfig(block_size=BS, num_blocks=num_blocks),
                            SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=512, lease_s=lease_s),
                            model_config.eos_token_ids)
    return runner, sched


def _events(stream: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(stream.get_nowait())
        except queue.Empty:
            return out


def _reserve(sched, req: Request) -> tuple[queue.Queue, Reserved]:
    stream: queue.Queue = queue.Queue()
    sched.submit_reserve(req, stream)
    sched.step()
    ev = _events(stream)
    assert len(ev) == 1 and isinstance(ev[0], Reserved), ev
    return stream, ev[0]


def _deliver(sched, res: Reserved, kv: torch.Tensor, first_token: int) -> None:
    """What the KV receiver does: write the layers in two chunks, then report completion."""
    layers = kv.shape[0]
    mid = layers // 2
    sched.transfers.write(res.transfer_id, res.generation, 0, mid, res.block_ids, kv[:mid])
    sched.transfers.write(res.transfer_id, res.generation, mid, layers, res.block_ids, kv[mid:])
    sched.kv_complete(res.transfer_id, res.generation, first_token, None)


def _collect_tokens(sched, stream, timeout=20.0) -> list[Tokens]:
    out: list[Tokens] = []
    deadline = time.monotonic() + timeout
    while not out or out[-1].finish_reason is None:
        assert time.monotonic() < deadline, "decode made no progress"
        sched.step()
        for ev in _events(stream):
            assert isinstance(ev, Tokens), ev
            out.append(ev)
    return out


def _no_decode_leak(sched) -> None:
    _no_leak(sched)
    assert len(sched.transfers) == 0


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
    assert sched.pool.num_free == sched.pool.num_usable - 2

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
    assert sched.load()["num_waiting"] == 1
    _deliver(sched, ra, kv_a, want_a[0])
    events = _collect_tokens(sched, sa)
    assert [t for e in events for t in e.token_ids] == want_a
    assert _events(sb) == []  # a's last step released it; b is admitted on the next step
    sched.step()
    ev = _events(sb)
    assert len(ev) == 1 and isinstance(ev[0], Reserved)
    assert len(ev[0].block_ids) == blocks_needed(90, BS) == 6
    assert sched.load()["num_waiting"] == 0
    sched.submit_abort("b")
    sched.step()
    assert _events(sb) == [Tokens([], [], "abort")]
    _no_decode_leak(sched)


def test_decode_request_that_never_fits_is_resource_exhausted(model, model_config, text_ids):
    runner, sched = _decode_sched(model, model_config, num_blocks=8)
    stream: queue.Queue = queue.Queue()
    sched.submit_reserve(_req("huge", text_ids[:60], max_tokens=100), stream)  # 10 blocks > 7
    sched.step()
    (ev,) = _events(stream)
    assert isinstance(ev, Failed) and ev.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "10 KV blocks" in ev.message
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
    sched.submit_abort("twice")
    sched.step()
    assert _events(first) == [Tokens([], [], "abort")]
    _no_decode_leak(sched)


def test_decode_lease_expiry_reclaims_blocks(model, model_config, text_ids):
    runner, sched = _decode_sched(model, model_config, lease_s=0.2)
    req = _req("slow", text_ids[:40], max_tokens=3)
    stream, res = _reserve(sched, req)
    assert sched.pool.num_free == sched.pool.num_usable - 3
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

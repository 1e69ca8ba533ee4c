"""PrefillScheduler driven step by step over the real model runner.

The run loop is never started: each test calls ``step()`` by hand. The KV sender
is a fake that records what it was handed (the one stand-in of this file).
Shared helpers and the ``model`` / ``text_ids`` fixtures: ``sched_helpers.py``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import grpc
import pytest
import torch

from engine.block_pool import blocks_needed
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan
from prefill_worker.contracts import PrefillError, PrefillResult

from sched_helpers import BS, _no_leak, _prefill_sched, _pump, _req, _runner, model, text_ids  # noqa: F401 - fixtures


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
        self.returned = threading.Event()  # set once a call returned (or raised)

    def bytes_for(self, blocks: list[int]) -> int:
        per_block = self.runner.kv_cache[:, :, 0].numel() * self.runner.kv_cache.element_size()
        return len(blocks) * per_block

    def __call__(self, request: Request, progress) -> int:
        first_token, _ = progress.wait_finished(timeout_s=30)
        blocks = list(request.block_table)
        self.calls.append((request.request_id, blocks, first_token))
        self.kv[request.request_id] = self.runner.kv_cache[:, :, blocks].clone()
        self.entered.set()
        try:
            if self.gate is not None:
                assert self.gate.wait(10), "test never opened the gate"
            if self.error is not None:
                raise self.error
            return self.bytes_for(blocks)
        finally:
            self.returned.set()


class PlanRecorder:
    """Wraps the real runner's ``execute`` to keep every step plan."""

    def __init__(self, runner: ModelRunner) -> None:
        self.plans: list[StepPlan] = []
        self._execute = runner.execute
        runner.execute = self  # instance attribute shadows the method

    def __call__(self, plan: StepPlan):
        self.plans.append(plan)
        return self._execute(plan)


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


def test_a_prefill_is_reported_computed_whatever_becomes_of_its_kv(prefill_env, text_ids):
    """The metrics' prefill time, queue time and prefix-cache counters come from ``on_computed``, called as
    the prefill ends: a request whose transfer then fails (its client cancelled, the decode worker died)
    counts as one that delivered its KV."""
    runner, sched = prefill_env()
    computed = []
    sched.on_computed = lambda *args: computed.append(args)
    for rid, error in (("ok", None), ("lost", ConnectionError("decode worker gone"))):
        fut = sched.submit(_req(rid, text_ids[:20]), FakeSend(runner, error=error))
        _pump(sched, fut.done)
    assert [c[0] for c in computed] == [20, 20] and all(c[1] == 0 and c[2] >= 0 and c[3] > 0 for c in computed)
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


@pytest.mark.parametrize("layerwise", [False, True], ids=["after-step", "layerwise"])
def test_prefill_answers_a_transfer_acknowledged_during_another_step(prefill_env, text_ids, layerwise):
    """A transfer that ends while another prompt's step runs is answered between two
    layers of that step, its blocks free at once (not a whole step later: the router's
    final token waits for this answer); mail about the running step's own request (an
    abort) waits for the step's end, where it keeps that prompt's KV from being sent (a
    layer-wise stream already under way ends)."""
    runner, sched = prefill_env(layerwise=layerwise)
    gate = threading.Event()
    send = FakeSend(runner, gate=gate)
    fa = sched.submit(_req("a", text_ids[:40]), send)  # 3 blocks
    sched.step()
    assert send.entered.wait(10) and not fa.done()
    send_b = FakeSend(runner)
    fb = sched.submit(_req("b", text_ids[:30]), send_b)  # 2 blocks
    execute, seen = runner.execute, {}

    def run(plan: StepPlan):
        def on_layer(layer: int) -> None:
            if layer == 0:
                gate.set()  # a's decode side acknowledges now
                deadline = time.monotonic() + 10
                while not send.returned.is_set() and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.05)  # its sender thread posts the news
                sched.submit_abort("b")  # about the step's own request: waits for the step's end
            plan.on_layer_done(layer)
            if fa.done() and "a" not in seen:
                seen["a"] = (layer, sched.pool.num_free)
            seen["b_alive"] = sched.has_request("b")
        return execute(replace(plan, on_layer_done=on_layer))

    runner.execute = run
    sched.step()
    assert "a" in seen, "a was not answered mid-step"
    layer, free = seen["a"]
    assert layer == 0 and free == sched.pool.num_usable - 2  # only b's blocks are held
    assert fa.result(0).kv_bytes_sent > 0 and seen["b_alive"]
    _pump(sched, fb.done)
    with pytest.raises(PrefillError) as e:
        fb.result(0)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert send_b.calls == []  # b's KV never left (a layer-wise sender saw its stream end)
    _no_leak(sched)

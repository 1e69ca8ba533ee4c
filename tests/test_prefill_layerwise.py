"""Layer-wise KV streaming on the prefill scheduler (real model runner, fake sender).

With ``layerwise=True`` the transfer of a prompt whose last chunk runs in a step
starts with that step: the sender may read layer l as soon as the model reports
it written, while later layers still compute. The sender here is a stand-in that
snapshots each layer the moment it is reported ready.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from engine.block_pool import blocks_needed
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan
from kvtransfer.errors import KvTransferError
from prefill_worker.contracts import PrefillError

from sched_helpers import BS, _no_leak, _prefill_sched, _pump, _req, _runner, model, text_ids  # noqa: F401 - fixtures


class LayerSnapshots:
    """Sender stand-in: waits for each layer, copies it at once, then waits for the first token."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.layers: dict[str, list[torch.Tensor]] = {}
        self.layer_times: dict[str, list[float]] = {}
        self.first: dict[str, int] = {}
        self.error: dict[str, BaseException] = {}

    def __call__(self, request, progress) -> int:
        rid, blocks = request.request_id, list(request.block_table)
        snaps, times = self.layers.setdefault(rid, []), self.layer_times.setdefault(rid, [])
        try:
            for layer in range(self.runner.kv_cache.shape[0]):
                progress.wait_layers(layer + 1, timeout_s=30)
                snaps.append(self.runner.kv_cache[layer, :, blocks].clone())
                times.append(time.monotonic())
            self.first[rid], _ = progress.wait_finished(timeout_s=30)
        except KvTransferError as e:
            self.error[rid] = e
            raise
        return sum(s.numel() * s.element_size() for s in snaps)


class TimedRunner:
    """Wraps ``runner.execute``: records when each step ended; can fail after layer ``fail_after``."""

    def __init__(self, runner, fail_after: int | None = None) -> None:
        self.ended: list[float] = []
        self._execute = runner.execute
        self.fail_after = fail_after
        runner.execute = self

    def __call__(self, plan: StepPlan):
        if self.fail_after is not None and plan.on_layer_done is not None:
            for layer in range(self.fail_after + 1):
                plan.on_layer_done(layer)
            raise RuntimeError("injected step failure")
        out = self._execute(plan)
        self.ended.append(time.monotonic())
        return out


@pytest.mark.parametrize("budget", [2048, 16])
def test_each_layer_is_streamed_complete_during_the_last_step(model, model_config, text_ids, budget):
    runner, sched = _prefill_sched(model, model_config, budget=budget, layerwise=True)
    timed = TimedRunner(runner)
    send = LayerSnapshots(runner)
    prompt = text_ids[:40]
    fut = sched.submit(_req("s", prompt), send)
    try:
        _pump(sched, fut.done, timeout=30.0)
        res = fut.result(0)
    finally:
        sched.shutdown()
    # reference: the whole prompt in one unstreamed step on a fresh runner
    ref = _runner(model, model_config)
    table = list(range(1, blocks_needed(len(prompt), BS) + 1))
    out = ref.execute(StepPlan([ScheduledSeq("ref", prompt, 0, table, True, SamplingOptions(temperature=0.0))]))
    assert res.first_token_id == send.first["s"] == out.token_ids[0]
    assert len(send.layers["s"]) == model_config.num_layers
    for layer, snap in enumerate(send.layers["s"]):
        torch.testing.assert_close(snap.flatten(1, 2)[:, :len(prompt)],
                                   ref.kv_cache[layer, :, table].flatten(1, 2)[:, :len(prompt)],
                                   rtol=1e-5, atol=1e-5, msg=f"layer {layer}")
    # layer 0 was read before the last step ended: the transfer overlapped compute
    assert send.layer_times["s"][0] < timed.ended[-1]
    assert len(timed.ended) == (1 if budget == 2048 else 3)
    assert res.transfer_total_s >= res.transfer_s >= 0
    _no_leak(sched)


def test_streamed_step_failure_fails_the_send_and_frees_after_it_returned(model, model_config, text_ids):
    runner, sched = _prefill_sched(model, model_config, layerwise=True)
    TimedRunner(runner, fail_after=3)
    send = LayerSnapshots(runner)
    fut = sched.submit(_req("f", text_ids[:20]), send)
    try:
        _pump(sched, fut.done, timeout=30.0)
    finally:
        sched.shutdown()
    with pytest.raises(PrefillError) as e:
        fut.result(0)
    assert e.value.code == grpc.StatusCode.INTERNAL and "injected step failure" in str(e.value)
    assert isinstance(send.error["f"], KvTransferError)
    assert len(send.layers["f"]) <= 4  # at most layers 0..3 were reported before the failure
    _no_leak(sched)


def test_abort_during_a_streamed_step_frees_once_the_sender_returns(model, model_config, text_ids):
    runner, sched = _prefill_sched(model, model_config, layerwise=True)
    gate = threading.Event()

    def slow_send(request, progress):
        progress.wait_finished(timeout_s=30)
        assert gate.wait(10)
        return 1

    fut = sched.submit(_req("a", text_ids[:20]), slow_send)
    try:
        sched.step()  # the step runs; the sender holds the blocks
        sched.submit_abort("a")
        sched.step(block=False)
        assert not fut.done() and sched.pool.num_free < sched.pool.num_usable
        gate.set()
        _pump(sched, fut.done, timeout=30.0)
    finally:
        sched.shutdown()
    with pytest.raises(PrefillError) as e:
        fut.result(0)
    assert e.value.code == grpc.StatusCode.CANCELLED
    _no_leak(sched)

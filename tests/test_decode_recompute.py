"""KV failure policy of the decode scheduler: "error" vs "recompute on decode".

The three triggers (the receiver reports a failed transfer, the lease expires, the
router reports that the prefill side failed) under both policies, driven step by
step over the real model runner. Under "recompute" the decode worker rebuilds the
prompt's KV itself and samples the first token itself: the output equals what a
colocated engine produces, greedy and seeded. Shared helpers and the ``model`` /
``text_ids`` fixtures: ``sched_helpers.py``.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from decode_worker.events import Failed, Tokens
from decode_worker.kv_failure import KvFailureOutcome
from engine.request import RequestStatus
from engine.sampling import SamplingOptions
from kvtransfer.errors import StaleTransferError

from sched_helpers import (  # noqa: F401 - fixtures
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


def _fail_by(trigger: str, sched, res, request_id: str):
    """Make the transfer of ``res`` fail through ``trigger``; returns the
    FailTransfer future for the "router" trigger, else None."""
    if trigger == "receiver":
        sched.kv_failed(res.transfer_id, res.generation, "corrupt: CRC32 mismatch in chunk 1")
        return None
    if trigger == "lease":
        time.sleep(sched.sched.lease_s + 0.05)
        return None
    return sched.submit_fail_transfer(request_id, res.transfer_id, "prefill worker p0: UNAVAILABLE: Socket closed")


TRIGGERS = ["receiver", "lease", "router"]
MESSAGES = {"receiver": "KV transfer failed: corrupt", "lease": "lease expired",
            "router": "KV transfer failed: prefill side failed: prefill worker p0"}


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_error_policy_ends_with_unavailable(model, model_config, text_ids, trigger):
    _, sched = _decode_sched(model, model_config, lease_s=0.3)
    stream, res = _reserve(sched, _req("e", text_ids[:20]))
    reply = _fail_by(trigger, sched, res, "e")
    sched.step()
    (ev,) = _events(stream)
    assert isinstance(ev, Failed) and ev.code == grpc.StatusCode.UNAVAILABLE, ev
    assert MESSAGES[trigger] in ev.message
    if reply is not None:
        assert reply.result(timeout=1) == KvFailureOutcome.FAILED
    assert sched.load()["num_failed_transfers"] == 1 and sched.load()["num_kv_recomputes"] == 0
    _no_decode_leak(sched)


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_recompute_policy_equals_a_delivered_transfer(model, model_config, text_ids, trigger):
    prompt = text_ids[:37]  # 3 blocks: the recompute chunk ends inside the last one
    _, want = _colocated(model, model_config, prompt, 6)
    runner, sched = _decode_sched(model, model_config, lease_s=0.3, kv_failure_policy="recompute")
    req = _req("r", prompt, max_tokens=6, logprobs=2)
    stream, res = _reserve(sched, req)
    # a first chunk of garbage landed before the failure: the recompute overwrites it
    junk = torch.full((1, 2, len(res.block_ids), *runner.kv_cache.shape[3:]), 3.0)
    sched.transfers.write(res.transfer_id, res.generation, 0, 1, res.block_ids, junk)
    reply = _fail_by(trigger, sched, res, "r")
    sched.step()
    assert req.status in (RequestStatus.RECOMPUTING, RequestStatus.RUNNING)
    if reply is not None:
        assert reply.result(timeout=1) == KvFailureOutcome.RECOMPUTING
    # the failed transfer's late chunks are turned away
    with pytest.raises(StaleTransferError):
        sched.transfers.write(res.transfer_id, res.generation, 0, 1, res.block_ids, junk)
    sched.kv_complete(res.transfer_id, res.generation, 7, None)
    events = _collect_tokens(sched, stream)
    assert [t for e in events for t in e.token_ids] == want
    assert events[-1].finish_reason == "length"
    assert all(e.logprobs[0] is not None and len(e.logprobs[0].top) == 2 for e in events)
    load = sched.load()
    assert load["num_kv_recomputes"] == 1 and load["num_failed_transfers"] == 1
    _no_decode_leak(sched)


@pytest.mark.parametrize("trigger", ["receiver", "router"])
def test_recompute_seeded_sampling_draws_like_a_normal_run(model, model_config, text_ids, trigger):
    """A seeded request rebuilt on decode gives the tokens of the same request whose
    KV arrived (where the prefill worker drew the first uniform and decode skipped it)."""
    prompt = text_ids[:25]
    sampling = SamplingOptions(temperature=0.9, top_p=0.95, seed=1234)
    kv, want = _colocated(model, model_config, prompt, 6, sampling)

    _, normal_sched = _decode_sched(model, model_config)
    s1, r1 = _reserve(normal_sched, _req("n", prompt, max_tokens=6, sampling=sampling))
    _deliver(normal_sched, r1, kv, want[0])
    normal = [t for e in _collect_tokens(normal_sched, s1, timeout=120) for t in e.token_ids]
    assert normal == want

    _, sched = _decode_sched(model, model_config, kv_failure_policy="recompute")
    s2, r2 = _reserve(sched, _req("s", prompt, max_tokens=6, sampling=sampling))
    reply = _fail_by(trigger, sched, r2, "s")
    recomputed = [t for e in _collect_tokens(sched, s2, timeout=120) for t in e.token_ids]
    if reply is not None:
        assert reply.result(timeout=1) == KvFailureOutcome.RECOMPUTING
    assert recomputed == want
    _no_decode_leak(sched)


def test_recompute_one_token_prompt_and_a_full_batch(model, model_config, text_ids):
    """A 1-token prompt has nothing to rebuild (its first decode step samples at
    position 0); a rebuilt request waits for a batch slot like any other."""
    _, want_one = _colocated(model, model_config, text_ids[:1], 3)
    _, want_b = _colocated(model, model_config, text_ids[5:30], 3)
    kv_a, want_a = _colocated(model, model_config, text_ids[:18], 4)
    _, sched = _decode_sched(model, model_config, max_num_seqs=1, kv_failure_policy="recompute")
    sa, ra = _reserve(sched, _req("a", text_ids[:18], max_tokens=4))
    sb, rb = _reserve(sched, _req("b", text_ids[5:30], max_tokens=3))
    _deliver(sched, ra, kv_a, want_a[0])
    sched.kv_failed(rb.transfer_id, rb.generation, "incomplete: the stream ended before its done chunk")
    sched.step()
    assert sched.load()["num_kv_recomputes"] == 1
    assert len(sched._running) + len(sched._recomputing) == 1  # max_num_seqs holds
    assert [t for e in _collect_tokens(sched, sa) for t in e.token_ids] == want_a
    assert [t for e in _collect_tokens(sched, sb) for t in e.token_ids] == want_b
    s1, r1 = _reserve(sched, _req("one", text_ids[:1], max_tokens=3))
    sched.kv_failed(r1.transfer_id, r1.generation, "corrupt: bad header")
    assert [t for e in _collect_tokens(sched, s1) for t in e.token_ids] == want_one
    assert sched.load()["num_kv_recomputes"] == 2
    _no_decode_leak(sched)


def test_fail_transfer_outcomes_when_nothing_is_lost(model, model_config, text_ids):
    """FailTransfer after the KV arrived, for another transfer id, for an ended or
    unknown request, or after the receiver already triggered a recompute."""
    prompt = text_ids[:20]
    kv, want = _colocated(model, model_config, prompt, 4)
    _, sched = _decode_sched(model, model_config)  # policy "error"
    stream, res = _reserve(sched, _req("k", prompt, max_tokens=4))
    wrong = sched.submit_fail_transfer("k", "another-transfer", "x")
    unknown = sched.submit_fail_transfer("nobody", res.transfer_id, "x")
    sched.step()
    assert wrong.result(timeout=1) == KvFailureOutcome.UNKNOWN_REQUEST
    assert unknown.result(timeout=1) == KvFailureOutcome.UNKNOWN_REQUEST
    assert sched.transfers.is_open(res.transfer_id, res.generation)
    _deliver(sched, res, kv, want[0])
    sched.step()
    late = sched.submit_fail_transfer("k", res.transfer_id, "prefill worker p0: UNAVAILABLE: Socket closed")
    events = _collect_tokens(sched, stream)
    assert late.result(timeout=1) == KvFailureOutcome.KV_COMPLETE
    assert [t for e in events for t in e.token_ids] == want
    after = sched.submit_fail_transfer("k", res.transfer_id, "x")
    sched.step()
    assert after.result(timeout=1) == KvFailureOutcome.UNKNOWN_REQUEST
    assert sched.num_failed_transfers == 0
    _no_decode_leak(sched)

    _, rsched = _decode_sched(model, model_config, kv_failure_policy="recompute")
    s2, r2 = _reserve(rsched, _req("k2", prompt, max_tokens=4))
    rsched.kv_failed(r2.transfer_id, r2.generation, "corrupt: CRC32 mismatch")
    rsched.step()
    again = rsched.submit_fail_transfer("k2", r2.transfer_id, "prefill worker p0: UNAVAILABLE: KV transfer failed")
    events = _collect_tokens(rsched, s2)
    assert again.result(timeout=1) == KvFailureOutcome.RECOMPUTING
    assert [t for e in events for t in e.token_ids] == want
    assert rsched.num_kv_recomputes == 1 and rsched.num_failed_transfers == 1
    _no_decode_leak(rsched)


def test_abort_while_recomputing_frees_everything(model, model_config, text_ids):
    # 8-token recompute chunks: the abort lands mid-rebuild
    _, sched = _decode_sched(model, model_config, kv_failure_policy="recompute", max_num_batched_tokens=8)
    stream, res = _reserve(sched, _req("ab", text_ids[:40], max_tokens=4))
    sched.kv_failed(res.transfer_id, res.generation, "corrupt: CRC32 mismatch")
    sched.step()
    sched.step()
    assert sched._requests["ab"].status == RequestStatus.RECOMPUTING
    assert 0 < sched._requests["ab"].num_computed < 39
    sched.submit_abort("ab")
    sched.step()
    assert _events(stream) == [Tokens([], [], "abort")]
    assert not sched.kv_failure.is_rebuilding("ab")
    _no_decode_leak(sched)

"""Decode admission with a watermark and preemption by recomputation."""

from __future__ import annotations

from decode_worker.events import Reserved, Tokens
from engine.block_pool import blocks_needed

from sched_helpers import (  # noqa: F401 - fixtures
    BS,
    _collect_tokens,
    _colocated,
    _decode_sched,
    _deliver,
    _events,
    _no_decode_leak,
    _req,
    model,
    text_ids,
)


def test_preemption_recomputes_and_matches_unpreempted(model, model_config, text_ids, caplog):
    """7 usable blocks, three requests growing to 4 blocks each: someone must be
    preempted, and every output equals its unpreempted greedy run; the preemption's log line
    carries the request's id as its ``request_id`` field (JSON logs; helper finding)."""
    caplog.set_level("INFO", logger="decode_worker.scheduler")
    prompts = [text_ids[i:i + 20] for i in (0, 5, 10)]
    n = 30
    refs = [_colocated(model, model_config, p, n) for p in prompts]
    runner, sched = _decode_sched(model, model_config, num_blocks=8, max_num_seqs=8)
    streams = []
    import queue
    for i, p in enumerate(prompts):
        s: queue.Queue = queue.Queue()
        sched.submit_reserve(_req(f"r{i}", p, max_tokens=n), s)
        streams.append(s)
    sched.step()
    outs: dict[int, list[int]] = {i: [] for i in range(3)}
    done: set[int] = set()
    for _ in range(2000):
        for i, s in enumerate(streams):
            for ev in _events(s):
                if isinstance(ev, Reserved):
                    kv, toks = refs[i]
                    _deliver(sched, ev, kv, toks[0])
                else:
                    assert isinstance(ev, Tokens), ev
                    outs[i].extend(ev.token_ids)
                    if ev.finish_reason:
                        done.add(i)
        if len(done) == 3:
            break
        sched.step()
    assert done == {0, 1, 2}
    assert sched.num_preemptions > 0
    lines = [r for r in caplog.records if r.getMessage().startswith("preempted ")]
    assert lines and all(getattr(r, "request_id", None) == r.args[0] for r in lines)
    for i in range(3):
        assert outs[i] == refs[i][1], f"request {i} differs after preemption"
    _no_decode_leak(sched)


def test_watermark_and_resume_priority(model, model_config, text_ids):
    """With a watermark, admission keeps blocks free; preempted requests resume before
    new reservations are admitted."""
    runner, sched = _decode_sched(model, model_config, num_blocks=8, watermark=0.3)
    assert blocks_needed(21, BS) == 2
    assert sched.kv.watermark_blocks == 2  # int(0.3 * 7)
    import queue
    first: queue.Queue = queue.Queue()
    sched.submit_reserve(_req("a", text_ids[:20], max_tokens=4), first)
    sched.step()
    (res,) = _events(first)
    assert isinstance(res, Reserved)  # idle pool: the watermark does not block the first request
    big: queue.Queue = queue.Queue()
    sched.submit_reserve(_req("b", text_ids[:60], max_tokens=4), big)  # needs 4 + keeps 2 free: 7 - 2 < 6
    kv, toks = _colocated(model, model_config, text_ids[:20], 4)
    _deliver(sched, res, kv, toks[0])
    sched.step()
    assert _events(big) == []  # blocked by the watermark while "a" runs
    out = _collect_tokens(sched, first)
    assert [t for e in out for t in e.token_ids] == toks
    sched.step()
    assert isinstance(_events(big)[0], Reserved)
    sched.submit_abort("b")
    sched.step()
    _no_decode_leak(sched)

"""Request migration in the router (``router/core.py`` + ``router/migration.py``) against
scripted workers on real gRPC (loopback), no model (``tests/router_scripted.py``): a decode worker
that "dies" after a few tokens (its stream ends with UNAVAILABLE), a prefill worker that fails, a
decode worker whose KV never comes (policy "error": ``FailTransfer`` ends its stream).

Checked: the client's stream goes on with no repeated or missing token; the next
workers get the tokens already streamed as ``output_token_ids`` under the attempt's own
request id; a stop string held back across the migration still cuts the text; usage and
the request statistics count each token once; the migration metric and the limit
(``max_migrations``, then UNAVAILABLE naming the cause; 0: the worker's own status);
refusals are not retried; the blame rules of :func:`router.migration.classify`; the
placement avoids failed workers; the ``--max-migrations`` flag is validated. The endings
around them (aborts, cancels, closed streams) are in ``tests/test_router_endings.py``.
"""

from __future__ import annotations

import re

import grpc
import pytest

from deploy.spec import spec_from_args
from pdcluster.v1 import common_pb2
from router.errors import RouterError
from router.load import LoadTracker
from router.migration import Side, classify
from router.placement import Placer, make_policy
from router.policy import RequestContext, Signals
from router.server import RouterConfig
from serving.registry import WorkerInfo

from cli_helpers import parse_up
from router_scripted import (UNAVAILABLE, TEXT, KvLedger, ScriptedDecode, ScriptedPrefill, ScriptedView,
                             cluster, generate_all, metric_value)

__all__ = ["cluster"]  # the fixture, used by name


def test_decode_death_resumes_on_another_decode_worker(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = KvLedger()
    dying, healthy, prefill = ScriptedDecode("d0", seq, kv, die_after=4), ScriptedDecode("d1", seq, kv), ScriptedPrefill(kv)
    router = cluster([dying, healthy], [prefill])
    msgs = generate_all(router, "Count:", len(seq))
    streamed = [t for m in msgs for t in m.token_ids]
    assert streamed == seq, "a token was repeated or lost"
    assert "".join(m.text for m in msgs) == TEXT
    assert re.fullmatch(r"req-1/[0-9a-f]{8}/migration-1", healthy.requests[0].request_id)
    assert dying.requests[0].request_id == healthy.requests[0].request_id.removesuffix("/migration-1")
    assert list(healthy.requests[0].output_token_ids) == seq[:4]
    assert list(prefill.requests[1].request.output_token_ids) == seq[:4]
    usage = msgs[-1].usage
    prompt_len = len(tokenizer.encode("Count:"))
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, len(seq))
    assert usage.cached_prompt_tokens == prompt_len  # the first prefill's answer, not the migration's
    assert metric_value(router, "request_migrations", failed_role="decode") == 1
    assert metric_value(router, "generation_tokens") == len(seq)
    assert metric_value(router, "request_success", finished_reason="length") == 1
    assert router.placer.view.marked == ["d0"]
    assert router.load.in_flight("d0") == router.load.in_flight("d1") == router.load.in_flight("p0") == 0


def test_stop_string_held_back_across_a_migration(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    dies_at = len(tokenizer.encode(" one two three four", add_special_tokens=False))
    kv = KvLedger()
    router = cluster([ScriptedDecode("d0", seq, kv, die_after=dies_at), ScriptedDecode("d1", seq, kv)], [ScriptedPrefill(kv)])
    for stream in (True, False):
        msgs = generate_all(router, "Count:", len(seq), stop=[" four five"], stream=stream)
        assert "".join(m.text for m in msgs) == " one two three"
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_at_most_max_migrations_then_unavailable_naming_the_cause(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = KvLedger()
    decodes = [ScriptedDecode("d0", seq, kv, die_after=1), ScriptedDecode("d1", seq, kv, die_after=1)]
    router = cluster(decodes, [ScriptedPrefill(kv)], max_migrations=3)
    router.placer.view.mark_unreachable = lambda wid: None  # both stay listed: tried again in turn
    with pytest.raises(RouterError) as exc:
        generate_all(router, "Count:", len(seq))
    assert exc.value.code == UNAVAILABLE
    assert "failed after 3 migrations" in exc.value.message and "Socket closed" in exc.value.message
    assert sum(len(d.requests) for d in decodes) == 4
    assert [len(r.output_token_ids) for d in decodes for r in d.requests] == [0, 2, 1, 3]
    assert metric_value(router, "request_migrations", failed_role="decode") == 3
    assert metric_value(router, "request_errors", code="UNAVAILABLE") == 1


def test_no_migration_when_disabled_or_refused(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = KvLedger()
    router = cluster([ScriptedDecode("d0", seq, kv, die_after=2), ScriptedDecode("d1", seq, kv)], [ScriptedPrefill(kv)],
                     max_migrations=0)
    with pytest.raises(RouterError) as exc:
        generate_all(router, "Count:", len(seq))
    assert (exc.value.code, exc.value.message) == (UNAVAILABLE, "decode worker d0: Socket closed")
    refusing = ScriptedDecode("d0", seq, kv, refuse=grpc.StatusCode.RESOURCE_EXHAUSTED)
    router = cluster([refusing, ScriptedDecode("d1", seq, kv)], [ScriptedPrefill(kv)])
    with pytest.raises(RouterError) as exc:
        generate_all(router, "Count:", len(seq))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert metric_value(router, "request_migrations", failed_role="decode") == 0


def test_failed_prefill_retries_on_another_prefill_worker(cluster, tokenizer):
    seq = tokenizer.encode(TEXT, add_special_tokens=False)
    kv = KvLedger()
    dead, alive = ScriptedPrefill(kv, fail=True), ScriptedPrefill(kv)
    router = cluster([ScriptedDecode("d0", seq, kv)], [dead, alive])
    msgs = generate_all(router, "Count:", len(seq))
    assert [t for m in msgs for t in m.token_ids] == seq
    assert len(dead.requests) == len(alive.requests) == 1
    assert re.fullmatch(r"req-1/[0-9a-f]{8}/migration-1", alive.requests[0].request.request_id)
    assert not alive.requests[0].request.output_token_ids
    assert metric_value(router, "request_migrations", failed_role="prefill") == 1
    assert router.placer.view.marked == ["p0"]


@pytest.mark.parametrize("decode,prefill,role,suspects,lost", [
    # the decode worker died: its stream broke (the prefill may have failed to deliver as well)
    ((UNAVAILABLE, "Socket closed"), None, "decode", {"d"}, {"d"}),
    ((UNAVAILABLE, "Socket closed"), (UNAVAILABLE, "KV transfer failed: x"), "decode", {"d"}, {"d"}),
    ((grpc.StatusCode.INTERNAL, "decode step failed: boom"), None, "decode", {"d"}, set()),
    # the prefill worker died: the decode stream ends (policy "error") or was cancelled
    ((UNAVAILABLE, "KV transfer failed: prefill side failed: p"), (UNAVAILABLE, "Socket closed"),
     "prefill", {"p"}, {"p"}),
    ((grpc.StatusCode.CANCELLED, "Locally cancelled"), (UNAVAILABLE, "Socket closed"), "prefill", {"p"}, {"p"}),
    # the prefill worker could not deliver (decode unreachable): both suspected, none marked
    ((grpc.StatusCode.CANCELLED, "Locally cancelled"), (UNAVAILABLE, "KV transfer failed: timeout"),
     "prefill", {"p", "d"}, set()),
    # the decode worker's lease expired with no prefill failure known
    ((UNAVAILABLE, "KV transfer lease expired after 1.0s"), None, "prefill", {"p", "d"}, set()),
])
def test_classify_blames_the_failed_worker(decode, prefill, role, suspects, lost):
    f = classify(Side("decode", "d", *decode), Side("prefill", "p", *(prefill or (None, ""))))
    assert (f.role, set(f.suspects), set(f.lost), f.migratable) == (role, suspects, lost, True)
    refused = classify(Side("decode", "d", grpc.StatusCode.RESOURCE_EXHAUSTED, "too big"), Side("prefill", "p"))
    assert not refused.migratable


def test_placement_avoids_failed_workers_unless_none_is_left():
    infos = [WorkerInfo(worker_id=w, role=r, address="x:1") for w, r in
             (("d0", "decode"), ("d1", "decode"), ("p0", "prefill"))]
    placer = Placer(ScriptedView(infos), make_policy("least_loaded", Signals(LoadTracker())))
    request = RequestContext("r", [1, 2, 3])
    assert placer.place(request).decode.worker_id == "d0"
    got = placer.place(request, avoid=frozenset({"d0", "p0"}))
    assert (got.decode.worker_id, got.prefill.worker_id) == ("d1", "p0")  # p0 is the only prefill worker


def test_max_migrations_flag_and_config_are_validated():
    args = parse_up("--max-migrations", "5")
    assert spec_from_args(args, "redis://x:1").router.max_migrations == 5
    assert parse_up().max_migrations == 3
    with pytest.raises(SystemExit):
        parse_up("--max-migrations", "-1")
    with pytest.raises(ValueError, match=r"max_migrations must be an integer in \[0, 100\], got 101"):
        RouterConfig(model="m", model_path="/x", redis_url="redis://x:1", max_migrations=101)

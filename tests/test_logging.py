"""One logging set-up for every process: text or JSON lines, request ids on every line about a
request (router, prefill and decode worker, propagated in gRPC metadata), one DEBUG line per
engine step. Real workers, router and Redis in this process; lines captured from the root logger."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest

from decode_worker.worker import create_decode_worker
from deploy.redis_server import LocalRedisServer
from engine.config import CacheConfig, SchedulerConfig
from engine.model_loader import resolve_model
from pdcluster.client import PdclusterClient
from prefill_worker.worker import create_prefill_worker
from router.server import RouterConfig, RouterServer
from serving.logs import LogConfig, ThrottledLog, configure_logging, request_scope
from serving.worker_config import WorkerConfig

MODEL = "smollm2-135m-instruct"


@pytest.fixture
def captured():
    """Root logging configured as JSON at DEBUG, its stream swapped for a buffer."""
    configure_logging("json", "DEBUG")
    handler = next(h for h in logging.getLogger().handlers if getattr(h, "_pdcluster", False))
    buf = io.StringIO()
    handler.setStream(buf)
    yield buf
    configure_logging("text", "INFO")


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]


def test_json_and_text_lines_carry_the_request_id(captured):
    log = logging.getLogger("pdcluster.test")
    with request_scope("req-42"):
        log.info("inside %d", 1)
    log.info("outside", extra={"request_id": "req-43"})
    lines = _lines(captured)
    assert [(d["msg"], d.get("request_id")) for d in lines[-2:]] == [("inside 1", "req-42"), ("outside", "req-43")]
    assert {"ts", "level", "logger", "process"} <= set(lines[-1])
    with pytest.raises(ValueError, match="log format"):
        LogConfig(format="xml")
    with pytest.raises(ValueError, match="log level"):
        LogConfig(level="LOUD")


def test_request_id_on_router_prefill_and_decode_lines(tmp_path, captured):
    redis = LocalRedisServer(tmp_path / "redis").start()
    base = dict(model=MODEL, redis_url=redis.url, cluster="logs", heartbeat_s=0.3,
                cache=CacheConfig(block_size=16, num_blocks=100), scheduler=SchedulerConfig(max_model_len=256))
    hosts = [create_prefill_worker(WorkerConfig(role="prefill", worker_id="prefill-0", **base)),
             create_decode_worker(WorkerConfig(role="decode", worker_id="decode-0", **base))]
    for h in hosts:
        h.start()
    router = RouterServer(RouterConfig(model=MODEL, model_path=str(resolve_model(MODEL)), redis_url=redis.url,
                                       cluster="logs", port=0, max_model_len=256, view_period_s=0.1))
    try:
        with PdclusterClient(router.start(), timeout_s=120) as client:
            client.wait_ready(30)
            client.generate("Hello there", max_tokens=4, temperature=0, request_id="trace-me-1")
    finally:
        router.stop()
        for h in hosts:
            h.stop()
        redis.stop()
    lines = _lines(captured)
    about = {d["logger"] for d in lines if d.get("request_id") == "trace-me-1"}
    assert {"router.active", "prefill_worker.server", "decode_worker.server"} <= about, about
    steps = [d["msg"] for d in lines if d["logger"] == "engine.step"]
    assert any(m.startswith("prefill step: 1 seqs, ") and m.endswith(" ms") for m in steps), steps
    assert any(m.startswith("decode step: batch 1, ") for m in steps), steps


def test_a_storm_is_logged_as_its_first_line_and_one_count(caplog):
    """ThrottledLog: the first event whole, the rest of the period as one line with their count
    and the last one's id; after a quiet period the next event is logged whole again."""
    throttled = ThrottledLog(logging.getLogger("storm"), "requests refused (queue_full)", period_s=0.2)
    with caplog.at_level(logging.INFO, logger="storm"):
        for i in range(50):
            throttled.info(f"r{i}", "request %s refused", f"r{i}")
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.45)  # past the summary's own quiet period
        throttled.info("late", "request %s refused", "late")
    lines = [(r.getMessage(), r.request_id) for r in caplog.records]
    assert lines == [("request r0 refused", "r0"),
                     ("49 more requests refused (queue_full) in the last 0.2 s, not logged one by one "
                      "(the last one's id on this line)", "r49"),
                     ("request late refused", "late")], lines


def test_throttled_log_period_is_validated():
    with pytest.raises(ValueError, match="period_s"):
        ThrottledLog(logging.getLogger("x"), "events", period_s=0)

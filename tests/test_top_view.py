"""``pdcluster top`` over a restart and an outage: a worker replaced under the same id (its counters
back at zero) shows no rate for that interval instead of a negative one, and a router that stops
answering leaves the last view marked stale while the iterations still count, so ``--iterations N``
returns."""

from __future__ import annotations

import http.server
import io
import json
import re
import threading
import time

from rich.console import Console

from pdcluster.top import Scrape, render, run_top


def _decode(at: float, tokens: float, kv_bytes: float) -> Scrape:
    return Scrape("decode", "decode-0", at, {("decode_batch_size_sum", frozenset()): tokens,
                                             ("kv_received_bytes_total", frozenset()): kv_bytes,
                                             ("num_requests_running", frozenset()): 1.0})


def _text(group) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(group)
    return out.getvalue()


def test_a_restarted_worker_shows_no_negative_rate():
    before = _decode(10.0, 5000.0, 9e8)
    steady = _text(render([_decode(11.0, 5100.0, 9.1e8)], {"decode-0": before}))
    assert "100.0" in steady and "10.00" in steady  # 100 tokens/s, 10 MB/s of KV
    restarted = _text(render([_decode(16.0, 40.0, 2e6)], {"decode-0": before}))  # the replacement's counters
    assert "decode-0" in restarted and not re.search(r"(?<![\w-])-\d", restarted)  # no negative figure


def test_a_worker_that_stopped_answering_is_listed_as_such():
    view = _text(render([], {"decode-0": _decode(10.0, 5000.0, 9e8)}))
    assert "decode-0" in view and "not answering" in view


def test_an_unreachable_router_keeps_the_last_view_and_the_iterations_count():
    class Targets(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps([]).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Targets)
    def once():  # answers once, then the port closes
        server.handle_request()
        server.server_close()

    threading.Thread(target=once, daemon=True).start()
    out = io.StringIO()
    t0 = time.monotonic()
    rc = run_top(f"http://127.0.0.1:{server.server_port}", interval_s=0.1, iterations=2,
                 console=Console(file=out, width=200))
    assert rc == 0 and time.monotonic() - t0 < 20
    assert "cannot reach the router's HTTP server" in out.getvalue()


def test_a_target_that_left_stays_listed_a_while(monkeypatch):
    from pdcluster import top
    answers = iter([[_decode(time.monotonic(), 1.0, 1.0)], [], []])
    monkeypatch.setattr(top, "snapshot", lambda *a, **k: next(answers))
    out = io.StringIO()
    assert run_top("http://127.0.0.1:1", interval_s=0.01, iterations=2, console=Console(file=out, width=200)) == 0
    last = out.getvalue().rsplit("router", 1)[-1]  # the final frame
    assert "decode-0" in last and "not answering" in last


def test_the_routers_errors_are_split_into_failed_and_refused_or_left():
    def errors(code: str, n: float):
        return ("request_errors_total", frozenset({("code", code)})), n

    router = Scrape("router", "router", 10.0, dict([errors("UNAVAILABLE", 2.0), errors("INTERNAL", 1.0),
                                                    errors("INVALID_ARGUMENT", 50.0), errors("CANCELLED", 4.0)]))
    assert router.errors() == (3.0, 54.0)
    view = _text(render([router], {}))
    assert "failed" in view and "refused/left" in view and re.search(r"\b3 .*\b54\b", view)

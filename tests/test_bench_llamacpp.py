"""``bench/_decode_llamacpp.py``: the llama.cpp peer's process handling, request and timing arithmetic
and its report section, against a stand-in ``llama-server`` (a small HTTP server speaking the two
endpoints the peer uses; the real binary is built outside the repository, see bench/README.md)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _decode_llamacpp as lc  # noqa: E402
import _decode_report  # noqa: E402

FAKE_SERVER = f"""#!{sys.executable}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
assert args[args.index("-t") + 1] == "2" and args[args.index("--parallel") + 1] == "3"
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0 and body["ignore_eos"] and not body["cache_prompt"]
        n = body["n_predict"]
        out = {{"tokens": [t + 1 for t in body["prompt"][:n]],
                "timings": {{"predicted_n": n, "predicted_ms": 10.0 * n * len(body["prompt"])}}}}
        data = json.dumps(out).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path) -> str:
    path = tmp_path / "llama-server"
    path.write_text(FAKE_SERVER)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_peer_times_a_batch_and_stops(fake_server, tmp_path):
    peer = lc.LlamaCppPeer(fake_server, tmp_path / "m.gguf", threads=2, max_batch=3, max_seq_len=64,
                           log_path=tmp_path / "log", start_timeout_s=30)
    try:
        # prompts of 1, 2 and 3 tokens: 10, 20 and 30 ms per token; the median is the batch's TPOT
        r = peer.run_point(3, 2, 4, [[5], [5, 6], [5, 6, 7]])
    finally:
        peer.close()
    assert r["tpot_ms_requests"] == [10.0, 20.0, 30.0] and r["tpot_ms"] == 20.0
    assert r["tokens_per_s"] == pytest.approx(150.0) and r["token_ids"] == [[6], [6, 7], [6, 7, 8]]
    assert peer.proc.poll() is not None


def test_peer_start_errors(tmp_path):
    with pytest.raises(lc.LlamaCppError, match="no llama-server binary"):
        lc.LlamaCppPeer(str(tmp_path / "missing"), tmp_path / "m.gguf", 2, 1, 64, tmp_path / "log")
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(lc.LlamaCppError, match="exited with 3"):
        lc.LlamaCppPeer(str(failing), tmp_path / "m.gguf", 2, 1, 64, tmp_path / "log", start_timeout_s=30)


def test_report_section():
    point = {"batch_size": 1, "context_len": 128, "tokens_per_s": 50.0, "ratio_llamacpp": 0.5,
             "llamacpp": {"tokens_per_s": 100.0, "tpot_ms": 10.0},
             "greedy_agreement_llamacpp": {"identical_seqs": 1, "num_seqs": 1, "mean_common_prefix": 4}}
    res = {"quantization": "q4", "points": [point],
           "llamacpp_info": {"threads": 2, "parallel": 1, "gguf": "/x/SmolLM2.Q4_1.gguf"}}
    text = "\n".join(_decode_report._llamacpp(res))
    assert "`SmolLM2.Q4_1.gguf`" in text and "--quantization q4" in text
    assert "| 1 | 128 | 50.0 | 100.0 | 10.0 | 0.50x | 1/1 |" in text
    assert _decode_report._llamacpp({"points": []}) == []
    assert "did not start: `boom`" in "\n".join(_decode_report._llamacpp({"points": [], "llamacpp_start_error": "boom"}))

"""llama.cpp as a decode benchmark peer: ``llama-server`` on the model's own GGUF file.

``bench/decode.py --llamacpp-server PATH`` starts ``PATH -m GGUF`` once (``-t``/``-tb`` = our torch
thread count, ``--parallel`` = the largest batch, a context of ``--parallel`` x the longest
sequence, loopback, a free port) and, per point, sends every prompt of the batch at once as token
ids to ``POST /completion`` (greedy: ``temperature`` 0, ``top_k`` 1; ``ignore_eos``;
``n_predict`` = the point's new tokens; ``cache_prompt`` off, so each point prefills its prompts).
llama.cpp reports per request ``timings.predicted_ms`` / ``predicted_n``: the time its generated
tokens took. The peer's TPOT is the median over the batch of ``predicted_ms / predicted_n`` and
tokens/s = batch / TPOT. At batch 1 that is its decode step; at larger batches a request's
decode time also holds the steps in which other slots still prefilled, so TPOT is an upper bound
there.

llama.cpp computes with the GGUF's own quantized weights (SmolLM2's bundled file is Q4_1): compare
it with our ``--quantization q4``, which serves the same blocks. Its CPU kernels also round the
activations to 8 bits (ggml's Q8_1 blocks) before each dot product, so its greedy tokens drift
from ours after a few tokens (the report's last column). It is a benchmark peer only:
built outside the repository (``bench/README.md``), never a pdcluster dependency.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class LlamaCppError(RuntimeError):
    """llama-server did not start, or a request failed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppPeer:
    """A running ``llama-server`` (see the module docstring).

    Args:
        server: path of the ``llama-server`` binary.
        gguf: the model's GGUF file.
        threads: its ``-t`` and ``-tb`` (the thread count ours and HF use).
        max_batch: slots (``--parallel``): the largest batch of the run.
        max_seq_len: tokens per slot (prompt + new tokens).
        log_path: where its stdout and stderr go.
        start_timeout_s: seconds to wait for ``GET /health``.

    Raises:
        LlamaCppError: the binary is missing, exits, or is not healthy in time.
    """

    def __init__(self, server: str, gguf: Path, threads: int, max_batch: int, max_seq_len: int, log_path: Path,
                 start_timeout_s: float = 120.0) -> None:
        if not Path(server).is_file():
            raise LlamaCppError(f"no llama-server binary at {server}")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [server, "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "--parallel", str(max_batch),
             "-c", str(max_batch * max_seq_len), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.info = {"server": server, "gguf": Path(gguf).name, "threads": threads, "parallel": max_batch,
                     "ctx_per_slot": max_seq_len, "log": str(log_path)}
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise LlamaCppError(f"llama-server exited with {self.proc.returncode}; its log: {log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise LlamaCppError(f"llama-server not healthy after {start_timeout_s:.0f} s; its log: {log_path}")

    def _complete(self, prompt: list[int], new_tokens: int) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                           "ignore_eos": True, "cache_prompt": False, "return_tokens": True}).encode()
        req = urllib.request.Request(f"{self.url}/completion", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise LlamaCppError(f"/completion failed: {e}") from None

    def run_point(self, batch: int, context: int, new_tokens: int, prompts: list[list[int]]) -> dict:
        """Every prompt at once; ``{"tpot_ms", "tokens_per_s", "tpot_ms_requests", "token_ids"}``.

        Raises:
            LlamaCppError: a request failed or came back without timings.
        """
        with ThreadPoolExecutor(len(prompts)) as pool:
            out = list(pool.map(lambda p: self._complete(p, new_tokens), prompts))
        per = []
        for r in out:
            t = r.get("timings") or {}
            if not t.get("predicted_n"):
                raise LlamaCppError(f"a response without timings: {str(r)[:200]}")
            per.append(t["predicted_ms"] / t["predicted_n"])
        tpot = statistics.median(per)
        return {"tpot_ms": tpot, "tokens_per_s": batch * 1e3 / tpot, "tpot_ms_requests": per,
                "token_ids": [r.get("tokens") or [] for r in out]}

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

"""vLLM offline decode measurement, run in a separate virtual environment.

This file has two halves that share one line-based JSON protocol:

* :class:`VllmPeer` (imported by ``bench/decode.py``, standard library only) starts
  ``VLLM_PYTHON bench/_decode_vllm.py MODEL_DIR MAX_MODEL_LEN RESULT_FD`` with the environment
  of the recipe in ``bench/README.md``, waits until the model is loaded, then sends one point
  at a time on the child's stdin and reads each result from a pipe, so vLLM's points can be
  interleaved with ours and HF's on a shared machine (an idle vLLM engine blocks on its input
  queue);
* the ``__main__`` half (run by that interpreter, imports only the standard library and
  ``vllm``) loads the model once and runs each point through ``LLMEngine.add_request`` /
  ``step``, timing every engine step.

vLLM is a benchmark peer only: nothing in pdcluster imports it.

Timing, per point: every request is added at once (greedy, ``ignore_eos``, ``max_tokens``
new tokens); after each ``step()`` the wall clock and each request's cumulative token count
are recorded. The steady decode window runs from the step in which the last request got its
first token to the step in which the first request finished; inside it every step is a pure
decode step of the whole batch (vLLM's chunked prefill mixes prefill chunks into the steps
before it). ``tpot_ms`` = the median interval between the window's steps, ``tokens_per_s``
= batch / that; ``tpot_ms_mean`` = window seconds / window steps, ``tokens_per_s_mean`` =
tokens produced in the window / window seconds.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: Environment of the recipe (bench/README.md): offline, 4 GiB of KV cache space, tcmalloc.
RECIPE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
}


class VllmError(RuntimeError):
    """The vLLM child failed, timed out or answered with an error."""


class VllmPeer:
    """A vLLM engine in a child process of ``vllm_python``, one point at a time.

    Args:
        vllm_python: interpreter of a virtual environment with vLLM's CPU build.
        model_dir: the HF folder our engine loads (same weights).
        max_model_len: vLLM's ``max_model_len`` (tokens).
        log_path: where the child's stdout and stderr go.
        load_timeout_s: seconds allowed for start-up (model load, compilation, warm-up).
        extra_env: variables added to the recipe's environment.

    Raises:
        VllmError: the child could not start or load the model.
    """

    def __init__(self, vllm_python: str, model_dir: str, max_model_len: int, log_path: Path,
                 load_timeout_s: float = 900.0, extra_env: dict[str, str] | None = None) -> None:
        env = dict(os.environ)
        env.update(RECIPE_ENV)
        if not Path(RECIPE_ENV["LD_PRELOAD"]).exists():
            env.pop("LD_PRELOAD")
        env.update(extra_env or {})
        self.log_path = log_path
        r, w = os.pipe()
        self._log = log_path.open("w")
        try:
            self._proc = subprocess.Popen(
                [vllm_python, str(Path(__file__).resolve()), model_dir, str(max_model_len), str(w)],
                env=env, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                pass_fds=(w,), text=True, cwd=log_path.parent)
        except OSError as e:
            raise VllmError(f"cannot start {vllm_python}: {e}") from e
        finally:
            os.close(w)
        self._results = os.fdopen(r, "r")
        self.info = self._read(load_timeout_s)["ready"]

    def _read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self._results], [], [], timeout_s)
        line = self._results.readline() if ready else ""
        if not line:
            self.close()
            raise VllmError(("no answer within %.0f s" % timeout_s if not ready else "vLLM child exited")
                            + f"; log tail: {_tail(self.log_path)}")
        msg = json.loads(line)
        if "error" in msg:
            raise VllmError(msg["error"])
        return msg

    def run_point(self, batch_size: int, context_len: int, new_tokens: int, prompts: list[list[int]],
                  timeout_s: float = 1800.0) -> dict:
        """Decode ``new_tokens`` greedy tokens for ``prompts`` (``batch_size`` token-id lists
        of ``context_len`` tokens) as one batch; returns the point's record (module docstring)."""
        self._proc.stdin.write(json.dumps({"batch_size": batch_size, "context_len": context_len,
                                           "new_tokens": new_tokens, "prompts": prompts}) + "\n")
        self._proc.stdin.flush()
        return self._read(timeout_s)

    def close(self) -> None:
        """Stop the child (it exits at the end of its stdin) and wait for it."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._results.close()
        self._log.close()


def _tail(path: Path, n: int = 30) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:] if path.exists() else []


def steady_window(events: list[tuple[float, dict[str, int]]], new_tokens: int) -> dict:
    """Steady decode window of one point from per-step ``(time_s, {request: tokens so far})``.

    Returns ``{"window_s", "window_steps", "window_tokens", "median_step_s"}``; the window
    starts at the step where the last request got its first token and ends at the first step
    where a request reached ``new_tokens``; ``median_step_s`` is the median interval between
    consecutive steps inside it.
    """
    seen: dict[str, int] = {}
    first: dict[str, float] = {}
    done_at = None
    for t, counts in events:
        for rid, n in counts.items():
            if n >= 1 and rid not in first:
                first[rid] = t
            if n >= new_tokens and done_at is None:
                done_at = t
    start = max(first.values())
    tokens = 0
    times = [start]
    for t, counts in events:
        for rid, n in counts.items():
            if start < t <= done_at:
                tokens += n - seen.get(rid, 0)
            seen[rid] = n
        if start < t <= done_at and counts:
            times.append(t)
    return {"window_s": done_at - start, "window_steps": len(times) - 1, "window_tokens": tokens,
            "median_step_s": statistics.median(b - a for a, b in zip(times, times[1:]))}


def _run_point(engine, SamplingParams, p: dict, tag: str) -> dict:
    load1 = os.getloadavg()[0]
    params = SamplingParams(temperature=0.0, max_tokens=p["new_tokens"], ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(p["prompts"]))]
    t0 = time.perf_counter()
    for rid, prompt in zip(rids, p["prompts"]):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    events: list[tuple[float, dict[str, int]]] = []
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        counts = {}
        for o in outs:
            counts[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                final[o.request_id] = list(o.outputs[0].token_ids)
        events.append((t, counts))
    total_s = time.perf_counter() - t0
    w = steady_window(events, p["new_tokens"])
    return {
        "batch_size": p["batch_size"], "context_len": p["context_len"], "new_tokens": p["new_tokens"],
        "tokens_per_s": p["batch_size"] / w["median_step_s"], "tpot_ms": w["median_step_s"] * 1e3,
        "tokens_per_s_mean": w["window_tokens"] / w["window_s"],
        "tpot_ms_mean": w["window_s"] / w["window_steps"] * 1e3,
        "window_steps": w["window_steps"], "total_s": total_s, "load_avg_1m": load1,
        "token_ids": [final[r] for r in rids],
    }


def _serve(model_dir: str, max_model_len: int, result_fd: int) -> None:
    out = os.fdopen(result_fd, "w")

    def send(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        import vllm
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(model=model_dir, dtype="float32", max_model_len=max_model_len, seed=0)
        llm.generate([{"prompt_token_ids": list(range(100, 116))}],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        env = {k: os.environ.get(k) for k in sorted(os.environ) if k.startswith(("VLLM_", "OMP_", "LD_PRE"))}
        send({"ready": {"vllm": vllm.__version__, "load_s": time.perf_counter() - t0, "env": env}})
    except Exception as e:  # noqa: BLE001 - report any start-up failure to the parent
        send({"error": f"vLLM start-up failed: {type(e).__name__}: {e}"})
        return
    for k, line in enumerate(sys.stdin):
        try:
            send(_run_point(llm.llm_engine, SamplingParams, json.loads(line), f"p{k}"))
        except Exception as e:  # noqa: BLE001 - report the failure, keep serving
            send({"error": f"vLLM point failed: {type(e).__name__}: {e}"})


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

"""End-to-end check of a local 1P+1D cluster: TTFT and TPOT seen by a client (``scripts/gpu_check.sh``).

Brings up ``pdcluster up --local --prefill 1 --decode 1`` (the CLI's own parser), sends a
warm-up burst on prompts of its own, then ``--requests`` concurrent greedy streams
(``ignore_eos``) of sonnet prompts of ``--prompt-tokens`` tokens for ``--new-tokens`` tokens
each through the router's gRPC API, and takes down the cluster (also on SIGINT /
KeyboardInterrupt; not on SIGTERM: Ray's driver turns that into a crash without cleanup).
Per request, client-side: TTFT = first token - call start; TPOT = (last token - first token) / (tokens - 1).

* ``--device cuda``: both workers on one GPU (``--worker-gpus 0.5``), bfloat16 weights and KV,
  gRPC KV transport (NCCL cannot pair two processes on one GPU). Fails when Ray placed the
  workers elsewhere than on CUDA (e.g. Ray saw no GPU).
* ``--device cpu``: float32, a small KV pool; meant CI-sized (few requests and tokens).

Writes one JSON object to ``--out`` (and stdout): the setup, ``ok`` (every request returned
exactly ``--new-tokens`` tokens and afterwards every worker's KV pool is back at its baseline:
``kv_held_after`` empty), ``failed`` (request errors), TTFT / TPOT median, p90 and max
(ms), output tokens/s of the burst, wall seconds of ``up``.

Usage: ``python bench/e2e_check.py --device cuda --out e2e.json``;
``python bench/e2e_check.py --device cpu --requests 2 --prompt-tokens 32 --new-tokens 8 --out e2e.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.ray_env import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before anything imports ray: the local cluster stays on loopback

from _common import sonnet_prompts  # noqa: E402

UP_FLAGS = {
    "cuda": ["--device", "cuda", "--dtype", "bfloat16", "--worker-gpus", "0.5", "--kv-cache-gb", "4",
             "--max-model-len", "4096", "--max-num-seqs", "64", "--kv-transport", "grpc"],
    "cpu": ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "512",
            "--max-num-seqs", "8", "--kv-transport", "grpc"],
}

WARM_UP_STREAMS = {"cuda": 4, "cpu": 1}  # concurrent warm-up requests (4 tokens each) before the timed burst


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(UP_FLAGS), required=True)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (engine.model_loader)")
    p.add_argument("--requests", type=int, default=32, help="concurrent streams")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--timeout-s", type=float, default=120, help="`up`'s health timeout and each call's deadline")
    p.add_argument("--out", type=Path, required=True, help="JSON output file")
    a = p.parse_args(argv)
    if min(a.requests, a.prompt_tokens) < 1 or a.new_tokens < 2:
        p.error("--requests and --prompt-tokens must be >= 1, --new-tokens >= 2")
    return a


def _stream(client, prompt: list[int], n: int, rec: dict) -> None:
    """One greedy stream; fills ``rec`` with its start, token times and count, or its error."""
    rec["start"] = time.perf_counter()
    times: list[float] = []
    try:
        for msg in client.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True):
            times.extend([time.perf_counter()] * len(msg.token_ids))
    except Exception as e:  # noqa: BLE001 - recorded per request, reported in the JSON
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["times"] = times


def _burst(client, prompts: list[list[int]], n: int, fail_as: str | None = None) -> list[dict]:
    """One concurrent stream per prompt; their records. ``fail_as``: raise RuntimeError naming it
    when any request failed."""
    recs: list[dict] = [{} for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(client, p, n, r), daemon=True) for p, r in zip(prompts, recs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r["error"] for r in recs if "error" in r]
    if fail_as and errors:
        raise RuntimeError(f"{fail_as} request failed: {errors[0]}")
    return recs


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def summarize(recs: list[dict], new_tokens: int) -> dict:
    """TTFT / TPOT (ms) over the requests that produced tokens, and the burst's output tokens/s."""
    done = [r for r in recs if len(r["times"]) >= 2]
    ttft = [1e3 * (r["times"][0] - r["start"]) for r in done]
    tpot = [1e3 * (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in done]
    out = {"requests": len(recs), "failed": [r["error"] for r in recs if "error" in r],
           "tokens": [len(r["times"]) for r in recs],
           "ok": all("error" not in r and len(r["times"]) == new_tokens for r in recs)}
    if done:
        span = max(r["times"][-1] for r in done) - min(r["start"] for r in recs)
        out |= {f"{name}_ms_{stat}": fn(xs) for name, xs in (("ttft", ttft), ("tpot", tpot))
                for stat, fn in (("median", statistics.median), ("p90", lambda v: _pct(v, 0.9)), ("max", max))}
        out["output_tokens_per_s"] = sum(len(r["times"]) for r in done) / span
    return out


def held_kv(state: dict, timeout_s: float = 5.0) -> dict[str, list[int]]:
    """Workers whose KV pool is not back at its baseline within ``timeout_s`` (worker id -> [blocks
    held, requests running]); empty when every block is free and nothing runs (the tests' leak check)."""
    from pdcluster.v1 import worker_pb2, worker_pb2_grpc
    from serving.registry import WorkerRegistry
    from serving.security import SecurityConfig, internal_channel

    sec = SecurityConfig(cluster_secret=state["cluster_secret"], internal_ca_cert=state.get("internal_ca_cert", ""),
                         internal_ca_key=state.get("internal_ca_key", ""))
    deadline = time.monotonic() + timeout_s
    while True:
        held = {}
        for info, _ in WorkerRegistry(state["redis_url"], state["cluster"]).live_workers():
            stub = (worker_pb2_grpc.PrefillWorkerStub if info.role == "prefill"
                    else worker_pb2_grpc.DecodeWorkerStub)(internal_channel(sec, info.address))
            w = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            if w.num_free_blocks != w.num_total_blocks or w.num_running:
                held[w.worker_id] = [w.num_total_blocks - w.num_free_blocks, w.num_running]
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def run(a: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from deploy import local
    from pdcluster.cli import build_parser
    from pdcluster.client import PdclusterClient

    state_dir = Path(tempfile.mkdtemp(prefix="e2e-check-"))
    flags = list(UP_FLAGS[a.device])
    if a.device == "cuda":  # the Ray head advertises the GPUs torch sees (not only what Ray detects itself)
        import torch

        flags += ["--ray-resources", json.dumps({"GPU": torch.cuda.device_count()})]
    args = build_parser().parse_args(["up", "--local", "--port", "0", "--http-port", "0", "--state-dir", str(state_dir),
                                      "--model", a.model, "--prefill", "1", "--decode", "1",
                                      "--timeout-s", str(a.timeout_s), *flags])
    t0 = time.perf_counter()
    state = local.up(args)
    up_s = time.perf_counter() - t0
    try:
        shape = state["shape"]
        if shape["device"] != a.device:
            raise RuntimeError(f"workers placed on {shape['device']!r}, not {a.device!r} (shape {shape}): "
                               "does Ray see the GPU (`ray status`)?")
        with PdclusterClient(state["router_address"], timeout_s=a.timeout_s) as client:
            client.wait_ready(60)
            # kernel compiles and first CUDA work outside the timings, on prompts of their own (prefix cache)
            _burst(client, prompts[a.requests:], 4, "warm-up")
            recs = _burst(client, prompts[:a.requests], a.new_tokens)
        held = held_kv(state)
    finally:
        local.down(state_dir)
    res = summarize(recs, a.new_tokens) | {"up_s": up_s, "worker_shape": shape, "kv_held_after": held}
    res["ok"] = res["ok"] and not held
    if res["ok"]:
        shutil.rmtree(state_dir, ignore_errors=True)  # kept (Ray / Redis logs) when something went wrong
    else:
        res["state_dir"] = str(state_dir)
    return res


def main(argv=None) -> int:
    a = _parse(argv)
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    warm = WARM_UP_STREAMS[a.device]
    prompts = sonnet_prompts(AutoTokenizer.from_pretrained(resolve_model(a.model)), a.requests + warm, a.prompt_tokens)
    res = run(a, prompts)
    out = {"device": a.device, "model": a.model, "up_flags": UP_FLAGS[a.device], "prompt_tokens": a.prompt_tokens,
           "new_tokens": a.new_tokens} | res
    if a.device == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

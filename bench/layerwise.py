"""How much of the KV transfer layer-wise streaming hides behind prefill compute.

A real :class:`prefill_worker.scheduler.PrefillScheduler` (SmolLM2-135M, float32, CPU)
prefills one prompt of each length (default 512, 1024, 2048 tokens) and ships its KV
through a registered transport (default: every one of ``grpc``, ``torch_dist``) to a
decode-side receiver in its own process (``bench/_kv_receiver.py``: a real paged cache
behind the decode worker's reservation table), twice per repetition, in alternating
order:

* ``after``: layer-wise streaming off — the transfer starts when the prefill step ended;
* ``layerwise``: the transfer starts with the step, each layer's chunk leaves as soon as
  the model reports that layer written.

Per request the scheduler reports ``prefill_s`` (compute), ``transfer_s`` (exposed:
from the end of compute to the decode side's acknowledgement) and ``transfer_total_s``
(first byte to acknowledgement). ``hidden_fraction = 1 - exposed(layerwise) /
exposed(after)``: the share of the transfer that moved behind compute; and
``ttft_gain = (prefill + exposed)(after) / (prefill + exposed)(layerwise)``. Medians of
``--reps`` repetitions, measured in one run on this (shared) machine.

Writes ``<name>.json`` and ``<name>.md`` under ``--out-dir`` (default bench/results) and
prints the JSON to stdout. ``--quick``: 512 tokens, gRPC only, 2 repetitions, into a
temporary folder.

Usage::

    python bench/layerwise.py --quick
    python bench/layerwise.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _kv_measure import Receiver  # noqa: E402

from common.model_config import ModelConfig  # noqa: E402
from engine.block_pool import blocks_needed  # noqa: E402
from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.kv_cache import allocate_kv_cache  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.model_loader import resolve_model  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.request import Request, RequestParams  # noqa: E402
from engine.sampling import SamplingOptions  # noqa: E402
from kvtransfer.config import KvTransferConfig  # noqa: E402
from kvtransfer.registry import create_sender  # noqa: E402
from prefill_worker.scheduler import PrefillScheduler  # noqa: E402

import _common  # noqa: E402

BLOCK_SIZE = 16
MODES = ("after", "layerwise")


log = _common.logger("layerwise")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens")
    p.add_argument("--transports", default="grpc,torch_dist")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers-per-chunk", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the prefill side")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--name", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.transports, a.reps = "512", "grpc", 2
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.transports = a.transports.split(",")
    a.out_dir = _common.out_dir(a.out_dir, a.quick, "layerwise-bench-")
    a.name = a.name or ("layerwise_quick" if a.quick else "layerwise")
    return a


class Bench:
    """One scheduler per mode over one model; a route that reserves on the receiver and sends."""

    def __init__(self, model, cfg: ModelConfig, receiver: Receiver, transport: str, layers_per_chunk: int,
                 num_blocks: int) -> None:
        self.receiver = receiver
        self.sender = create_sender(KvTransferConfig(transport=transport, timeout_s=600.0))
        self.layers_per_chunk = layers_per_chunk
        self.count = 0
        self.scheds = {}
        for mode in MODES:
            cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=False)
            runner = ModelRunner(model, allocate_kv_cache(cfg, cache, torch.device("cpu")), BLOCK_SIZE)
            self.scheds[mode] = PrefillScheduler(runner, cache, SchedulerConfig(max_num_batched_tokens=4096,
                                                                                max_model_len=4096),
                                                 layerwise=mode == "layerwise")

    def once(self, mode: str, prompt: list[int]) -> dict:
        """Prefill + transfer of one prompt; the scheduler's timings and the wall time."""
        self.count += 1
        tid, rid = f"t{self.count}", f"r{self.count}"
        dest = self.receiver.reserve(tid, rid, blocks_needed(len(prompt), BLOCK_SIZE), BLOCK_SIZE)
        sched = self.scheds[mode]
        kv = sched.runner.kv_cache

        def send(req: Request, progress) -> int:
            res = self.sender.send(req.request_id, req.transfer_id, dest, kv, list(req.block_table), None,
                                   layers_per_chunk=self.layers_per_chunk, progress=progress)
            return res.bytes_sent

        req = Request(rid, list(prompt), RequestParams(max_tokens=1, sampling=SamplingOptions(temperature=0.0)),
                      transfer_id=tid)
        t0 = time.perf_counter()
        fut = sched.submit(req, send)
        while not fut.done():
            sched.step()
        res = fut.result()
        wall = time.perf_counter() - t0
        self.receiver.check_completed(tid)
        return {"prefill_s": res.prefill_s, "exposed_s": res.transfer_s, "transfer_total_s": res.transfer_total_s,
                "wall_s": wall, "kv_bytes": res.kv_bytes_sent}

    def close(self) -> None:
        for s in self.scheds.values():
            s.shutdown()
        self.sender.close()


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def point(bench: Bench, prompt: list[int], reps: int) -> dict:
    bench.once("after", prompt)  # warm-up (channel, pair group, kernels)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(reps):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            runs[mode].append(bench.once(mode, prompt))
    med = {m: {k: _median(rs, k) for k in ("prefill_s", "exposed_s", "transfer_total_s", "wall_s")}
           for m, rs in runs.items()}
    after, lw = med["after"], med["layerwise"]
    return {
        "prompt_tokens": len(prompt), "kv_bytes": runs["after"][0]["kv_bytes"], "reps": reps,
        "median": med, "runs": runs,
        "hidden_fraction": 1.0 - lw["exposed_s"] / after["exposed_s"] if after["exposed_s"] > 0 else None,
        "ttft_gain": (after["prefill_s"] + after["exposed_s"]) / (lw["prefill_s"] + lw["exposed_s"]),
        "load_avg_1m": _common.load_avg_1m(),
    }


def markdown(res: dict) -> str:
    lines = [
        "# Layer-wise KV streaming: transfer hidden behind prefill compute",
        "",
        f"Run {res['started_at']}, {res['duration_s'] / 60:.1f} min; {res['cpu']}, {res['cpu_count']} cores; "
        f"torch {res['torch']}; prefill side {res['threads']} torch threads, receiver in its own process; "
        f"1-minute load average {res['load_avg_1m_start']:.2f} at the start (a shared machine). "
        f"Block size {BLOCK_SIZE}, {res['layers_per_chunk']} layers per chunk, float32 KV. "
        "Medians of the repetitions; *after* = transfer started when the prefill step ended, "
        "*layerwise* = started with the step, each layer sent once computed.",
        "",
        "| transport | prompt tokens | KV MB | prefill ms | exposed ms (after) | exposed ms (layerwise) "
        "| total transfer ms (layerwise) | hidden fraction | TTFT gain | load 1m |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in res["points"]:
        a, lw = p["median"]["after"], p["median"]["layerwise"]
        hf = "—" if p["hidden_fraction"] is None else f"{p['hidden_fraction']:.2f}"
        lines.append(f"| {p['transport']} | {p['prompt_tokens']} | {p['kv_bytes'] / 1e6:.1f} | "
                     f"{a['prefill_s'] * 1e3:.0f} | {a['exposed_s'] * 1e3:.1f} | {lw['exposed_s'] * 1e3:.1f} | "
                     f"{lw['transfer_total_s'] * 1e3:.1f} | {hf} | {p['ttft_gain']:.3f}x | {p['load_avg_1m']:.2f} |")
    for e in res.get("errors", []):
        lines.append(f"\n* {e}")
    if res.get("analysis"):
        lines += ["", "## Analysis", "", res["analysis"]]
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    folder = resolve_model(args.model)
    cfg = ModelConfig.from_hf_folder(folder, name=args.model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    num_blocks = blocks_needed(max(args.lengths), BLOCK_SIZE) + 2
    shape = (cfg.num_layers, 2, num_blocks * 4, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    res = {"benchmark": "layerwise", "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "cpu": _common.cpu_name(), "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "threads": args.threads, "layers_per_chunk": args.layers_per_chunk,
           "load_avg_1m_start": _common.load_avg_1m(), "points": [], "errors": []}
    with Receiver(shape, KvTransferConfig().max_chunk_bytes) as receiver:
        for transport in args.transports:
            try:
                bench = Bench(model, cfg, receiver, transport, args.layers_per_chunk, num_blocks)
            except KeyError as e:
                res["errors"].append(f"{transport}: {e}")
                continue
            try:
                for n in args.lengths:
                    prompt = _common.sonnet_prompts(tok, 1, n)[0]
                    log(f"{transport}: {n} tokens")
                    res["points"].append({"transport": transport, **point(bench, prompt, args.reps)})
            finally:
                bench.close()
    res["duration_s"] = time.perf_counter() - t0
    return res


def main(argv=None) -> int:
    args = _parse(argv)
    res = run(args)
    stem, _ = _common.write_results(res, args.out_dir, args.name, markdown)
    log(f"wrote {stem}.json and .md")
    sys.stdout.write(json.dumps({k: v for k, v in res.items() if k != "points"} |
                                {"points": [{k: v for k, v in p.items() if k != "runs"} for p in res["points"]]},
                                indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Our decode path, measured through the decode worker's scheduler.

:func:`prefill_kv` runs the prompts through a local :class:`ModelRunner` (as a prefill
worker does) and keeps each prompt's KV blocks and first token. :func:`measure_decode` then
reserves the batch in a :class:`DecodeScheduler`, delivers the KV through its
``TransferTable`` (what the KV receiver does) and steps the scheduler until every request
has ``new_tokens`` tokens, timing each step and its parts:

* ``forward`` -- the decoder forward (``model(...)``), ``lm_head`` -- ``compute_logits``;
* ``metadata`` -- ``build_attention_metadata``, ``sampling`` -- ``Sampler.sample``;
* ``runner_other`` -- the rest of ``ModelRunner.execute`` (input tensor, logits rows,
  ``tolist``); ``scheduler`` -- the rest of ``DecodeScheduler.step`` (inbox, planning,
  block growth, stop checks, events).

Step overhead = step time - (forward + lm_head). :func:`stream_costs` times, per token, what
follows outside the step: the decode worker turning events into ``DecodeEvent`` messages
(serialized), and the router parsing them and running :class:`OutputAssembler`
(incremental detokenization) into serialized ``GenerateResponse`` messages.

All times are wall-clock ``time.perf_counter`` seconds on the stepping thread.
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import time

import torch

import engine.model_runner as model_runner_mod
from common.model_config import ModelConfig
from decode_worker.events import Reserved, Tokens
from decode_worker.scheduler import DecodeScheduler
from engine.block_pool import blocks_needed
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import allocate_kv_cache
from engine.model_runner import ModelRunner
from engine.request import Request, RequestParams
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan

GREEDY = SamplingOptions(temperature=0.0)
PARTS = ("forward", "lm_head", "metadata", "sampling", "execute")


def prefill_kv(model, cfg: ModelConfig, prompts: list[list[int]], block_size: int,
               max_tokens_per_step: int = 2048) -> list[tuple[torch.Tensor, int]]:
    """Prefill every prompt; return per prompt its KV ``[layers, 2, blocks, block_size,
    kv_heads, head_dim]`` (a copy) and its greedy first token."""
    per_step = max(1, max_tokens_per_step // max(len(p) for p in prompts))
    need = max(blocks_needed(len(p), block_size) for p in prompts)
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=block_size, num_blocks=per_step * need + 1),
                           torch.device("cpu"))
    runner = ModelRunner(model, kv, block_size)
    out: list[tuple[torch.Tensor, int]] = []
    for at in range(0, len(prompts), per_step):
        group = prompts[at:at + per_step]
        tables = [list(range(1 + j * need, 1 + j * need + blocks_needed(len(p), block_size)))
                  for j, p in enumerate(group)]
        res = runner.execute(StepPlan([ScheduledSeq(f"pre{at + j}", p, 0, t, True, GREEDY)
                                       for j, (p, t) in enumerate(zip(group, tables))]))
        out += [(kv[:, :, t].clone(), tok) for t, tok in zip(tables, res.token_ids)]
    return out


class _TimedModel:
    """Stands in for the runner's model: times ``__call__`` and ``compute_logits``."""

    def __init__(self, model, acc: dict[str, float]) -> None:
        self._model, self._acc = model, acc

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._model(*args, **kwargs)
        self._acc["forward"] += time.perf_counter() - t0
        return out

    def compute_logits(self, hidden):
        t0 = time.perf_counter()
        out = self._model.compute_logits(hidden)
        self._acc["lm_head"] += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def _timed(fn, acc: dict[str, float], key: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        acc[key] += time.perf_counter() - t0
        return out
    return wrapper


@contextlib.contextmanager
def _instrument(runner: ModelRunner, acc: dict[str, float]):
    """Time the parts of ``runner.execute`` into ``acc`` (restored on exit). The metadata
    builder is wrapped where ``engine.model_runner`` looks it up; if that name is gone, its
    time stays inside ``runner_other``."""
    meta_fn = getattr(model_runner_mod, "build_attention_metadata", None)
    runner.model = _TimedModel(runner.model, acc)
    plan = getattr(runner, "decode_plan", None)  # a decode step's forward when the model has one
    if plan is not None:
        runner.decode_plan = _timed(plan, acc, "forward")
    runner.sampler.sample = _timed(runner.sampler.sample, acc, "sampling")
    runner.execute = _timed(runner.execute, acc, "execute")
    if meta_fn is not None:
        model_runner_mod.build_attention_metadata = _timed(meta_fn, acc, "metadata")
    try:
        yield meta_fn is not None
    finally:
        runner.model = runner.model._model
        if plan is not None:
            runner.decode_plan = plan
        vars(runner.sampler).pop("sample", None)
        vars(runner).pop("execute", None)
        if meta_fn is not None:
            model_runner_mod.build_attention_metadata = meta_fn


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def _admitted_batch(model, cfg: ModelConfig, prompts: list[list[int]], prefilled, new_tokens: int,
                    block_size: int, decode_plan: bool = True, layer_loop: str = "c++"):
    """A decode scheduler holding every prompt as a running request whose KV came from
    ``prefilled``; returns ``(runner, scheduler, event queues)``. ``decode_plan`` False: decode steps run
    the model's modules even where the runner built a decode plan (``engine.model.decode_plan``), to
    measure what the plan saves; ``layer_loop`` ``"python"``: the plan runs its layer loop in Python even where
    it has the C++ one (``engine.kernels.cpu.decode_step``), to measure what that saves.

    Raises:
        RuntimeError: a request was not admitted at once.
    """
    b = len(prompts)
    per_req = blocks_needed(len(prompts[0]) + new_tokens, block_size)
    num_blocks = b * per_req + max(4, b * per_req // 50)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    runner = ModelRunner(model, allocate_kv_cache(cfg, cache, torch.device("cpu")), block_size)
    if not decode_plan:
        runner.decode_plan = None
    elif layer_loop == "python" and runner.decode_plan is not None:
        runner.decode_plan.native = None
    sched = DecodeScheduler(runner, cache, SchedulerConfig(max_num_seqs=b, max_model_len=len(prompts[0]) + new_tokens + 1),
                            cfg.eos_token_ids)
    streams: list[queue.Queue] = []
    for i, p in enumerate(prompts):
        streams.append(queue.Queue())
        params = RequestParams(max_tokens=new_tokens, sampling=GREEDY, ignore_eos=True)
        sched.submit_reserve(Request(f"r{i}", list(p), params, transfer_id=f"x{i}"), streams[-1])
    sched.step(block=False)
    for i, (q, (kv, first)) in enumerate(zip(streams, prefilled)):
        ev = _drain(q)
        if len(ev) != 1 or not isinstance(ev[0], Reserved):
            raise RuntimeError(f"request r{i} was not admitted at once: {ev}")
        res = ev[0]
        sched.transfers.write(res.transfer_id, res.generation, 0, kv.shape[0], res.block_ids,
                              kv[:, :, :len(res.block_ids)])
        sched.kv_complete(res.transfer_id, res.generation, first, None)

    return runner, sched, streams


def _summary(steps: list[dict[str, float]], b: int, token_ids, events, has_meta: bool) -> dict:
    """Per-step parts, medians and means of a measured decode run (milliseconds, tokens/s)."""
    for s in steps:
        s["overhead"] = s["step"] - s["forward"] - s["lm_head"]
        s["runner_other"] = s["execute"] - s["forward"] - s["lm_head"] - s["metadata"] - s["sampling"]
        s["scheduler"] = s["step"] - s["execute"]
    total_s = sum(s["step"] for s in steps)
    keys = ("step", "forward", "lm_head", "overhead", "metadata", "sampling", "runner_other", "scheduler")
    median_step_s = statistics.median(s["step"] for s in steps)
    out = {
        "tokens_per_s": b / median_step_s,
        "tpot_ms": median_step_s * 1e3,
        "tokens_per_s_mean": b * len(steps) / total_s,
        "tpot_ms_mean": total_s / len(steps) * 1e3,
        "decode_steps": len(steps),
        "mean_ms": {k: statistics.mean(s[k] for s in steps) * 1e3 for k in keys},
        "median_ms": {k: statistics.median(s[k] for s in steps) * 1e3 for k in keys},
        "metadata_timed_separately": has_meta,
        "token_ids": token_ids,
        "events": events,
    }
    return out


def measure_decode(model, cfg: ModelConfig, prompts: list[list[int]], prefilled: list[tuple[torch.Tensor, int]],
                   new_tokens: int, block_size: int, step_context=None, decode_plan: bool = True,
                   layer_loop: str = "c++") -> dict:
    """Decode ``new_tokens`` greedy tokens (``ignore_eos``) for every prompt as one batch
    through a :class:`DecodeScheduler`; the first token comes from ``prefilled``.
    ``step_context`` (a context manager, e.g. a profiler) wraps the decode steps only; ``decode_plan``
    and ``layer_loop`` as :func:`_admitted_batch`.

    Returns:
        ``tpot_ms``: the median of the ``new_tokens - 1`` decode steps' wall times (robust to
        other jobs' bursts on a shared machine), ``tokens_per_s`` = batch / that;
        ``tpot_ms_mean`` / ``tokens_per_s_mean`` from the total; per-step means
        (``mean_ms``) and medians (``median_ms``) of every part, the overhead, each request's tokens
        (``token_ids``) and the scheduler's ``events`` (for :func:`stream_costs`).

    Raises:
        RuntimeError: a request was not admitted at once or failed.
    """
    b = len(prompts)
    runner, sched, streams = _admitted_batch(model, cfg, prompts, prefilled, new_tokens, block_size, decode_plan,
                                             layer_loop)

    acc = dict.fromkeys(PARTS, 0.0)
    steps: list[dict[str, float]] = []
    events: list[list[Tokens]] = [[] for _ in prompts]
    with _instrument(runner, acc) as has_meta, (step_context or contextlib.nullcontext()):
        while True:
            before = dict(acc)
            t0 = time.perf_counter()
            ran = sched.step(block=False)
            step_s = time.perf_counter() - t0
            if not ran:
                break
            d = {k: acc[k] - before[k] for k in PARTS}
            steps.append({"step": step_s, **d})
    for i, q in enumerate(streams):
        for ev in _drain(q):
            if not isinstance(ev, Tokens):
                raise RuntimeError(f"request r{i} failed: {ev}")
            events[i].append(ev)
    token_ids = [[t for ev in evs for t in ev.token_ids] for evs in events]
    if any(len(t) != new_tokens for t in token_ids) or len(steps) != new_tokens - 1:
        raise RuntimeError(f"expected {new_tokens} tokens in {new_tokens - 1} steps, got "
                           f"{sorted({len(t) for t in token_ids})} in {len(steps)}")
    out = _summary(steps, b, token_ids, events, has_meta)
    out["overhead_share"] = out["mean_ms"]["overhead"] / out["mean_ms"]["step"]
    return out


def stream_costs(tokenizer, prompts: list[list[int]], events: list[list[Tokens]]) -> dict:
    """Per-token cost (microseconds) of what follows a decode step for these events: the
    worker's ``DecodeEvent`` messages (built and serialized as ``decode_worker.server``
    does), and the router's parse + :class:`OutputAssembler` (detokenization) + serialized
    ``GenerateResponse``."""
    from decode_worker.server import FINISH
    from pdcluster.v1 import worker_pb2
    from router.output import OutputAssembler

    n = sum(len(ev.token_ids) for evs in events for ev in evs)
    wire: list[list[bytes]] = []
    t0 = time.perf_counter()
    for evs in events:
        msgs = []
        for ev in evs:
            delta = worker_pb2.TokenDelta(token_ids=ev.token_ids)
            if ev.finish_reason:
                delta.finish_reason = FINISH[ev.finish_reason]
            msgs.append(worker_pb2.DecodeEvent(tokens=delta).SerializeToString())
        wire.append(msgs)
    worker_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, (p, msgs) in enumerate(zip(prompts, wire)):
        asm = OutputAssembler(tokenizer, f"r{i}", p, [])
        for raw in msgs:
            asm.add(worker_pb2.DecodeEvent.FromString(raw).tokens).SerializeToString()
    router_s = time.perf_counter() - t0
    return {"worker_stream_us_per_token": worker_s / n * 1e6,
            "router_detok_stream_us_per_token": router_s / n * 1e6, "num_tokens": n}

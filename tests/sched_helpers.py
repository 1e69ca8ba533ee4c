"""Shared helpers and fixtures of the scheduler tests (not a test module).

The real model and a tokenized text (fixtures ``model`` and ``text_ids``: import
them into a test module to use them), a model runner over a fresh KV cache,
greedy requests, a :class:`PrefillScheduler` and a loop stepping it by hand, and the
decode-side plumbing: a :class:`DecodeScheduler` over
a real runner, the KV and tokens a colocated runner produces for a prompt, and
what the KV receiver does (write into a reservation's blocks, then complete).
Used by ``test_prefill_scheduler.py``, ``test_prefill_layerwise.py``, ``test_decode_scheduler.py``,
``test_decode_preemption.py``, ``test_decode_recompute.py`` and ``test_prefix_cache.py``.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch

from decode_worker.events import Reserved, Tokens
from decode_worker.scheduler import DecodeScheduler
from engine.block_pool import blocks_needed
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.request import Request, RequestParams
from engine.sampling import SamplingOptions, make_generator
from engine.step import ScheduledSeq, StepPlan
from prefill_worker.scheduler import PrefillScheduler

CPU = torch.device("cpu")
BS = 16
TEXT = (
    "In the early morning the harbour was quiet, and the fishing boats rocked gently against the "
    "old wooden pier while gulls circled overhead, waiting for the first catch of the day to be "
    "unloaded onto the cold stone quay by the tired fishermen who had been out since midnight. "
    "Later the market opened, and the smell of salt, tar and fresh bread filled the narrow streets."
)


@pytest.fixture(scope="module")
def model(model_config):
    return load_model(model_config, CPU, torch.float32)


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 64
    return ids


def _runner(model, model_config, num_blocks=32) -> ModelRunner:
    kv = allocate_kv_cache(model_config, CacheConfig(block_size=BS, num_blocks=num_blocks), CPU)
    return ModelRunner(model, kv, BS)


def _req(rid: str, prompt: list[int], max_tokens: int = 4, logprobs: int = 0,
         sampling: SamplingOptions | None = None) -> Request:
    """A request (greedy unless ``sampling`` is given; a seeded one gets its generator)."""
    sampling = sampling or SamplingOptions(temperature=0.0, logprobs=logprobs)
    params = RequestParams(max_tokens=max_tokens, sampling=sampling, ignore_eos=True)
    gen = make_generator(sampling.seed, CPU) if sampling.seed is not None else None
    return Request(rid, list(prompt), params, transfer_id=f"xfer-{rid}", generator=gen)


def _no_leak(sched) -> None:
    assert sched.pool.num_free == sched.pool.num_usable


# ---- prefill ---------------------------------------------------------------------------

def _prefill_sched(model, model_config, budget=2048, num_blocks=32, max_num_seqs=64, prefix_caching=False,
                   layerwise=False):
    runner = _runner(model, model_config, num_blocks)
    sched = PrefillScheduler(runner, CacheConfig(block_size=BS, num_blocks=num_blocks,
                                                 enable_prefix_caching=prefix_caching),
                             SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
                             layerwise=layerwise)
    return runner, sched


def _pump(sched, done, timeout=20.0) -> None:
    """Step ``sched`` by hand until ``done()``; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "scheduler made no progress"
        sched.step()


# ---- decode ----------------------------------------------------------------------------

def _colocated(model, model_config, prompt: list[int], n: int, sampling: SamplingOptions | None = None):
    """Prefill + decode of ``n`` tokens on one runner (greedy unless ``sampling`` is
    given; a seeded one draws from its own generator): the prompt's KV
    ``[L, 2, blocks, BS, kh, d]`` and the ``n`` tokens a colocated engine produces."""
    runner = _runner(model, model_config)
    table = list(range(1, blocks_needed(len(prompt) + n, BS) + 1))
    opts = sampling or SamplingOptions(temperature=0.0)
    gen = make_generator(opts.seed, CPU) if opts.seed is not None else None
    prompt = list(prompt)
    toks: list[int] = []
    toks += runner.execute(StepPlan([ScheduledSeq("c", prompt, 0, table, True, opts, gen, prompt, toks)])).token_ids
    kv = runner.kv_cache[:, :, table[:blocks_needed(len(prompt), BS)]].clone()
    while len(toks) < n:
        pos = len(prompt) + len(toks) - 1
        toks += runner.execute(StepPlan([ScheduledSeq("c", [toks[-1]], pos, table, True, opts, gen,
                                                      prompt, toks)])).token_ids
    return kv, toks


def _decode_sched(model, model_config, num_blocks=32, lease_s=30.0, max_num_seqs=8, kv_failure_policy="error",
                  max_num_batched_tokens=2048, watermark=0.01):
    runner = _runner(model, model_config, num_blocks)
    sched = DecodeScheduler(runner, CacheConfig(block_size=BS, num_blocks=num_blocks),
                            SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=512, lease_s=lease_s,
                                            kv_failure_policy=kv_failure_policy,
                                            max_num_batched_tokens=max_num_batched_tokens, watermark=watermark),
                            model_config.eos_token_ids)
    return runner, sched


def _events(stream: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(stream.get_nowait())
        except queue.Empty:
            return out


def _reserve(sched, req: Request) -> tuple[queue.Queue, Reserved]:
    stream: queue.Queue = queue.Queue()
    sched.submit_reserve(req, stream)
    sched.step()
    ev = _events(stream)
    assert len(ev) == 1 and isinstance(ev[0], Reserved), ev
    return stream, ev[0]


def _deliver(sched, res: Reserved, kv: torch.Tensor, first_token: int) -> None:
    """What the KV receiver does: write the layers in two chunks, then report completion."""
    layers = kv.shape[0]
    mid = layers // 2
    sched.transfers.write(res.transfer_id, res.generation, 0, mid, res.block_ids, kv[:mid])
    sched.transfers.write(res.transfer_id, res.generation, mid, layers, res.block_ids, kv[mid:])
    sched.kv_complete(res.transfer_id, res.generation, first_token, None)


def _collect_tokens(sched, stream, timeout=20.0) -> list[Tokens]:
    out: list[Tokens] = []
    deadline = time.monotonic() + timeout
    while not out or out[-1].finish_reason is None:
        assert time.monotonic() < deadline, "decode made no progress"
        sched.step()
        for ev in _events(stream):
            assert isinstance(ev, Tokens), ev
            out.append(ev)
    return out


def _no_decode_leak(sched) -> None:
    assert sched.kv.num_free == sched.kv.num_usable
    assert sched.kv.num_in_transfer == 0
    assert len(sched.transfers) == 0

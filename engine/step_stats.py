"""Timing of one engine step, reported to whoever watches the worker (metrics, logs).

A scheduler runs each step through :func:`execute_timed`; the worker passes an
``on_step`` callback (its Prometheus metrics) and at DEBUG level one line per step is
logged, e.g. ``prefill step: 3 seqs, 412 tokens, 180.2 ms`` / ``decode step: batch 17, 48.3 ms``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.model_runner import ModelRunner
from engine.step import StepOutput, StepPlan

log = logging.getLogger("engine.step")


@dataclass(frozen=True)
class StepStats:
    """One executed step.

    Attributes:
        kind: ``"prefill"`` or ``"decode"`` (the scheduler that ran it).
        num_seqs: sequences in the step (the decode batch size).
        num_tokens: tokens computed (prompt chunks + one per decoding sequence).
        seconds: wall time of the model step (forward, LM head, sampling).
    """

    kind: str
    num_seqs: int
    num_tokens: int
    seconds: float


StepObserver = Callable[[StepStats], None]


def execute_timed(runner: ModelRunner, plan: StepPlan, kind: str,
                  on_step: StepObserver | None) -> tuple[StepOutput, StepStats]:
    """``runner.execute(plan)``, timed; ``on_step`` gets the :class:`StepStats` of a step that ran.

    Raises:
        whatever ``runner.execute`` raises (the step is then not reported).
    """
    t0 = time.perf_counter()
    out = runner.execute(plan)
    stats = StepStats(kind, len(plan.seqs), sum(len(s.token_ids) for s in plan.seqs), time.perf_counter() - t0)
    if kind == "decode":
        log.debug("decode step: batch %d, %.1f ms", stats.num_seqs, stats.seconds * 1e3)
    else:
        log.debug("prefill step: %d seqs, %d tokens, %.1f ms", stats.num_seqs, stats.num_tokens, stats.seconds * 1e3)
    if on_step is not None:
        on_step(stats)
    return out, stats

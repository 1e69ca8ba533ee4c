"""Turn a workload description into a bounded plan of requests (arrival time + lengths).

Sources (:data:`SOURCES`):

* a trace (``azure-conv``, ``azure-code``, ``mooncake-conv``, ``mooncake-synthetic``):
  arrival times and token counts from ``loadtest/data``; rows ``skip .. skip+num_requests``.
  ``rate`` rescales the slice's arrival times to that mean rate (req/s, keeping the burst
  pattern); otherwise ``time_scale`` multiplies them (0.1 = ten times faster). Mooncake
  timestamps are bucketed to ~3 s; ties are spread evenly (:func:`traces.spread_ties`).
  Mooncake blocks are ``512 * block_scale`` tokens, and each row's input length is scaled
  block by block so ``len(hash_ids) == ceil(input / block)`` still holds.
* ``synthetic``: Poisson (``arrival="poisson"``) or gamma arrivals at ``rate`` req/s; the
  gamma shape is ``burstiness`` (1 = Poisson, < 1 burstier), as in vLLM's benchmarks/serve.py.
  Lengths are ``input_len`` / ``output_len``, drawn uniformly within ``±len_range`` of them,
  or sampled (with replacement) from the rows of the trace ``lengths_from``.

Lengths are then clipped to ``max_input_tokens`` / ``max_output_tokens`` and fitted so that
input + output <= the server's ``max_model_len`` (input first); :class:`ClipReport` counts
what was cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtest.traces import MOONCAKE_BLOCK_TOKENS, TRACE_FILES, TraceRow, load_trace, spread_ties

SOURCES = (*TRACE_FILES, "synthetic")
ARRIVALS = ("poisson", "gamma")
MAX_REQUESTS = 100_000


class WorkloadError(ValueError):
    """An invalid workload configuration."""


@dataclass(frozen=True)
class WorkloadConfig:
    """What to send. Times in seconds, rates in req/s, lengths in tokens.

    Raises:
        WorkloadError: from ``__post_init__`` on an invalid combination or value.
    """

    source: str = "azure-conv"
    num_requests: int = 100
    skip: int = 0
    time_scale: float = 1.0
    rate: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    input_len: int = 128
    output_len: int = 32
    len_range: float = 0.0
    lengths_from: str | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    block_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise WorkloadError(msg)

        need(self.source in SOURCES, f"source {self.source!r} not in {SOURCES}")
        need(1 <= self.num_requests <= MAX_REQUESTS, f"num_requests must be in [1, {MAX_REQUESTS}]")
        need(self.skip >= 0, "skip must be >= 0")
        need(self.time_scale > 0, "time_scale must be > 0")
        need(self.rate is None or self.rate > 0, "rate must be > 0 (req/s)")
        need(self.arrival in ARRIVALS, f"arrival {self.arrival!r} not in {ARRIVALS}")
        need(self.burstiness > 0, "burstiness must be > 0")
        need(self.input_len >= 1 and self.output_len >= 1, "input_len and output_len must be >= 1")
        need(0 <= self.len_range < 1, "len_range must be in [0, 1)")
        need(self.lengths_from is None or self.lengths_from in TRACE_FILES,
             f"lengths_from must be one of {tuple(TRACE_FILES)}")
        need(self.max_input_tokens is None or self.max_input_tokens >= 1, "max_input_tokens must be >= 1")
        need(self.max_output_tokens is None or self.max_output_tokens >= 1, "max_output_tokens must be >= 1")
        need(0 < self.block_scale <= 1, "block_scale must be in (0, 1]")
        is_trace = self.source != "synthetic"
        need(not (is_trace and self.rate is not None and self.time_scale != 1.0),
             "give either rate or time_scale for a trace, not both")
        need(is_trace or self.time_scale == 1.0, "time_scale applies to traces only; use rate for synthetic")
        need(is_trace or self.arrival == "gamma" or self.burstiness == 1.0, "burstiness needs arrival='gamma'")
        need(self.source.startswith("mooncake") or self.block_scale == 1.0, "block_scale applies to mooncake traces")


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send: ``arrival_s`` seconds after the run starts, ``input_tokens``
    prompt tokens, ``output_tokens`` generated tokens (sent as ``max_tokens`` with
    ``ignore_eos``). ``hash_ids`` / ``block_tokens`` give Mooncake prefix blocks."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


@dataclass
class ClipReport:
    """What clipping removed (token counts are totals over the plan)."""

    inputs_clipped: int = 0
    outputs_clipped: int = 0
    input_tokens_removed: int = 0
    output_tokens_removed: int = 0
    fitted_to_max_model_len: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"inputs_clipped": self.inputs_clipped, "outputs_clipped": self.outputs_clipped,
                "input_tokens_removed": self.input_tokens_removed,
                "output_tokens_removed": self.output_tokens_removed,
                "fitted_to_max_model_len": self.fitted_to_max_model_len}


def _scaled_input(row: TraceRow, block: int, scale: float) -> int:
    n = len(row.hash_ids or ())
    if n == 0 or scale == 1.0:
        return row.input_tokens
    tail = row.input_tokens - (n - 1) * MOONCAKE_BLOCK_TOKENS
    return (n - 1) * block + min(block, max(1, round(tail * scale)))


def _trace_rows(cfg: WorkloadConfig, traces_dir: Path | str | None) -> tuple[list[float], list[TraceRow]]:
    rows = load_trace(cfg.source, traces_dir)
    times = [r.arrival_s for r in rows]
    if cfg.source.startswith("mooncake"):
        times = spread_ties(times)
    end = cfg.skip + cfg.num_requests
    if end > len(rows):
        raise WorkloadError(f"{cfg.source} has {len(rows)} rows; skip + num_requests = {end}")
    t = np.asarray(times[cfg.skip:end]) - times[cfg.skip]
    span = float(t[-1])
    if cfg.rate is not None and span > 0:
        t = t * ((len(t) - 1) / span) / cfg.rate
    elif cfg.rate is not None:  # one request, or all at once: keep them together
        t = t * 0.0
    return list(t * cfg.time_scale), rows[cfg.skip:end]


def _synthetic(cfg: WorkloadConfig, traces_dir: Path | str | None) -> tuple[list[float], list[tuple[int, int]]]:
    rng = np.random.default_rng(cfg.seed)
    n, rate = cfg.num_requests, cfg.rate or 1.0
    shape = cfg.burstiness if cfg.arrival == "gamma" else 1.0
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    times = list(np.concatenate([[0.0], np.cumsum(gaps)]))
    if cfg.lengths_from:
        rows = load_trace(cfg.lengths_from, traces_dir)
        picks = rng.integers(0, len(rows), size=n)
        return times, [(rows[i].input_tokens, rows[i].output_tokens) for i in picks]

    def draw(mean: int) -> np.ndarray:
        lo, hi = max(1, math.floor(mean * (1 - cfg.len_range))), max(1, math.ceil(mean * (1 + cfg.len_range)))
        return rng.integers(lo, hi + 1, size=n)

    return times, list(zip(draw(cfg.input_len).tolist(), draw(cfg.output_len).tolist()))


def clip_lengths(n_in: int, n_out: int, cfg: WorkloadConfig, max_model_len: int | None,
                 report: ClipReport) -> tuple[int, int]:
    """Clip one request's lengths (tokens) and count the cuts in ``report``."""
    new_in = min(n_in, cfg.max_input_tokens or n_in)
    new_out = min(n_out, cfg.max_output_tokens or n_out)
    if max_model_len is not None and new_in + new_out > max_model_len:
        report.fitted_to_max_model_len += 1
        new_in = max(1, min(new_in, max_model_len - new_out))
        new_out = max(1, min(new_out, max_model_len - new_in))
    if new_in < n_in:
        report.inputs_clipped += 1
        report.input_tokens_removed += n_in - new_in
    if new_out < n_out:
        report.outputs_clipped += 1
        report.output_tokens_removed += n_out - new_out
    return new_in, new_out


def build_plan(cfg: WorkloadConfig, traces_dir: Path | str | None = None,
               max_model_len: int | None = None) -> tuple[list[PlannedRequest], ClipReport]:
    """The requests of ``cfg`` in arrival order, clipped, and what clipping removed.

    ``max_model_len`` (tokens) is the server's limit on prompt + output.

    Raises:
        WorkloadError: the trace slice is out of range, or ``max_model_len`` < 2.
        FileNotFoundError, ValueError: the trace cannot be read (see :mod:`traces`).
    """
    if max_model_len is not None and max_model_len < 2:
        raise WorkloadError("max_model_len must be >= 2 (one prompt token and one output token)")
    report = ClipReport()
    plan: list[PlannedRequest] = []
    if cfg.source == "synthetic":
        times, lengths = _synthetic(cfg, traces_dir)
        for i, (t, (n_in, n_out)) in enumerate(zip(times, lengths)):
            n_in, n_out = clip_lengths(n_in, n_out, cfg, max_model_len, report)
            plan.append(PlannedRequest(i, float(t), n_in, n_out))
        return plan, report
    times, rows = _trace_rows(cfg, traces_dir)
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * cfg.block_scale))
    if cfg.block_scale != 1.0:
        report.notes.append(f"mooncake blocks scaled to {block} tokens (x{cfg.block_scale})")
    for i, (t, row) in enumerate(zip(times, rows)):
        n_in, n_out = clip_lengths(_scaled_input(row, block, cfg.block_scale), row.output_tokens, cfg,
                                   max_model_len, report)
        plan.append(PlannedRequest(i, float(t), n_in, n_out, row.hash_ids, block))
    return plan, report

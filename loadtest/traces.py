"""Parsers of the public request traces shipped in ``loadtest/data`` (read-only).

Each parser returns :class:`TraceRow` objects in file order, with arrival times in
seconds relative to the first row. File formats and statistics are described in
``loadtest/data/README.md``:

* Azure LLM inference trace 2023 (Splitwise, ISCA'24), ``azure2023/*.csv``: columns
  ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``, 100 ns resolution), ``ContextTokens``,
  ``GeneratedTokens``.
* Mooncake FAST'25, ``mooncake_fast25/*.jsonl[.gz]``: ``timestamp`` (milliseconds),
  ``input_length``, ``output_length``, ``hash_ids`` (chained prefix-block hashes,
  :data:`MOONCAKE_BLOCK_TOKENS` tokens per block).
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces (FAST'25 release README)."""

TRACE_FILES = {
    "azure-conv": "azure2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure2023/AzureLLMInferenceTrace_code.csv",
    "mooncake-conv": "mooncake_fast25/conversation_trace.jsonl.gz",
    "mooncake-synthetic": "mooncake_fast25/synthetic_trace.jsonl",
}
"""Trace name -> path relative to the traces directory."""


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace.

    ``arrival_s`` is seconds after the trace's first row; ``input_tokens`` and
    ``output_tokens`` are the trace's token counts; ``hash_ids`` are the Mooncake
    prefix-block hashes (``None`` for traces without prefix information).
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None


def default_traces_dir() -> Path:
    """``loadtest/data``: the traces and prompt sets shipped with pdcluster (sources,
    licenses and statistics in its ``README.md``)."""
    return Path(__file__).resolve().parent / "data"


def trace_path(name: str, traces_dir: Path | str | None = None) -> Path:
    """Path of the trace ``name`` (a key of :data:`TRACE_FILES`).

    Raises:
        ValueError: unknown trace name.
        FileNotFoundError: the file is not in ``traces_dir``.
    """
    if name not in TRACE_FILES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACE_FILES)}")
    path = Path(traces_dir or default_traces_dir()) / TRACE_FILES[name]
    if not path.is_file():
        raise FileNotFoundError(f"trace {name!r} not found at {path} (set --traces-dir)")
    return path


def _azure_time(stamp: str) -> dt.datetime:
    base, _, frac = stamp.strip().partition(".")
    t = dt.datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
    return t + dt.timedelta(microseconds=int(frac.ljust(7, "0")[:7]) / 10) if frac else t


def load_azure(path: Path | str) -> list[TraceRow]:
    """Parse an Azure LLM inference trace 2023 CSV.

    Raises:
        ValueError: a row is malformed (bad timestamp or token count).
        FileNotFoundError: ``path`` does not exist.
    """
    rows: list[TraceRow] = []
    t0: dt.datetime | None = None
    with open(path, newline="") as f:
        for line, rec in enumerate(csv.DictReader(f), start=2):
            try:
                t = _azure_time(rec["TIMESTAMP"])
                n_in, n_out = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: malformed row {rec!r}: {exc}") from exc
            t0 = t0 or t
            rows.append(TraceRow((t - t0).total_seconds(), n_in, n_out))
    return rows


def load_mooncake(path: Path | str) -> list[TraceRow]:
    """Parse a Mooncake FAST'25 JSONL trace (gzip-compressed when it ends in ``.gz``).

    Raises:
        ValueError: a line is not a JSON object with the four expected fields.
        FileNotFoundError: ``path`` does not exist.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    rows: list[TraceRow] = []
    t0: float | None = None
    with opener(path, "rt") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                t_ms = float(rec["timestamp"])
                row = (int(rec["input_length"]), int(rec["output_length"]), tuple(int(h) for h in rec["hash_ids"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: malformed line: {exc}") from exc
            t0 = t_ms if t0 is None else t0
            rows.append(TraceRow((t_ms - t0) / 1000.0, *row))
    return rows


def load_trace(name: str, traces_dir: Path | str | None = None) -> list[TraceRow]:
    """Load the trace ``name`` (a key of :data:`TRACE_FILES`) from ``traces_dir``.

    Raises:
        ValueError, FileNotFoundError: see :func:`trace_path` and the parsers.
    """
    path = trace_path(name, traces_dir)
    return load_azure(path) if name.startswith("azure") else load_mooncake(path)


def spread_ties(times: list[float]) -> list[float]:
    """Spread requests sharing one arrival time evenly up to the next distinct time.

    The Mooncake conversation trace is bucketed to about 3 s (up to 28 requests per
    timestamp); this turns each bucket into evenly spaced arrivals. The last bucket
    uses the mean spacing of distinct times. ``times`` must be sorted (seconds).
    """
    distinct = sorted(set(times))
    if len(distinct) < 2:
        return list(times)
    mean_gap = (distinct[-1] - distinct[0]) / (len(distinct) - 1)
    nxt = {a: b for a, b in zip(distinct, distinct[1:])}
    count: dict[float, int] = {}
    for t in times:
        count[t] = count.get(t, 0) + 1
    seen: dict[float, int] = {}
    out = []
    for t in times:
        k = seen.get(t, 0)
        seen[t] = k + 1
        out.append(t + (nxt.get(t, t + mean_gap) - t) * k / count[t])
    return out

"""One logging set-up for every pdcluster process (CLI, router, workers), and request ids on log lines.

``configure_logging("json", "INFO")`` makes every line one JSON object
(``ts``, ``level``, ``logger``, ``msg``, ``request_id`` when known, ``process``); ``"text"`` is
``time level logger [request_id] message``. The request id comes from a context variable
that the servers set per RPC (:func:`request_scope`, from the ``x-request-id`` gRPC metadata
the router sends with every worker call), or from ``extra={"request_id": ...}`` on lines
a scheduler thread logs about one request.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
REQUEST_ID_METADATA = "x-request-id"

@dataclass(frozen=True)
class LogConfig:
    """How a process logs (``pdcluster up --log-format / --log-level``).

    Raises:
        ValueError: ``format`` not in :data:`LOG_FORMATS` or ``level`` not in :data:`LOG_LEVELS`.
    """

    format: str = "text"
    level: str = "INFO"

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {LOG_FORMATS}, got {self.format!r}")
        if self.level.upper() not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {LOG_LEVELS}, got {self.level!r}")

    def apply(self) -> None:
        """Configure this process' logging (:func:`configure_logging`)."""
        configure_logging(self.format, self.level)


_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdcluster_request_id", default="")


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Lines logged inside carry ``request_id`` (one RPC handler's thread / task)."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


class ThrottledLog:
    """One kind of event logged one line at a time, at most one line per ``period_s``: under a
    storm (a burst of refusals) the first event is logged whole, the ones after it within the
    period are counted, and one line at the period's end says how many were left out (with the
    last one's request id). (Writing every line of a 500-request burst took the router's GIL and
    its log pipe for longer than refusing the requests did.)

    Args:
        logger: where the lines go (INFO).
        what: names the events in the summary line (e.g. ``"requests refused (queue_full)"``).
        period_s: at most one line per this many seconds, plus one summary (seconds, > 0).

    Raises:
        ValueError: a non-positive ``period_s``.
    """

    def __init__(self, logger: logging.Logger, what: str, period_s: float = 1.0) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self._log, self._what, self._period_s = logger, what, period_s
        self._lock = threading.Lock()
        self._quiet_until = float("-inf")
        self._left_out = 0
        self._last_id = ""

    def info(self, request_id: str, msg: str, *args) -> None:
        """Log ``msg % args`` for request ``request_id``, or count it while the period's line is out."""
        now = time.monotonic()
        with self._lock:
            if now < self._quiet_until:
                self._left_out += 1
                self._last_id = request_id
                if self._left_out == 1:  # report the period's leftovers once it is over
                    timer = threading.Timer(self._quiet_until - now, self._summarize)
                    timer.daemon = True
                    timer.start()
                return
            self._quiet_until = now + self._period_s
        self._log.info(msg, *args, extra={"request_id": request_id})

    def _summarize(self) -> None:
        with self._lock:
            left_out, last_id, self._left_out = self._left_out, self._last_id, 0
            self._quiet_until = time.monotonic() + self._period_s
        if left_out:
            self._log.info("%d more %s in the last %.1f s, not logged one by one (the last one's id on this line)",
                           left_out, self._what, self._period_s, extra={"request_id": last_id})


def request_id_from_metadata(context) -> str:
    """The ``x-request-id`` of a gRPC call's invocation metadata (``""`` when absent)."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA:
            return value
    return ""


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = _request_id.get()
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage(), "process": os.getpid()}
        if record.request_id:
            doc["request_id"] = record.request_id
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s %(message)s")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        record.rid = f" [{record.request_id}]" if record.request_id else ""
        return super().format(record)


def configure_logging(fmt: str = "text", level: str = "INFO") -> None:
    """Set the root logger of this process: one stderr handler in ``fmt``, at ``level``.

    Idempotent (a second call replaces the handler).

    Raises:
        ValueError: ``fmt`` not in :data:`LOG_FORMATS` or ``level`` not in :data:`LOG_LEVELS`.
    """
    cfg = LogConfig(fmt, level)  # the one check of both values
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_pdcluster", False):
            root.removeHandler(h)
    handler = logging.StreamHandler()
    handler._pdcluster = True  # type: ignore[attr-defined]
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(_JsonFormatter() if cfg.format == "json" else _TextFormatter())
    root.addHandler(handler)
    root.setLevel(cfg.level.upper())

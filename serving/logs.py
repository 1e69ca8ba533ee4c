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

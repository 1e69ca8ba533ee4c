"""A scheduler's inbox: thread-safe message queue with an optional shared wake-up event.

gRPC handlers and sender threads post messages; only the scheduler's loop drains
them. Several schedulers driven by one loop (a colocated worker) share one
``wake`` event so the loop sleeps until any of them has mail.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class Inbox:
    def __init__(self, wake: threading.Event | None = None) -> None:
        self._q: "queue.Queue[object]" = queue.Queue()
        self.wake = wake

    def put(self, msg: object) -> None:
        self._q.put(msg)
        if self.wake is not None:
            self.wake.set()

    def drain(self, block: bool, timeout_s: float = 0.05) -> list[object]:
        """All queued messages; with ``block``, waits up to ``timeout_s`` seconds for the first."""
        out: list[object] = []
        try:
            out.append(self._q.get(timeout=timeout_s) if block else self._q.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out


def run_steps(stop: threading.Event, step: Callable[[], object]) -> None:
    """Call ``step()`` until ``stop`` is set. A raising step is logged and the loop goes
    on (a scheduler bug must never kill a worker's only loop thread); model failures
    are already handled inside the step by failing its batch."""
    while not stop.is_set():
        try:
            step()
        except Exception:  # noqa: BLE001 - keep the loop alive
            log.exception("scheduler step raised; continuing")
            time.sleep(0.01)

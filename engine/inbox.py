"""A scheduler's inbox: thread-safe message queue with an optional shared wake-up event.

gRPC handlers and sender threads post messages; only the scheduler's loop drains
them. Several schedulers driven by one loop (a colocated worker) share one
``wake`` event so the loop sleeps until any of them has mail.
"""

from __future__ import annotations

import queue
import threading


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

"""Watching the Ray head while ``up`` starts a cluster.

Why: a Ray call on a head that died does not return. The driver's GCS client retries for 60 s
(``gcs_rpc_server_reconnect_timeout_s``), then Ray ends the process from C++ ("Failed to connect to
GCS within 60 seconds ... The program will terminate"): no ``finally`` runs, so a Redis ``up`` had
started was left running with no state file for ``down`` to find it by (seen: the GCS killed while
``up`` placed the workers). A :class:`HeadWatch` notices the head's end within a second or two, from
a thread of its own (the main thread may be inside such a call), and hands it to a callback that
stops what needs no Ray and ends the process itself. Its probe is any ``() -> bool``: the head
process alive (:func:`deploy.redis_control.pid_alive`), or its address answering
(:func:`deploy.ray_env.ray_answers`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class HeadWatch:
    """Calls ``on_lost`` once, from its own thread, when ``alive`` has answered False ``misses``
    times in a row (probed every ``period_s`` seconds), unless :meth:`stop` came first. Use it as a
    context manager around the work that needs the head.

    ``on_lost`` is meant to end the process (``os._exit``): the main thread may be blocked in Ray.
    :meth:`stop` waits for an ``on_lost`` already running, so the two never both clean up.
    """

    def __init__(self, alive: Callable[[], bool], on_lost: Callable[[], None], period_s: float = 0.5,
                 misses: int = 1) -> None:
        if period_s <= 0 or misses < 1:
            raise ValueError(f"period_s must be > 0 and misses >= 1, got {period_s} and {misses}")
        self._alive, self._on_lost = alive, on_lost
        self._period_s, self._misses = period_s, misses
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ray-head-watch", daemon=True)

    def start(self) -> HeadWatch:
        """Start watching; returns self."""
        self._thread.start()
        return self

    def __enter__(self) -> HeadWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop watching (idempotent); returns once no ``on_lost`` runs."""
        with self._lock:
            self._stopped.set()

    def _run(self) -> None:
        missed = 0
        while not self._stopped.wait(self._period_s):
            missed = 0 if self._alive() else missed + 1
            if missed >= self._misses:
                with self._lock:
                    if not self._stopped.is_set():
                        self._stopped.set()
                        self._on_lost()
                return

"""Fault injection on a local cluster: kill a random worker process every few seconds (and
the cluster's Redis once), as the chaos test and ``bench/soak.py`` do.

Targets are the live workers of the registry whose processes run on this machine (their
``pid``); a kill is ``SIGKILL``, nothing is asked to stop. At most one worker is down at a
time: a kill waits until every worker killed before is live again (its replacement
registered), so the cluster keeps a worker of each role while it heals. Every action is
recorded in :attr:`ChaosMonkey.events` (seconds since start, what, which pid).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from serving.registry import WorkerRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChaosConfig:
    """When to kill what (seconds).

    Attributes:
        kill_every_s: mean time between worker kills.
        jitter_s: each interval is ``kill_every_s`` ± up to this much, uniformly.
        redis_kill_at_s: when to kill Redis, after start (``None``: never).
        roles: roles whose workers may be killed.
        seed: seed of the choice of victims and intervals.

    Raises:
        ValueError: a non-positive interval or a jitter not below it.
    """

    kill_every_s: float = 10.0
    jitter_s: float = 3.0
    redis_kill_at_s: float | None = None
    roles: tuple[str, ...] = ("prefill", "decode")
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kill_every_s <= 0 or not 0 <= self.jitter_s < self.kill_every_s:
            raise ValueError(f"need kill_every_s > 0 and 0 <= jitter_s < kill_every_s, got "
                             f"{self.kill_every_s}, {self.jitter_s}")


class ChaosMonkey:
    """Kills workers of the cluster at ``redis_url`` / ``cluster`` on a thread (``with`` block)."""

    def __init__(self, redis_url: str, cluster: str, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.reg = WorkerRegistry(redis_url, cluster)
        self.events: list[dict] = []
        self._rng = random.Random(cfg.seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._t0 = 0.0
        self._expected: set[str] = set()

    def __enter__(self) -> "ChaosMonkey":
        self._t0 = time.monotonic()
        self._expected = set(self._live())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self.reg.close()

    def count(self, kind: str) -> int:
        """How many events of ``kind`` (``"kill_worker"`` / ``"kill_redis"``) happened."""
        return sum(e["kind"] == kind for e in self.events)

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _live(self) -> dict[str, int]:
        try:
            return {info.worker_id: info.pid for info, _ in self.reg.live_workers()
                    if info.role in self.cfg.roles and info.pid}
        except RedisError:
            return {}

    def _run(self) -> None:
        redis_due = self.cfg.redis_kill_at_s
        next_kill = self._interval()
        while not self._stop.wait(0.2):
            if redis_due is not None and self._now() >= redis_due:
                self._kill_redis()
                redis_due = None
            if self._now() < next_kill:
                continue
            live = self._live()
            if not self._expected <= set(live):
                continue  # a victim is not back yet: at most one worker down at a time
            victim = self._rng.choice(sorted(live))
            self._kill(victim, live[victim])
            next_kill = self._now() + self._interval()

    def _interval(self) -> float:
        return self.cfg.kill_every_s + self._rng.uniform(-self.cfg.jitter_s, self.cfg.jitter_s)

    def _kill(self, worker_id: str, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        log.warning("chaos: killed worker %s (pid %d)", worker_id, pid)
        self.events.append({"t_s": round(self._now(), 2), "kind": "kill_worker", "target": worker_id, "pid": pid})

    def _kill_redis(self) -> None:
        try:
            pid = self.reg.server_pid()
        except RedisError as e:
            log.warning("chaos: Redis not reachable to kill (%s)", e)
            return
        os.kill(pid, signal.SIGKILL)
        log.warning("chaos: killed Redis (pid %d)", pid)
        self.events.append({"t_s": round(self._now(), 2), "kind": "kill_redis", "target": "redis", "pid": pid})

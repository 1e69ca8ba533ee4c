"""What the cluster controller does about one worker: the decision rules, free of Ray and Redis.

Each period the controller (:mod:`deploy.controller`) compares the desired workers with the
live registry. A live worker needs nothing. A missing one is probed through its Ray actor
(:meth:`deploy.actors.WorkerActor.status`, which answers at once) and :func:`decide` turns
the probe and how long the worker has been missing into an :class:`Action`:

========================  =====================================================
probe                     action
========================  =====================================================
``DEAD`` (no actor)       ``RECREATE`` it in its placement-group bundle
``FAILED`` (start error)  ``RESTART`` (``ray.kill`` with restart), at most once per ``restart_backoff_s``
``LOADING``               wait; ``RESTART`` after ``start_timeout_s``
``SERVING`` (no beats)    ``RESTART`` after ``hung_after_s`` without a heartbeat
``UNRESPONSIVE``          same (a paused / hung process, or Ray still restarting it)
========================  =====================================================

The routers follow the same rules (a router is missing when its record in Redis expired;
:meth:`deploy.actors.RouterActor.status` answers with the same phases).

A crashed actor is restarted by Ray on its own (``max_restarts``); the controller covers
what Ray cannot see: a process that is alive but hung or paused, a start that failed, an
actor killed for good.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class HealConfig:
    """The controller's settings (seconds).

    Attributes:
        period_s: how often desired and live workers are compared (the heartbeat period).
        probe_timeout_s: how long a missing worker's actor may take to answer ``status``.
        hung_after_s: a worker missing from the registry this long, whose actor answers
            "serving" or does not answer, is killed and restarted.
        start_timeout_s: a worker still loading after this long is restarted.
        restart_backoff_s: least time between two restarts of one worker.
        redis_down_checks: consecutive failed health checks (PINGs, one per period) before a
            supervised Redis is killed (if its process still runs: hung) and restarted.
        redis_ping_timeout_s: how long one health check waits for PONG. A dead Redis fails
            at once, a hung one after this: with the defaults a hang is acted on 3 checks
            (~4.5 s) after it starts, and Redis is back within 10 s.

    Raises:
        ValueError: a non-positive value.
    """

    period_s: float = 1.0
    probe_timeout_s: float = 2.0
    hung_after_s: float = 20.0
    start_timeout_s: float = 300.0
    restart_backoff_s: float = 5.0
    redis_down_checks: int = 3
    redis_ping_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("period_s", "probe_timeout_s", "hung_after_s", "start_timeout_s", "restart_backoff_s",
                     "redis_down_checks", "redis_ping_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HealConfig.{name} must be positive, got {getattr(self, name)}")


class Probe(enum.Enum):
    """What a missing worker's actor said."""

    SERVING = "serving"
    LOADING = "loading"
    FAILED = "failed"
    UNRESPONSIVE = "unresponsive"
    DEAD = "dead"


class Action(enum.Enum):
    NONE = "none"
    RESTART = "restart"  # ray.kill(actor, no_restart=False): Ray starts it again
    RECREATE = "recreate"  # the actor is gone for good: create it again, same id and bundle


@dataclass
class WorkerWatch:
    """The controller's memory of one desired worker.

    Attributes:
        missing_since: when it was first seen missing from the registry (``None``: live).
        acted_at: when the controller last restarted or recreated it.
        restarts: restarts and recreations by the controller.
        reason: why it is missing now (``""`` when live), for ``pdcluster status``.
    """

    worker_id: str
    role: str
    missing_since: float | None = None
    acted_at: float = 0.0
    restarts: int = 0
    reason: str = ""

    def seen_live(self) -> None:
        self.missing_since = None
        self.reason = ""


def worker_restarts(entry: dict, watch: WorkerWatch | None) -> int:
    """How often the desired worker ``entry`` (a cluster state's worker: its ``generation`` now and
    ``first_generation``, the one it was placed with) was restarted: the processes that registered
    under its id since it was placed (Ray's own restarts after a crash included, which the
    controller never acts on), or the controller's restarts and recreations (``watch``) when more
    (one not registered yet)."""
    seen = entry.get("generation", 0) - entry.get("first_generation", entry.get("generation", 0))
    return max(seen, watch.restarts if watch else 0)


def decide(watch: WorkerWatch, probe: Probe, now: float, cfg: HealConfig, detail: str = "") -> Action:
    """The action for a worker missing from the registry; updates ``watch.reason``.

    Args:
        watch: the worker's record (``missing_since`` is set here on the first call).
        probe: what its actor answered.
        now: the current time (seconds, any monotonic clock).
        cfg: thresholds.
        detail: the probe's detail (a start error's last line), for the reason.
    """
    if watch.missing_since is None:
        watch.missing_since = now
    quiet = now - max(watch.missing_since, watch.acted_at)
    since_action = now - watch.acted_at
    if probe is Probe.DEAD:
        watch.reason = "actor dead: recreating it"
        return Action.RECREATE
    if probe is Probe.FAILED:
        watch.reason = f"failed to start: {detail}" if detail else "failed to start"
        return Action.RESTART if since_action >= cfg.restart_backoff_s else Action.NONE
    if probe is Probe.LOADING:
        watch.reason = f"loading (for {quiet:.0f}s)"
        return Action.RESTART if quiet >= cfg.start_timeout_s else Action.NONE
    what = "answers but sends no heartbeat" if probe is Probe.SERVING else "not answering (restarting or hung)"
    watch.reason = f"{what}, missing from the registry for {quiet:.0f}s"  # its record outlives the last beat
    return Action.RESTART if quiet >= cfg.hung_after_s and since_action >= cfg.restart_backoff_s else Action.NONE

"""Where a request runs: the policies by name, and the placement step.

:meth:`Placer.place` reads the registry view and asks the one configured policy for
each role the cluster has: a colocated cluster (colocated workers registered) gets
one worker doing both halves, so no KV crosses a process; otherwise a decode worker
and a prefill worker are chosen. Workers the registry view excludes (not live, or marked
unreachable) never reach the policy, nor do those the circuit breaker skips
(:mod:`router.breaker`). A migrating request (:mod:`router.migration`) avoids the
workers that failed it: the policy chooses among the others, and only a role whose
every usable worker is to be avoided gets one of those again (a transient transfer
failure, a worker restarted under its id).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from router.breaker import CircuitBreaker
from router.cache_aware import CacheAware
from router.policy import Candidate, LeastLoaded, NoWorkerError, Policy, RequestContext, RoundRobin, Signals
from router.policy_names import CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN, check_policy
from serving.discovery import RegistryView
from serving.registry import WorkerInfo

log = logging.getLogger(__name__)

POLICIES: dict[str, type[Policy]] = {CACHE_AWARE: CacheAware, LEAST_LOADED: LeastLoaded, ROUND_ROBIN: RoundRobin}


def make_policy(name: str, signals: Signals) -> Policy:
    """The registered policy ``name`` reading ``signals``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the names), or the
            policy needs a signal that ``signals`` lacks.
    """
    check_policy(name)
    return POLICIES[name](signals)


@dataclass(frozen=True)
class Placement:
    """The workers of one request (the same worker twice in a colocated cluster)."""

    prefill: WorkerInfo
    decode: WorkerInfo


class Placer:
    """The placement step: which workers serve a request.

    Args:
        view: live workers from the registry.
        policy: the worker choice, asked once per role.
        breaker: the circuit breaker whose open workers are skipped (``None``: none skipped).
    """

    def __init__(self, view: RegistryView, policy: Policy, breaker: CircuitBreaker | None = None) -> None:
        self.view = view
        self.policy = policy
        self.breaker = breaker

    def usable(self, candidates: list[Candidate]) -> list[Candidate]:
        """``candidates`` without those the circuit breaker skips now."""
        if self.breaker is None:
            return candidates
        return [c for c in candidates if self.breaker.allows(c[0].address, c[0].worker_id)]

    def place(self, request: RequestContext, avoid: frozenset[str] = frozenset()) -> Placement:
        """Choose the request's workers, other than the worker ids in ``avoid`` where the
        role has another usable one.

        Raises:
            router.policy.NoWorkerError: a role has no live, non-draining worker the circuit
                breaker lets through.
        """
        colocated = self.view.workers("colocated")
        if colocated:
            both = self._choose("colocated", colocated, request, avoid)
            return Placement(prefill=both, decode=both)
        decode = self._choose("decode", self.view.workers_now("decode"), request, avoid)
        prefill = self._choose("prefill", self.view.workers_now("prefill"), request, avoid)
        return Placement(prefill=prefill, decode=decode)

    def _choose(self, role: str, candidates: list[Candidate], request: RequestContext,
                avoid: frozenset[str]) -> WorkerInfo:
        usable = self.usable(candidates)
        if candidates and not usable:
            raise NoWorkerError(f"no live {role} worker: {len(candidates)} skipped by the circuit breaker "
                                f"(consecutive transport failures)")
        if avoid:
            others = [c for c in usable if c[0].worker_id not in avoid]
            if any(not load.draining for _, load in others):
                usable = others
            elif usable:
                log.info("request %s: every usable %s worker failed it before; trying one of them again",
                         request.request_id, role)
        choice = self.policy.choose(role, usable, request)
        log.debug("request %s: %s worker %s (%d prompt tokens expected cached)", request.request_id, role,
                  choice.worker.worker_id, choice.cached_tokens)
        return choice.worker

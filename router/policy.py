"""The worker-choice interface, and the ``least_loaded`` and ``round_robin`` policies.

The router asks a :class:`Policy` for one worker per role of a request the same
way for every policy and role (:meth:`Policy.choose`); the policy sees only the
candidates that take new requests (draining workers, being removed by ``pdcluster
scale``, finish what they have but take nothing new). ``cache_aware`` is in
:mod:`router.cache_aware`; :data:`router.placement.POLICIES` registers them by name.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

from router.load import LoadTracker
from serving.cache_index import CacheIndexView
from serving.registry import WorkerInfo, WorkerLoadSnapshot

Candidate = tuple[WorkerInfo, WorkerLoadSnapshot]


class NoWorkerError(RuntimeError):
    """No live, non-draining worker of the asked role."""


@dataclass(frozen=True)
class RequestContext:
    """What a policy may know of the request it places.

    Attributes:
        request_id: the client's request id.
        prompt_token_ids: the tokens to prefill: the tokenized prompt, followed by the
            output tokens already generated when a migrating request is placed again.
    """

    request_id: str
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class Choice:
    """A policy's answer.

    Attributes:
        worker: the chosen worker.
        cached_tokens: prompt tokens the policy expects the worker to find in its prefix
            cache (0 where the policy does not look at caches).
    """

    worker: WorkerInfo
    cached_tokens: int = 0


@dataclass(frozen=True)
class Signals:
    """What a policy reads besides the candidates' heartbeats.

    Attributes:
        load: the router's own per-worker load.
        cache_index: the prefill workers' published prefix caches (given when the
            policy's ``needs_cache_index``).
    """

    load: LoadTracker
    cache_index: CacheIndexView | None = None


class Policy(ABC):
    """Chooses a worker of a role (``prefill``, ``decode`` or ``colocated``) for a request.

    Attributes:
        needs_cache_index: the policy reads ``Signals.cache_index``.
    """

    needs_cache_index: ClassVar[bool] = False

    def __init__(self, signals: Signals) -> None:
        self.signals = signals

    def choose(self, role: str, candidates: list[Candidate], request: RequestContext) -> Choice:
        """One of the non-draining ``candidates`` (live workers of ``role``) for ``request``.

        Raises:
            NoWorkerError: none takes new requests (the message counts the draining ones).
        """
        usable = [c for c in candidates if not c[1].draining]
        if not usable:
            draining = f" ({len(candidates)} draining)" if candidates else ""
            raise NoWorkerError(f"no live {role} worker{draining}")
        return self.pick(role, usable, request)

    @abstractmethod
    def pick(self, role: str, candidates: list[Candidate], request: RequestContext) -> Choice:
        """The policy's rule over non-empty, non-draining ``candidates``."""


class LeastLoaded(Policy):
    """Fewest requests in flight (the router's count + the worker's queue), then most
    free KV blocks, then the lowest worker id."""

    def pick(self, role: str, candidates: list[Candidate], request: RequestContext) -> Choice:
        load = self.signals.load
        info, _ = min(candidates, key=lambda c: (load.in_flight(c[0].worker_id) + c[1].num_waiting,
                                                 -c[1].num_free_blocks, c[0].worker_id))
        return Choice(info)


class RoundRobin(Policy):
    """Each candidate in turn, in worker-id order, with one turn counter per role."""

    def __init__(self, signals: Signals) -> None:
        super().__init__(signals)
        self._turns: defaultdict[str, itertools.count] = defaultdict(itertools.count)

    def pick(self, role: str, candidates: list[Candidate], request: RequestContext) -> Choice:
        ordered = sorted(candidates, key=lambda c: c[0].worker_id)
        return Choice(ordered[next(self._turns[role]) % len(ordered)][0])

"""What a decode worker does when a reservation's KV will not arrive.

Three triggers close a transfer before its KV was delivered (the decode scheduler
detects them and closes the transfer):

* the KV receiver reports it failed (corrupt chunk, incomplete stream): ``kv_failed``;
* its lease expires (the prefill worker went silent);
* the router reports that the prefill side failed (``DecodeWorker.FailTransfer``).

Each one hands the request to the :class:`KvFailurePolicy` named by
``SchedulerConfig.kv_failure_policy`` (:data:`KV_FAILURE_POLICY_REGISTRY`):

* ``"error"`` (:class:`ErrorPolicy`): the request ends with UNAVAILABLE and its
  blocks go back to the pool.
* ``"recompute"`` (:class:`RecomputePolicy`): the request keeps its reserved prompt
  blocks and is rebuilt here through the preemption-recompute path: ``prompt[:-1]``
  is computed without sampling, then a decode step feeding ``prompt[-1]`` at position
  ``len(prompt) - 1`` samples the first token. The first draw of a seeded request's
  generator then happens here (no draw is skipped, unlike a delivered transfer whose
  first token the prefill worker drew: :func:`engine.sampling.skip_draw`), so its
  token stream equals a normal run's.

A policy acts only through :class:`RecoveryActions` (the scheduler), which makes the
state transitions. Closing the transfer happens under the transfer table's lock, so a
chunk of the failed transfer that arrives later can never write into the (kept or
reused) blocks.
"""

from __future__ import annotations

import abc
import enum
from typing import ClassVar, Protocol

import grpc

from engine.request import Request, RequestStatus


class KvFailureOutcome(enum.Enum):
    """What became of a request whose prefill side was reported failed."""

    UNKNOWN_REQUEST = "unknown_request"  # not here (ended) or not waiting for that transfer
    FAILED = "failed"                    # policy "error": ended with UNAVAILABLE
    RECOMPUTING = "recomputing"          # its KV is (being) rebuilt here; decoding goes on
    KV_COMPLETE = "kv_complete"          # the KV had arrived already; decoding goes on


class RecoveryActions(Protocol):
    """The transitions a policy may ask for (implemented by the decode scheduler; called
    on its loop thread only)."""

    def fail_request(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        """End the request with ``code`` / ``message`` and free its blocks."""

    def recompute_request(self, request_id: str, why: str) -> None:
        """Keep the request's prompt blocks and rebuild its KV here, then decode on."""


class KvFailurePolicy(abc.ABC):
    """Decides the fate of a request whose transfer closed undelivered, and remembers
    which requests it had rebuilt here (to answer a later FailTransfer)."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._rebuilding: set[str] = set()

    @abc.abstractmethod
    def transfer_lost(self, request_id: str, why: str, actions: RecoveryActions) -> KvFailureOutcome:
        """Apply the policy to ``request_id``, whose transfer the scheduler has just
        closed undelivered; ``why`` says how it failed (for the client and the log).
        Returns :attr:`KvFailureOutcome.FAILED` or :attr:`KvFailureOutcome.RECOMPUTING`."""

    def is_rebuilding(self, request_id: str) -> bool:
        """Whether this policy had ``request_id`` rebuilt here (until :meth:`forget`)."""
        return request_id in self._rebuilding

    def forget(self, request_id: str) -> None:
        """The request ended (idempotent)."""
        self._rebuilding.discard(request_id)

    def fail_transfer_outcome(self, req: Request | None, transfer_id: str) -> KvFailureOutcome | None:
        """The answer to a FailTransfer report for ``transfer_id`` of request ``req``
        (``None``: not here), or ``None`` when the request still waits for that
        transfer's KV: then the scheduler closes it and calls :meth:`transfer_lost`."""
        if req is None or req.transfer_id != transfer_id or req.status == RequestStatus.WAITING:
            return KvFailureOutcome.UNKNOWN_REQUEST  # gone, another transfer, or no blocks offered yet
        if req.status == RequestStatus.TRANSFERRING:
            return None
        return KvFailureOutcome.RECOMPUTING if self.is_rebuilding(req.request_id) else KvFailureOutcome.KV_COMPLETE


class ErrorPolicy(KvFailurePolicy):
    """``"error"``: the request ends with UNAVAILABLE."""

    name = "error"

    def transfer_lost(self, request_id: str, why: str, actions: RecoveryActions) -> KvFailureOutcome:
        actions.fail_request(request_id, grpc.StatusCode.UNAVAILABLE, why)
        return KvFailureOutcome.FAILED


class RecomputePolicy(KvFailurePolicy):
    """``"recompute"``: the decode worker rebuilds the prompt's KV itself and goes on."""

    name = "recompute"

    def transfer_lost(self, request_id: str, why: str, actions: RecoveryActions) -> KvFailureOutcome:
        self._rebuilding.add(request_id)
        actions.recompute_request(request_id, why)
        return KvFailureOutcome.RECOMPUTING


KV_FAILURE_POLICY_REGISTRY: dict[str, type[KvFailurePolicy]] = {p.name: p for p in (ErrorPolicy, RecomputePolicy)}


def make_kv_failure_policy(name: str) -> KvFailurePolicy:
    """A fresh policy registered under ``name`` (``SchedulerConfig.kv_failure_policy``).

    Raises:
        ValueError: no policy has that name.
    """
    cls = KV_FAILURE_POLICY_REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown kv_failure_policy {name!r}; registered: {sorted(KV_FAILURE_POLICY_REGISTRY)}")
    return cls()

"""What a decode worker does when a reservation's KV will not arrive.

Three triggers close a transfer before its KV was delivered:

* the KV receiver reports it failed (corrupt chunk, incomplete stream): ``kv_failed``;
* its lease expires (the prefill worker went silent);
* the router reports that the prefill side failed (``DecodeWorker.FailTransfer``).

Each one applies ``SchedulerConfig.kv_failure_policy``:

* ``"error"``: the request ends with UNAVAILABLE and its blocks go back to the pool.
* ``"recompute"``: the request keeps its reserved prompt blocks and is rebuilt here
  through the preemption-recompute path: ``prompt[:-1]`` is computed without
  sampling, then a decode step feeding ``prompt[-1]`` at position
  ``len(prompt) - 1`` samples the first token. The first draw of a seeded request's
  generator then happens here (no draw is skipped, unlike a delivered transfer whose
  first token the prefill worker drew), so its token stream equals a normal run's.

Closing the transfer happens under the transfer table's lock, so a chunk of the
failed transfer that arrives later can never write into the (kept or reused) blocks.
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future

import grpc

from decode_worker.messages import FailTransferMsg
from decode_worker.transfers import OpenTransfer
from engine.request import RequestStatus

log = logging.getLogger(__name__)


class KvFailureOutcome(enum.Enum):
    """What became of a request whose prefill side was reported failed."""

    UNKNOWN_REQUEST = "unknown_request"  # not here (ended) or not waiting for that transfer
    FAILED = "failed"                    # policy "error": ended with UNAVAILABLE
    RECOMPUTING = "recomputing"          # its KV is (being) rebuilt here; decoding goes on
    KV_COMPLETE = "kv_complete"          # the KV had arrived already; decoding goes on


class KvRecoveryMixin:
    """The decode scheduler's handling of failed transfers (see the module docstring).

    Mixed into :class:`decode_worker.scheduler.DecodeScheduler`, whose state it uses:
    ``sched`` (the config), ``transfers``, ``_requests``, ``_ready``, ``_inbox``,
    ``_finish_error``; it owns ``num_failed_transfers``, ``num_kv_recomputes`` and
    ``_recovered`` (ids of requests rebuilt here, forgotten in ``_release``).
    """

    def _init_recovery(self) -> None:
        self.num_failed_transfers = 0
        self.num_kv_recomputes = 0
        self._recovered: set[str] = set()

    def submit_fail_transfer(self, request_id: str, transfer_id: str, reason: str) -> Future[KvFailureOutcome]:
        """The prefill side of ``transfer_id`` failed (thread-safe). The returned future
        resolves to a :class:`KvFailureOutcome` once the loop handled it."""
        reply: Future[KvFailureOutcome] = Future()
        self._inbox.put(FailTransferMsg(request_id, transfer_id, reason, reply))
        return reply

    # ---- the three triggers (loop thread) -----------------------------------------
    def _on_kv_failed(self, msg) -> None:
        t = self.transfers.close(msg.transfer_id, msg.generation)
        if t is not None:
            self._transfer_lost(t.request_id, f"KV transfer failed: {msg.reason}")

    def _expire_leases(self) -> None:
        for t in self.transfers.expired(time.monotonic()):
            self._transfer_lost(
                t.request_id,
                f"KV transfer lease expired after {self.sched.lease_s:.1f}s (prefill worker lost?)",
            )

    def _on_fail_transfer(self, msg: FailTransferMsg) -> None:
        outcome = self._fail_transfer_outcome(msg)
        log.info("prefill side of %s (transfer %s) failed (%s): %s", msg.request_id, msg.transfer_id,
                 msg.reason, outcome.value)
        msg.reply.set_result(outcome)

    def _fail_transfer_outcome(self, msg: FailTransferMsg) -> KvFailureOutcome:
        req = self._requests.get(msg.request_id)
        if req is None or req.transfer_id != msg.transfer_id:
            return KvFailureOutcome.UNKNOWN_REQUEST
        if req.status == RequestStatus.TRANSFERRING:
            t: OpenTransfer | None = self.transfers.close(req.transfer_id, None)
            if t is not None:
                return self._transfer_lost(req.request_id, f"KV transfer failed: prefill side failed: {msg.reason}")
        if req.status == RequestStatus.WAITING:
            return KvFailureOutcome.UNKNOWN_REQUEST  # no blocks were ever offered to the prefill side
        if msg.request_id in self._recovered:
            return KvFailureOutcome.RECOMPUTING
        return KvFailureOutcome.KV_COMPLETE

    # ---- the policy ----------------------------------------------------------------
    def _transfer_lost(self, request_id: str, why: str) -> KvFailureOutcome:
        """Apply the policy to a request whose transfer was just closed undelivered."""
        self.num_failed_transfers += 1
        if self.sched.kv_failure_policy != "recompute":
            self._finish_error(request_id, grpc.StatusCode.UNAVAILABLE, why)
            return KvFailureOutcome.FAILED
        req = self._requests[request_id]
        req.num_computed = 0
        req.status = RequestStatus.RECOMPUTING
        self._recovered.add(request_id)
        self._ready.append(request_id)  # joins the batch (recomputing) when a slot frees
        self.num_kv_recomputes += 1
        log.warning("%s; recomputing the %d-token prompt of %s here (%d recomputes so far)", why,
                    len(req.prompt_token_ids), request_id, self.num_kv_recomputes)
        return KvFailureOutcome.RECOMPUTING

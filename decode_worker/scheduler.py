"""Decode scheduler: the request state machine of a decode worker.

Lifecycle of a request (decode-led reservation, DESIGN.md); every transition happens
on the loop thread, in :meth:`DecodeScheduler.step`:

* ``reserve`` -> **WAITING** (``_pending``, FIFO): refused at once with
  INVALID_ARGUMENT if prompt + max_tokens could never fit the pool, or
  ALREADY_EXISTS for a live request id or transfer id.
* WAITING -> **TRANSFERRING**: the KV manager admits it (prompt blocks plus one
  token of growth fit above the watermark) and reserves its prompt blocks; a
  transfer lease opens and ``Reserved`` tells the prefill side where to write.
  No reservation is admitted while a preempted request waits to resume.
* TRANSFERRING -> ``_ready`` -> **RUNNING** (``_running``, admission order): the KV
  arrived with the first token (sampled by the prefill worker); it joins the batch
  when a slot (``max_num_seqs``) is free.
* TRANSFERRING -> (transfer lost: receiver failure, lease expiry, FailTransfer)
  -> the KV-failure policy (:mod:`decode_worker.kv_failure`): ended with
  UNAVAILABLE, or **RECOMPUTING** (``_ready``, then ``_recomputing``): its prompt
  KV is rebuilt here, in chunks under the token budget, then -> RUNNING.
* RUNNING -> **PREEMPTED** (``_preempted``, resumed first): a running request's
  newest token needs a block and the pool is empty; the KV manager picks the victim
  (the most recently admitted) and its blocks go back.
* PREEMPTED -> RECOMPUTING -> RUNNING: resumed when its tokens plus growth fit above
  the watermark; its KV (prompt + generated tokens but the newest) is recomputed
  (vLLM's recompute preemption).
* any -> **FINISHED**: stop / length, abort, a failed model step (INTERNAL) or a
  lost transfer under "error"; every block goes back and the request is forgotten.

A migrated request (``WorkerRequest.output_token_ids``) has its earlier outputs from
the start: its blocks, KV and rebuilds cover them, limits and stop checks count them,
and only new tokens are streamed.

Continuous batching: every step runs one token for every running request (plus
recompute chunks); arrivals join and finished requests leave between steps. Blocks
come only from :class:`decode_worker.kv_manager.DecodeKvManager`.

Thread model: gRPC handlers and the KV receiver call the ``submit_*`` methods and
the :class:`TransferTable` (both thread-safe); only :meth:`DecodeScheduler.step`
(the loop thread) changes request state or allocates blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future

import grpc

from decode_worker.events import DecodeEventT, Failed, Reserved, Tokens
from decode_worker.kv_failure import KvFailureOutcome, make_kv_failure_policy
from decode_worker.kv_manager import DecodeKvManager
from decode_worker.messages import AbortMsg, FailTransferMsg, KvDoneMsg, KvFailedMsg, ReserveMsg
from decode_worker.transfers import TransferTable
from engine.config import CacheConfig, SchedulerConfig
from engine.inbox import Inbox, run_steps
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.sampling import skip_draw
from engine.seqs import compute_seq, sampling_seq
from engine.step import ScheduledSeq, StepPlan, TokenLogprobs
from engine.step_stats import StepObserver, execute_timed
from engine.stop_check import check_finish
from kvtransfer.blocks import HeadShards

log = logging.getLogger(__name__)


class DecodeScheduler:
    """Continuous-batching decode over a paged KV cache.

    Args:
        runner: the stateless model runner (owns the KV cache tensor).
        cache: pool geometry (``num_blocks``, ``block_size``) of the KV manager.
        sched: limits (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
            ``lease_s``), the ``watermark`` and the ``kv_failure_policy`` name.
        eos_token_ids: the model's EOS ids.
        wake: event set whenever a message arrives (shared by schedulers on one loop).
        on_step: called with every executed step's :class:`engine.step_stats.StepStats`.

    Raises:
        ValueError: ``sched.kv_failure_policy`` names no registered policy.
    """

    def __init__(self, runner: ModelRunner, cache: CacheConfig, sched: SchedulerConfig,
                 eos_token_ids: tuple[int, ...], wake: threading.Event | None = None,
                 on_step: StepObserver | None = None) -> None:
        self.runner, self.on_step = runner, on_step
        self.sched, self.eos = sched, eos_token_ids
        self.kv = DecodeKvManager(cache, sched.watermark)
        self.kv_failure = make_kv_failure_policy(sched.kv_failure_policy)
        self.transfers = TransferTable(HeadShards.of(runner.kv_parts))  # every tensor-parallel rank's heads
        self._inbox = Inbox(wake)
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._requests: dict[str, Request] = {}
        self._pending: deque[str] = deque()     # waiting for blocks
        self._ready: deque[str] = deque()       # KV arrived (or to rebuild), waiting for a batch slot
        self._running: list[str] = []           # decoding, in admission order
        self._preempted: deque[str] = deque()   # blocks taken back, resume first
        self._recomputing: list[str] = []       # rebuilding KV (preempted, or its transfer failed)
        self.num_preemptions = self.num_finished = self.step_count = 0
        self.num_failed_transfers = self.num_kv_recomputes = 0

    # ---- called from other threads -------------------------------------------------
    def submit_reserve(self, request: Request, stream: queue.SimpleQueue[DecodeEventT]) -> None:
        self._inbox.put(ReserveMsg(request, stream))

    def submit_abort(self, request_id: str, transfer_id: str | None = None,
                     stream: queue.SimpleQueue[DecodeEventT] | None = None) -> None:
        """End ``request_id`` (no-op if unknown); ``transfer_id`` / ``stream`` narrow it (:class:`AbortMsg`)."""
        self._inbox.put(AbortMsg(request_id, transfer_id, stream))

    def kv_complete(self, transfer_id: str, generation: int, first_token_id: int,
                    first_logprobs: TokenLogprobs | None) -> None:
        self._inbox.put(KvDoneMsg(transfer_id, generation, first_token_id, first_logprobs))

    def kv_failed(self, transfer_id: str, generation: int, reason: str) -> None:
        self._inbox.put(KvFailedMsg(transfer_id, generation, reason))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def load(self) -> dict:
        """Counters for heartbeats, GetLoad, metrics (racy int reads): running = in the batch, as vLLM's;
        waiting = every other request held (for blocks, its KV or a seat, or preempted)."""
        running = self._num_scheduled()
        return {"num_waiting": max(0, len(self._requests) - running), "num_running": running,
            "num_free_blocks": self.kv.num_free,
            "num_total_blocks": self.kv.num_usable,
            "num_finished": self.num_finished,
            "num_failed_transfers": self.num_failed_transfers,
            "num_preemptions": self.num_preemptions,
            "num_kv_recomputes": self.num_kv_recomputes,
        }

    # ---- the loop ------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set; a failing model step fails its batch, never the loop."""
        run_steps(stop, self.step)

    def step(self, block: bool = True) -> bool:
        """One scheduling round; returns whether a model step ran (``block``: idle waits <= 50 ms for mail)."""
        busy = bool(self._running or self._recomputing)
        for msg in self._inbox.drain(block=block and not busy):
            self._handle(msg)
        self._expire_leases()
        self._resume_preempted()
        self._admit_pending()
        while self._ready and self._num_scheduled() < self.sched.max_num_seqs:
            self._schedule_ready(self._ready.popleft())
        if not (self._running or self._recomputing):
            return False
        self._model_step()
        return True

    def _schedule_ready(self, request_id: str) -> None:
        """Into the batch: decoding, or first rebuilding KV it does not have (a failed
        transfer under the "recompute" policy)."""
        req = self._requests[request_id]
        if req.num_computed < req.num_tokens - 1:
            self._recomputing.append(request_id)
        else:
            req.status = RequestStatus.RUNNING
            self._running.append(request_id)

    def _num_scheduled(self) -> int:
        return len(self._running) + len(self._recomputing)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, ReserveMsg):
            self._on_reserve(msg)
        elif isinstance(msg, KvDoneMsg):
            self._on_kv_done(msg)
        elif isinstance(msg, KvFailedMsg):
            self._on_kv_failed(msg)
        elif isinstance(msg, AbortMsg):
            self._on_abort(msg)
        elif isinstance(msg, FailTransferMsg):
            self._on_fail_transfer(msg)

    def _on_reserve(self, msg: ReserveMsg) -> None:
        req = msg.request
        if req.request_id in self._requests:
            msg.stream.put(Failed(grpc.StatusCode.ALREADY_EXISTS, f"request {req.request_id} is running"))
            return
        if req.transfer_id and any(r.transfer_id == req.transfer_id for r in self._requests.values()):
            msg.stream.put(Failed(grpc.StatusCode.ALREADY_EXISTS, f"transfer {req.transfer_id} is in use"))
            return
        need = req.max_blocks(self.kv.block_size)
        if need > self.kv.num_usable:
            msg.stream.put(Failed(grpc.StatusCode.INVALID_ARGUMENT, f"prompt ({len(req.prompt_token_ids)} "
                                  f"tokens) + max_tokens ({req.params.max_tokens}) needs {need} KV blocks, more than "
                                  f"the decode worker's whole KV pool ({self.kv.num_usable} blocks): lower max_tokens"))
            return
        self._requests[req.request_id] = req
        self._streams[req.request_id] = msg.stream
        self._pending.append(req.request_id)

    def _admit_pending(self) -> None:
        while self._pending and not self._preempted:
            req = self._requests[self._pending[0]]
            if not self.kv.can_allocate(req.num_tokens):
                return  # FIFO: wait for blocks (backpressure)
            self._pending.popleft()
            self.kv.allocate(req, req.num_tokens, in_transfer=True)  # prompt (+ a migrated request's outputs)
            req.status = RequestStatus.TRANSFERRING
            gen = self.transfers.open(req.transfer_id, req.request_id, req.block_table,
                                      time.monotonic() + self.sched.lease_s, lease_s=self.sched.lease_s)
            self._emit(req.request_id, Reserved(req.transfer_id, gen, list(req.block_table)))

    def _on_kv_done(self, msg: KvDoneMsg) -> None:
        t = self.transfers.close(msg.transfer_id, msg.generation)
        if t is None:
            return  # reclaimed or aborted meanwhile: stale
        req = self._requests[t.request_id]
        self.kv.transfer_ended(req)
        req.num_computed = req.num_tokens  # the prompt (+ a migrated request's earlier outputs)
        req.output_token_ids.append(msg.first_token_id)
        # The prefill worker sampled the first token from the same seed. (A request
        # rebuilt here after a failed transfer samples it here instead: no skip.)
        skip_draw(req.generator, req.params.sampling)
        req.status = RequestStatus.RUNNING
        reason = check_finish(req, self.eos, self.sched.max_model_len)
        self._emit(req.request_id, Tokens([msg.first_token_id], [msg.first_logprobs], reason))
        if reason:
            self._release(req.request_id)
        else:
            self._ready.append(req.request_id)

    def _on_abort(self, msg: AbortMsg) -> None:
        req = self._requests.get(msg.request_id)
        if req is None or msg.transfer_id not in (None, req.transfer_id) or \
                msg.stream not in (None, self._streams[msg.request_id]):
            return
        self._emit(msg.request_id, Tokens([], [], "abort"))
        self._release(msg.request_id)

    def _resume_preempted(self) -> None:
        while self._preempted and self._num_scheduled() < self.sched.max_num_seqs:
            req = self._requests[self._preempted[0]]
            if not self.kv.can_allocate(req.num_tokens - 1):  # all but the newest token are cached
                return
            self._preempted.popleft()
            self.kv.allocate(req, req.num_tokens - 1)
            req.num_computed = 0
            req.status = RequestStatus.RECOMPUTING
            self._recomputing.append(req.request_id)

    def _preempt(self, request_id: str) -> None:
        """Free a running request's blocks; it resumes by recomputation."""
        req = self._requests[request_id]
        self._running.remove(request_id)
        self.kv.free(req)
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        self._preempted.appendleft(request_id)
        self.num_preemptions += 1
        log.info("preempted %s at %d tokens (%d preemptions so far)", request_id, req.num_tokens,
                 self.num_preemptions, extra={"request_id": request_id})

    def _plan(self) -> list[ScheduledSeq]:
        budget = self.sched.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for rid in self._recomputing:  # KV of all tokens but the newest, chunked
            req = self._requests[rid]
            n = min(req.num_tokens - 1 - req.num_computed, budget)
            if n <= 0:
                break
            seqs.append(compute_seq(req, req.all_token_ids[req.num_computed:req.num_computed + n], req.num_computed))
            budget -= n
        for rid in list(self._running):
            if rid not in self._running:
                continue  # preempted below for an earlier request
            if not self._grow(rid):
                continue  # preempted itself
            req = self._requests[rid]
            pos = req.num_tokens - 1  # the newest token is not in the cache yet
            newest = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
            seqs.append(sampling_seq(req, [newest], pos, self.eos))
        return seqs

    def _grow(self, request_id: str) -> bool:
        """Room for a running request's newest token, preempting the victims the KV
        manager picks while the pool is dry; False when the request itself was picked."""
        req = self._requests[request_id]
        while not self.kv.grow(req):
            victim = self.kv.choose_victim(self._running)
            self._preempt(victim)
            if victim == request_id:
                return False
        return True

    def _model_step(self) -> None:
        seqs = self._plan()
        if not seqs:
            return
        try:
            out, _ = execute_timed(self.runner, StepPlan(seqs), "decode", self.on_step)
        except Exception as e:
            log.exception("decode step failed; failing its %d requests", len(seqs))
            for s in seqs:
                self.fail_request(s.request_id, grpc.StatusCode.INTERNAL, f"decode step failed: {e}")
            return
        self.step_count += 1
        for s in seqs:
            if not s.sample:
                req = self._requests[s.request_id]
                req.num_computed += len(s.token_ids)
                if req.num_computed == req.num_tokens - 1:  # KV rebuilt: decode on
                    self._recomputing.remove(s.request_id)
                    req.status = RequestStatus.RUNNING
                    self._running.append(s.request_id)
        for rid, tok, lp in zip(out.request_ids, out.token_ids, out.logprobs):
            req = self._requests[rid]
            req.num_computed += 1
            req.output_token_ids.append(tok)
            reason = check_finish(req, self.eos, self.sched.max_model_len)
            self._emit(rid, Tokens([tok], [lp], reason))
            if reason:
                self._release(rid)

    # ---- failed transfers (policy: decode_worker.kv_failure) -------------------------
    def submit_fail_transfer(self, request_id: str, transfer_id: str, reason: str) -> Future[KvFailureOutcome]:
        """The prefill side of ``transfer_id`` failed (thread-safe); the future resolves
        to a :class:`KvFailureOutcome` once the loop handled it."""
        reply: Future[KvFailureOutcome] = Future()
        self._inbox.put(FailTransferMsg(request_id, transfer_id, reason, reply))
        return reply

    def _on_kv_failed(self, msg: KvFailedMsg) -> None:
        t = self.transfers.close(msg.transfer_id, msg.generation)
        if t is not None:
            self._transfer_lost(t.request_id, f"KV transfer failed: {msg.reason}")

    def _expire_leases(self) -> None:
        for t in self.transfers.expired(time.monotonic()):
            self._transfer_lost(t.request_id, f"KV transfer lease expired after {self.sched.lease_s:.1f}s "
                                              "(prefill worker lost?)")

    def _on_fail_transfer(self, msg: FailTransferMsg) -> None:
        req = self._requests.get(msg.request_id)
        outcome = self.kv_failure.fail_transfer_outcome(req, msg.transfer_id)
        if outcome is None:  # TRANSFERRING: its transfer is open (only this thread closes one)
            self.transfers.close(req.transfer_id, None)
            outcome = self._transfer_lost(req.request_id, f"KV transfer failed: prefill side failed: {msg.reason}")
        log.info("prefill side of %s (transfer %s) failed (%s): %s", msg.request_id, msg.transfer_id,
                 msg.reason, outcome.value, extra={"request_id": msg.request_id})
        msg.reply.set_result(outcome)

    def _transfer_lost(self, request_id: str, why: str) -> KvFailureOutcome:
        """Hand a request whose transfer was just closed undelivered to the policy."""
        self.num_failed_transfers += 1
        return self.kv_failure.transfer_lost(request_id, why, self)

    def recompute_request(self, request_id: str, why: str) -> None:
        """TRANSFERRING -> RECOMPUTING (:class:`RecoveryActions`, loop thread only): keep
        the reserved blocks and rebuild the KV of the prompt (and of a migrated request's
        earlier outputs) here once a batch slot frees."""
        req = self._requests[request_id]
        self.kv.transfer_ended(req)
        req.num_computed, req.status = 0, RequestStatus.RECOMPUTING
        self._ready.append(request_id)
        self.num_kv_recomputes += 1
        log.warning("%s; recomputing the %d-token prompt (+ %d earlier outputs) of %s here (%d recomputes so far)",
                    why, len(req.prompt_token_ids), len(req.output_token_ids), request_id, self.num_kv_recomputes,
                    extra={"request_id": request_id})

    # ---- endings -------------------------------------------------------------------
    def fail_request(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        """End a live request with ``code`` / ``message``, freeing its blocks (no-op if unknown; loop thread only)."""
        if request_id in self._requests:
            self._emit(request_id, Failed(code, message))
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Free every block of the request and forget it (idempotent)."""
        req = self._requests.pop(request_id, None)
        self._streams.pop(request_id, None)
        self.kv_failure.forget(request_id)
        if req is None:
            return
        if req.status == RequestStatus.TRANSFERRING:
            # closed under the table's lock: no late chunk writes into blocks going back now
            self.transfers.close(req.transfer_id, None)
        self.kv.free(req)
        for lst in (self._pending, self._ready, self._running, self._preempted, self._recomputing):
            if request_id in lst:
                lst.remove(request_id)
        req.status = RequestStatus.FINISHED
        self.num_finished += 1

    def _emit(self, request_id: str, event: DecodeEventT) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(event)

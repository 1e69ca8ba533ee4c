"""Decode scheduler: the one owner of a decode worker's requests and KV blocks.

Lifecycle of a request here (decode-led reservation, DESIGN.md):
``reserve`` -> WAITING (no room yet) -> TRANSFERRING (blocks allocated, lease
running, the prefill worker writes into them) -> RUNNING (KV verified, first token
known) -> finished / aborted / failed, blocks back in the pool.

Admission: a reservation is admitted when its prompt blocks plus one token of
growth fit while a watermark of the pool stays free (blocks pre-allocated for
transfers still in flight are already out of the free list); otherwise it waits
(backpressure). A request that could never fit (prompt + max_tokens > pool) is
refused with RESOURCE_EXHAUSTED. When blocks run out mid-decode, the most
recently admitted running request is preempted: its blocks are freed and it is
resumed later by recomputing its KV (prompt + generated tokens) here, in chunks
under the token budget, then decoding on (vLLM's recompute preemption). Preempted
requests resume before new reservations are admitted. A transfer that fails (corrupt
or incomplete stream, lease expiry, prefill side lost) ends its request with
UNAVAILABLE or, under ``kv_failure_policy="recompute"``, is rebuilt here through the
same recompute path (:mod:`decode_worker.kv_recovery`).

Continuous batching: every step runs one token for every running request (plus
recompute chunks); arrivals join and finished requests leave between steps.

Thread model: gRPC handlers and the KV receiver call the ``submit_*`` methods and
the :class:`TransferTable` (both thread-safe); only :meth:`step` (the loop
thread) changes request state or allocates blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future

import grpc
import torch

from decode_worker.events import DecodeEventT, Failed, Reserved, Tokens
from decode_worker.kv_recovery import KvFailureOutcome
from decode_worker.messages import (
    AbortMsg,
    FailTransferMsg,
    KvDoneMsg,
    KvFailedMsg,
    ReserveMsg,
)
from decode_worker.transfers import TransferTable
from engine.block_pool import BlockPool, blocks_needed
from engine.config import CacheConfig, SchedulerConfig
from engine.inbox import Inbox, run_steps
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.step import ScheduledSeq, StepPlan, TokenLogprobs
from engine.stop_check import check_finish

log = logging.getLogger(__name__)


class DecodeScheduler:
    """Continuous-batching decode over a paged KV cache.

    Args:
        runner: the stateless model runner (owns the KV cache tensor).
        cache: pool geometry (``num_blocks``, ``block_size``).
        sched: limits (``max_num_seqs``, ``max_model_len``, ``lease_s``) and the
            ``kv_failure_policy``.
        eos_token_ids: the model's EOS ids.
        wake: event set whenever a message arrives (shared by schedulers on one loop).
    """

    def __init__(self, runner: ModelRunner, cache: CacheConfig, sched: SchedulerConfig,
                 eos_token_ids: tuple[int, ...], wake: threading.Event | None = None) -> None:
        self.runner = runner
        self.block_size = cache.block_size
        self.sched = sched
        self.eos = eos_token_ids
        self.pool = BlockPool(cache.num_blocks)
        self.transfers = TransferTable(runner.kv_cache)
        self._inbox = Inbox(wake)
        self._streams: dict[str, queue.Queue] = {}
        self._requests: dict[str, Request] = {}
        self._pending: deque[str] = deque()     # waiting for blocks
        self._ready: deque[str] = deque()       # KV arrived (or to rebuild), waiting for a batch slot
        self._running: list[str] = []           # decoding, in admission order
        self._preempted: deque[str] = deque()   # blocks taken back, resume first
        self._recomputing: list[str] = []       # rebuilding KV (preempted, or its transfer failed)
        self.watermark_blocks = int(sched.watermark * self.pool.num_usable)
        self.num_preemptions = 0
        self.num_finished = 0
        self.step_count = 0
        self.num_failed_transfers = 0
        self.num_kv_recomputes = 0
        self._recovered: set[str] = set()  # requests whose KV is rebuilt here after a failed transfer

    # ---- called from other threads -------------------------------------------------
    def submit_reserve(self, request: Request, stream: queue.Queue[DecodeEventT]) -> None:
        self._inbox.put(ReserveMsg(request, stream))

    def submit_abort(self, request_id: str) -> None:
        self._inbox.put(AbortMsg(request_id))

    def kv_complete(self, transfer_id: str, generation: int, first_token_id: int,
                    first_logprobs: TokenLogprobs | None) -> None:
        self._inbox.put(KvDoneMsg(transfer_id, generation, first_token_id, first_logprobs))

    def kv_failed(self, transfer_id: str, generation: int, reason: str) -> None:
        self._inbox.put(KvFailedMsg(transfer_id, generation, reason))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def load(self) -> dict:
        """Counters for heartbeats and GetLoad (racy reads of ints are fine)."""
        return {
            "num_waiting": len(self._pending),
            "num_running": len(self._requests) - len(self._pending),
            "num_free_blocks": self.pool.num_free,
            "num_total_blocks": self.pool.num_usable,
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
        """One scheduling round; returns whether a model step ran. With ``block``, an idle
        scheduler waits up to 50 ms for mail."""
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

    def _fits(self, n: int) -> bool:
        """``n`` more blocks can be taken while the watermark stays free (an empty pool
        ignores the watermark, so a request that fits the pool always runs)."""
        empty = self.pool.num_free == self.pool.num_usable
        return self.pool.num_free - n >= (0 if empty else self.watermark_blocks)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, ReserveMsg):
            self._on_reserve(msg)
        elif isinstance(msg, KvDoneMsg):
            self._on_kv_done(msg)
        elif isinstance(msg, KvFailedMsg):
            self._on_kv_failed(msg)
        elif isinstance(msg, AbortMsg):
            self._on_abort(msg.request_id)
        elif isinstance(msg, FailTransferMsg):
            self._on_fail_transfer(msg)

    def _on_reserve(self, msg: ReserveMsg) -> None:
        req = msg.request
        if req.request_id in self._requests:
            msg.stream.put(Failed(grpc.StatusCode.ALREADY_EXISTS, f"request {req.request_id} is running"))
            return
        need = req.max_blocks(self.block_size)
        if need > self.pool.num_usable:
            msg.stream.put(Failed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request needs {need} KV blocks (prompt + max_tokens), the decode pool has "
                f"{self.pool.num_usable}",
            ))
            return
        self._requests[req.request_id] = req
        self._streams[req.request_id] = msg.stream
        self._pending.append(req.request_id)

    def _admit_pending(self) -> None:
        while self._pending and not self._preempted:
            req = self._requests[self._pending[0]]
            if not self._fits(blocks_needed(len(req.prompt_token_ids) + 1, self.block_size)):
                return  # FIFO: wait for blocks (backpressure)
            self._pending.popleft()
            req.block_table = self.pool.allocate(blocks_needed(len(req.prompt_token_ids), self.block_size))
            req.status = RequestStatus.TRANSFERRING
            gen = self.transfers.open(req.transfer_id, req.request_id, req.block_table,
                                      time.monotonic() + self.sched.lease_s, lease_s=self.sched.lease_s)
            self._emit(req.request_id, Reserved(req.transfer_id, gen, list(req.block_table)))

    def _on_kv_done(self, msg: KvDoneMsg) -> None:
        t = self.transfers.close(msg.transfer_id, msg.generation)
        if t is None:
            return  # reclaimed or aborted meanwhile: stale
        req = self._requests[t.request_id]
        req.num_computed = len(req.prompt_token_ids)
        req.output_token_ids.append(msg.first_token_id)
        if req.generator is not None and req.params.sampling.temperature > 0.0:
            # The prefill worker drew this request's first uniform from the same
            # seed; skip it so the stream of draws matches a colocated run (greedy
            # rows draw nothing: Sampler's RNG contract). A request rebuilt here after
            # a failed transfer draws its first uniform itself instead.
            torch.rand(1, generator=req.generator, device=req.generator.device)
        req.status = RequestStatus.RUNNING
        reason = check_finish(req, self.eos, self.sched.max_model_len)
        self._emit(req.request_id, Tokens([msg.first_token_id], [msg.first_logprobs], reason))
        if reason:
            self._release(req.request_id)
        else:
            self._ready.append(req.request_id)

    def _on_abort(self, request_id: str) -> None:
        if request_id not in self._requests:
            return
        self._emit(request_id, Tokens([], [], "abort"))
        self._release(request_id)

    def _resume_preempted(self) -> None:
        while self._preempted and self._num_scheduled() < self.sched.max_num_seqs:
            req = self._requests[self._preempted[0]]
            if not self._fits(blocks_needed(req.num_tokens, self.block_size)):
                return
            self._preempted.popleft()
            req.block_table = self.pool.allocate(blocks_needed(req.num_tokens - 1, self.block_size))
            req.num_computed = 0
            req.status = RequestStatus.RECOMPUTING
            self._recomputing.append(req.request_id)

    def _preempt(self, request_id: str) -> None:
        """Free a running request's blocks; it resumes by recomputation."""
        req = self._requests[request_id]
        self._running.remove(request_id)
        self.pool.free(req.block_table)
        req.block_table = []
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        self._preempted.appendleft(request_id)
        self.num_preemptions += 1
        log.info("preempted %s at %d tokens (%d preemptions so far)", request_id, req.num_tokens,
                 self.num_preemptions)

    def _plan(self) -> list[ScheduledSeq]:
        budget = self.sched.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for rid in self._recomputing:  # KV of all tokens but the newest, chunked
            req = self._requests[rid]
            n = min(req.num_tokens - 1 - req.num_computed, budget)
            if n <= 0:
                break
            tokens = req.all_token_ids[req.num_computed:req.num_computed + n]
            seqs.append(ScheduledSeq(rid, tokens, req.num_computed, req.block_table, False,
                                     req.params.sampling, req.generator,
                                     req.prompt_token_ids, req.output_token_ids))
            budget -= n
        for rid in list(self._running):
            if rid not in self._running:
                continue  # preempted below for an earlier request
            req = self._requests[rid]
            pos = req.num_tokens - 1  # the newest token is not in the cache yet
            if pos // self.block_size >= len(req.block_table):
                while self.pool.num_free == 0 and rid in self._running:
                    self._preempt(self._running[-1])  # the most recently admitted
                if rid not in self._running:
                    continue
                req.block_table.extend(self.pool.allocate(1))
            newest = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
            seqs.append(ScheduledSeq(rid, [newest], pos, req.block_table, True,
                                     req.params.sampling, req.generator,
                                     req.prompt_token_ids, req.output_token_ids))
        return seqs

    def _model_step(self) -> None:
        seqs = self._plan()
        if not seqs:
            return
        try:
            out = self.runner.execute(StepPlan(seqs))
        except Exception as e:
            log.exception("decode step failed; failing its %d requests", len(seqs))
            for s in seqs:
                self._finish_error(s.request_id, grpc.StatusCode.INTERNAL, f"decode step failed: {e}")
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

    # ---- failed transfers (policy: decode_worker.kv_recovery) ------------------------
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
        if req is None or req.transfer_id != msg.transfer_id or req.status == RequestStatus.WAITING:
            outcome = KvFailureOutcome.UNKNOWN_REQUEST  # gone, another transfer, or no blocks offered yet
        elif req.status == RequestStatus.TRANSFERRING and self.transfers.close(req.transfer_id, None):
            outcome = self._transfer_lost(req.request_id, f"KV transfer failed: prefill side failed: {msg.reason}")
        else:
            outcome = KvFailureOutcome.RECOMPUTING if req.request_id in self._recovered else KvFailureOutcome.KV_COMPLETE
        log.info("prefill side of %s (transfer %s) failed (%s): %s", msg.request_id, msg.transfer_id,
                 msg.reason, outcome.value)
        msg.reply.set_result(outcome)

    def _transfer_lost(self, request_id: str, why: str) -> KvFailureOutcome:
        """Apply the policy to a request whose transfer was just closed undelivered."""
        self.num_failed_transfers += 1
        if self.sched.kv_failure_policy != "recompute":
            self._finish_error(request_id, grpc.StatusCode.UNAVAILABLE, why)
            return KvFailureOutcome.FAILED
        req = self._requests[request_id]
        req.num_computed, req.status = 0, RequestStatus.RECOMPUTING
        self._recovered.add(request_id)
        self._ready.append(request_id)  # joins the batch (recomputing) when a slot frees
        self.num_kv_recomputes += 1
        log.warning("%s; recomputing the %d-token prompt of %s here (%d recomputes so far)", why,
                    len(req.prompt_token_ids), request_id, self.num_kv_recomputes)
        return KvFailureOutcome.RECOMPUTING

    # ---- endings -------------------------------------------------------------------
    def _finish_error(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        if request_id in self._requests:
            self._emit(request_id, Failed(code, message))
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Free every block of the request and forget it (idempotent)."""
        req = self._requests.pop(request_id, None)
        self._streams.pop(request_id, None)
        self._recovered.discard(request_id)
        if req is None:
            return
        if req.status == RequestStatus.TRANSFERRING:
            # Close the transfer under its lock so no late chunk can write into
            # blocks that go back to the pool now.
            self.transfers.close(req.transfer_id, None)
        if req.block_table:
            self.pool.free(req.block_table)
            req.block_table = []
        for lst in (self._pending, self._ready, self._running, self._preempted, self._recomputing):
            if request_id in lst:
                lst.remove(request_id)
        req.status = RequestStatus.FINISHED
        self.num_finished += 1

    def _emit(self, request_id: str, event: DecodeEventT) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(event)

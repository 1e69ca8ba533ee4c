"""Prefill scheduler: the one owner of a prefill worker's requests and KV blocks.

Each step packs the prompts waiting at that moment into one flat varlen batch
under a token budget (``max_num_batched_tokens``); a prompt longer than what is
left of the budget is cut into chunks that attend to the earlier chunks' KV in
the paged cache (chunked prefill, as in vLLM v1 / Sarathi-Serve). After a
prompt's last chunk its first token is sampled and its KV blocks are handed to
the KV sender; the blocks are freed only when the decode side acknowledged (or
the transfer failed).

A migrated request (``WorkerRequest.output_token_ids``: tokens an earlier worker
generated) is prefilled over prompt + those outputs (the prompt part usually from
the prefix cache) and its "first token" is the next output; penalties see the
earlier outputs as outputs and a seeded generator has skipped their draws
(:func:`serving.convert.request_from_proto`).

Layer-wise streaming (``layerwise=True``): the transfer of a prompt whose last
chunk runs in a step starts when the step starts; the model reports each layer
whose KV it finished writing (:class:`kvtransfer.progress.LayerProgress`), so the
sender ships layer l while layer l+1 computes, and the "done" message with the
first token leaves right after sampling (DistServe / Mooncake-style overlap).

Thread model: gRPC handlers call ``submit_*``; sender threads report back through
the inbox; only :meth:`step` (the loop thread) changes state or touches the pool.
The loop also reads its inbox between two layers of a step (the model's per-layer
hook): a transfer acknowledged while a long prefill step runs is answered and its
blocks freed then, not a whole step later (the router's final token of that request
waits for this answer); mail about the requests of the running step waits for its end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from common.prefix_hash import block_hashes
from engine.block_pool import BlockPool, blocks_needed
from engine.config import CacheConfig, SchedulerConfig
from engine.inbox import Inbox, run_steps
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.step import ScheduledSeq, StepPlan, TokenLogprobs
from engine.step_stats import StepObserver, execute_timed
from engine.seqs import compute_seq, sampling_seq
from kvtransfer.progress import LayerProgress
from prefill_worker.contracts import ExternalBlocks, PrefillError, PrefillResult, SendFn
from serving.convert import logprobs_to_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request: Request
    send: SendFn
    future: Future
    external: "ExternalBlocks | None" = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _SendDone:
    request_id: str
    error: BaseException | None
    kv_bytes: int
    started_at: float  # time.monotonic()
    ended_at: float


@dataclass
class _Entry:
    request: Request
    send: SendFn
    future: Future
    external: ExternalBlocks | None = None
    first_token: int = -1
    first_logprobs: TokenLogprobs | None = None
    prefill_s: float = 0.0
    queue_s: float = 0.0
    computed_at: float = 0.0  # time.monotonic() when the last prefill step ended
    aborted: bool = False
    step_error: "PrefillError | None" = None  # the streamed step failed: fail once the sender returned
    block_hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class PrefillScheduler:
    """Batched, chunked prefill; one scheduler per prefill worker.

    Args:
        runner: the stateless model runner.
        cache: pool geometry.
        sched: ``max_num_batched_tokens`` (token budget per step), ``max_num_seqs``.
        sender_threads: concurrent KV transfers.
        wake: event set whenever a message arrives (shared by schedulers on one loop).
        model_id: model identity salted into prefix-cache hashes.
        layerwise: start a request's transfer with its last prefill step and stream
            the KV layer by layer (requests writing into external blocks never stream).
        on_step: called with every executed step's :class:`engine.step_stats.StepStats`.
        on_computed: called as each request's prefill ends (before its KV is sent, so a request
            cancelled meanwhile counts too) with its prompt tokens, the tokens the prefix cache held,
            its queue time and its prefill compute time (seconds).
        eos_token_ids: the model's EOS ids, which a request's first token cannot be while it
            asks for ``min_tokens`` (:func:`engine.stop_check.early_stop_ids`).
    """

    def __init__(self, runner: ModelRunner, cache: CacheConfig, sched: SchedulerConfig,
                 sender_threads: int = 4, wake: threading.Event | None = None, model_id: str = "",
                 layerwise: bool = False, on_step: StepObserver | None = None,
                 eos_token_ids: tuple[int, ...] = (),
                 on_computed: Callable[[int, int, float, float], None] | None = None) -> None:
        self.runner = runner
        self.eos = eos_token_ids
        self.on_step, self.on_computed = on_step, on_computed
        self.layerwise = layerwise
        self.num_layers = runner.kv_cache.shape[0]
        self.block_size = cache.block_size
        self.prefix_caching = cache.enable_prefix_caching
        self.model_id = model_id
        self.sched = sched
        self.pool = BlockPool(cache.num_blocks)
        self._inbox = Inbox(wake)
        self._entries: dict[str, _Entry] = {}
        self._queue: deque[str] = deque()  # not fully prefilled, FIFO
        self._deferred: list[object] = []  # mail held back by _drain_mid_step, handled first next round
        self._senders = ThreadPoolExecutor(sender_threads, thread_name_prefix="kv-send")
        self.num_finished = 0
        self.num_failed_transfers = 0

    # ---- called from other threads -------------------------------------------------
    def submit(self, request: Request, send: SendFn, external: ExternalBlocks | None = None) -> Future:
        """Queue a request; the future resolves to :class:`PrefillResult` or raises
        :class:`PrefillError`. With ``external``, the KV goes into those blocks."""
        fut: Future = Future()
        self._inbox.put(_Add(request, send, fut, external))
        return fut

    def submit_abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._entries

    def load(self) -> dict:
        return {
            "num_waiting": len(self._queue),
            "num_running": len(self._entries),
            "num_free_blocks": self.pool.num_free,
            "num_total_blocks": self.pool.num_usable,
            "num_finished": self.num_finished,
            "num_failed_transfers": self.num_failed_transfers,
        }

    def shutdown(self) -> None:
        self._senders.shutdown(wait=False, cancel_futures=True)

    # ---- the loop ------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        run_steps(stop, self.step)

    def step(self, block: bool = True) -> bool:
        """One scheduling round; returns whether a model step ran. With ``block``, an idle
        scheduler waits up to 50 ms for mail."""
        self._drain_inbox(block=block and not self._queue)
        return bool(self._queue) and self._prefill_step(block)

    def _drain_inbox(self, block: bool) -> None:
        msgs, self._deferred = self._deferred + self._inbox.drain(block=block and not self._deferred), []
        for msg in msgs:
            self._handle(msg)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, _Add):
            self._on_add(msg)
        elif isinstance(msg, _Abort):
            self._on_abort(msg.request_id)
        elif isinstance(msg, _SendDone):
            self._on_send_done(msg)

    def _drain_mid_step(self, in_step: set[str]) -> None:
        """Between two layers of a step (loop thread): handle the mail about requests
        outside the step now, so a transfer acknowledged during a long prefill step is
        answered (and its blocks freed) within a layer's time instead of after the step;
        mail about the step's own requests waits, in order, for the step's end (where an
        abort among it keeps the KV of a prompt the step completed from being sent)."""
        for msg in self._inbox.drain(block=False):
            rid = msg.request.request_id if isinstance(msg, _Add) else msg.request_id
            if rid in in_step:
                self._deferred.append(msg)
            else:
                self._handle(msg)

    def _on_add(self, msg: _Add) -> None:
        rid = msg.request.request_id
        need = blocks_needed(msg.request.num_tokens, self.block_size)
        if rid in self._entries:
            msg.future.set_exception(PrefillError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is running"))
        elif need > self.pool.num_usable:
            msg.future.set_exception(PrefillError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prompt{' + outputs' if msg.request.output_token_ids else ''} needs {need} KV blocks, "
                f"the prefill pool has {self.pool.num_usable}"))
        else:
            self._entries[rid] = _Entry(msg.request, msg.send, msg.future, msg.external)
            if msg.external is not None:
                msg.request.block_table = list(msg.external.block_ids)
            self._queue.append(rid)

    def _schedule(self) -> list[ScheduledSeq]:
        for rid in [r for r in self._queue if self._entries[r].external is not None]:
            if not self._entries[rid].external.still_valid():
                self._fail(rid, PrefillError(grpc.StatusCode.CANCELLED, "destination blocks were released"))
        budget = self.sched.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for rid in self._queue:
            if budget <= 0 or len(seqs) >= self.sched.max_num_seqs:
                break
            req = self._entries[rid].request
            tokens = req.all_token_ids  # a migrated request's outputs are prefilled after its prompt
            if not req.block_table and not self._assign_blocks(self._entries[rid]):
                break  # FIFO: wait until transfers finish and free blocks
            n = min(len(tokens) - req.num_computed, budget)
            last = req.num_computed + n == len(tokens)
            chunk = tokens[req.num_computed:req.num_computed + n]
            seqs.append(sampling_seq(req, chunk, req.num_computed, self.eos, prompt_logprobs=True) if last
                        else compute_seq(req, chunk, req.num_computed, prompt_logprobs=True))
            budget -= n
        return seqs

    def _assign_blocks(self, entry: _Entry) -> bool:
        """Give a request its blocks: the longest cached prefix (prefix cache hits, one
        reference each) plus fresh blocks for the rest. At least the last token is
        always computed (a full hit drops its last block). The tokens are the prompt,
        followed by a migrated request's earlier outputs. False when the pool cannot
        hold it yet."""
        req = entry.request
        prompt = req.all_token_ids
        hit: list[int] = []
        if self.prefix_caching:
            entry.block_hashes = block_hashes(prompt, self.block_size, self.model_id)
            # prompt logprobs need every position's logits: computed, never taken from the cache (as vLLM's)
            hit = self.pool.lookup(entry.block_hashes) if req.params.prompt_logprobs is None else []
            if len(hit) * self.block_size >= len(prompt):
                hit = hit[:-1]
        fresh = blocks_needed(len(prompt), self.block_size) - len(hit)
        if fresh > self.pool.num_free - sum(1 for b in hit if self.pool.ref_count(b) == 0):
            return False
        self.pool.touch(hit)
        req.block_table = hit + self.pool.allocate(fresh)
        req.num_computed = entry.cached_tokens = len(hit) * self.block_size
        return True

    def _publish_blocks(self, entry: _Entry, computed_before: int) -> None:
        """Make the blocks whose KV this step completed findable (never earlier)."""
        req = entry.request
        first = computed_before // self.block_size
        last = min(req.num_computed // self.block_size, len(entry.block_hashes))
        for i in range(first, last):
            self.pool.cache(req.block_table[i], entry.block_hashes[i])

    def _start_streams(self, seqs: list[ScheduledSeq]) -> dict[str, LayerProgress]:
        """Start the transfers of the prompts this step completes (layer-wise streaming)."""
        streams: dict[str, LayerProgress] = {}
        for s in seqs:
            entry = self._entries[s.request_id]
            if s.sample and entry.external is None:
                streams[s.request_id] = progress = LayerProgress(self.num_layers)
                entry.request.status = RequestStatus.TRANSFERRING
                self._senders.submit(self._send, entry, progress)
        return streams

    def _prefill_step(self, block: bool) -> bool:
        seqs = self._schedule()
        if not seqs:
            self._drain_inbox(block=block)  # out of blocks: wait for a transfer to finish
            return False
        streams = self._start_streams(seqs) if self.layerwise else {}
        in_step = {s.request_id for s in seqs}

        def hook(layer: int) -> None:
            for progress in streams.values():
                progress.layer_done(layer)
            self._drain_mid_step(in_step)
        try:
            out, stats = execute_timed(self.runner, StepPlan(seqs, on_layer_done=hook), "prefill", self.on_step)
        except Exception as e:  # noqa: BLE001 - fail this batch, keep serving everyone else
            log.exception("prefill step failed; failing its %d requests", len(seqs))
            err = PrefillError(grpc.StatusCode.INTERNAL, f"prefill step failed: {e}")
            for s in seqs:
                if s.request_id in streams:  # its sender may be reading the blocks: free them when it returns
                    self._entries[s.request_id].step_error = err
                    self._queue.remove(s.request_id)
                    streams[s.request_id].fail(str(err))
                else:
                    self._fail(s.request_id, err)
            return True
        for s in seqs:
            entry = self._entries[s.request_id]
            if not entry.prefill_s:
                entry.queue_s = max(0.0, time.monotonic() - stats.seconds - entry.request.arrival_s)
            entry.prefill_s += stats.seconds
            entry.request.num_computed += len(s.token_ids)
            entry.prompt_logprobs.extend(out.prompt_logprobs.get(s.request_id, ()))
            entry.request.status = RequestStatus.PREFILLING
            if entry.block_hashes:
                self._publish_blocks(entry, s.num_computed)
        now = time.monotonic()
        stopped = {m.request_id for m in self._deferred if isinstance(m, _Abort)}  # aborted during the step
        for rid, tok, lp in zip(out.request_ids, out.token_ids, out.logprobs):
            entry = self._entries[rid]
            entry.first_token, entry.first_logprobs = tok, lp
            entry.computed_at = now
            entry.request.status = RequestStatus.TRANSFERRING
            if self.on_computed is not None:
                self.on_computed(entry.request.num_tokens, entry.cached_tokens, entry.queue_s, entry.prefill_s)
            self._queue.remove(rid)
            if rid in stopped:  # no KV to send: a started stream ends (its blocks free when the sender returns)
                if rid in streams:
                    streams[rid].fail("request aborted")
                else:
                    self._fail(rid, PrefillError(grpc.StatusCode.CANCELLED, "request aborted"))
            elif rid in streams:
                streams[rid].finish(tok, logprobs_to_dict(lp))
            else:
                self._senders.submit(self._send, entry, LayerProgress.ready(self.num_layers, tok, logprobs_to_dict(lp)))
        return True

    def _send(self, entry: _Entry, progress: LayerProgress) -> None:
        """Sender thread: push the KV, then report back to the loop."""
        t0 = time.monotonic()
        try:
            nbytes = entry.send(entry.request, progress)
            err = None
        except BaseException as e:  # noqa: BLE001 - reported to the loop
            nbytes, err = 0, e
        self._inbox.put(_SendDone(entry.request.request_id, err, nbytes, t0, time.monotonic()))

    def _on_send_done(self, msg: _SendDone) -> None:
        entry = self._entries.get(msg.request_id)
        if entry is None:
            return
        if entry.step_error is not None:
            self._fail(msg.request_id, entry.step_error)
        elif entry.aborted:
            self._fail(msg.request_id, PrefillError(grpc.StatusCode.CANCELLED, "request aborted"))
        elif msg.error is not None:
            self.num_failed_transfers += 1
            code = msg.error.code if isinstance(msg.error, PrefillError) else grpc.StatusCode.UNAVAILABLE
            self._fail(msg.request_id, PrefillError(code, f"KV transfer failed: {msg.error}"))
        else:
            self._release(msg.request_id)
            self.num_finished += 1
            exposed = msg.ended_at - max(msg.started_at, entry.computed_at)
            entry.future.set_result(PrefillResult(entry.first_token, entry.first_logprobs, msg.kv_bytes,
                                                  entry.prefill_s, exposed, entry.cached_tokens,
                                                  msg.ended_at - msg.started_at, entry.prompt_logprobs))

    def _on_abort(self, request_id: str) -> None:
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if entry.request.status == RequestStatus.TRANSFERRING:
            entry.aborted = True  # the sender reads the blocks: free them when it returns
        else:
            self._fail(request_id, PrefillError(grpc.StatusCode.CANCELLED, "request aborted"))

    def _fail(self, request_id: str, err: PrefillError) -> None:
        entry = self._entries.get(request_id)
        if entry is None:
            return
        self._release(request_id)
        if not entry.future.done():
            entry.future.set_exception(err)

    def _release(self, request_id: str) -> None:
        entry = self._entries.pop(request_id)
        if request_id in self._queue:
            self._queue.remove(request_id)
        if entry.request.block_table and entry.external is None:
            self.pool.free(entry.request.block_table)
            entry.request.block_table = []
        entry.request.status = RequestStatus.FINISHED

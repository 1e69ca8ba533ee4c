"""The router's request path, shared by the gRPC and the OpenAI-compatible HTTP front doors.

Lifecycle of one request (DESIGN.md "decode-led reservation, prefill push"):

1. :meth:`RequestRouter.start` validates and tokenizes it (:mod:`router.validation`) and
   registers its id (a duplicate of a running id is refused);
2. :meth:`ActiveRequest.responses` places it (:mod:`router.placement`: a decode worker D
   and a prefill worker P, one worker for both in a colocated cluster); ``D.Reserve``
   allocates blocks and opens the token stream; ``P.Prefill`` (with D's block ids)
   computes the prompt and pushes its KV to D; D's token stream is detokenized here
   (:mod:`router.output`) and yielded as ``GenerateResponse`` messages;
3. a worker failure migrates it (:mod:`router.migration`): when the decode stream fails
   with a transport error (the decode worker died: UNAVAILABLE, ...) or ends because the
   prefill call failed, both calls are cancelled (both workers free the request's
   blocks) and steps 2-3 run again on a placement avoiding the failed worker(s), with
   the tokens already streamed as ``WorkerRequest.output_token_ids``: the prefill
   worker prefills prompt + those tokens and the decode worker streams only what
   follows, through the same output assembler (held-back stop-string text, usage and
   request statistics carry over; nothing is streamed twice). A failed prefill call is
   first reported to the decode worker, whose KV failure policy decides
   (:mod:`router.handle`): under "recompute" it rebuilds the KV itself and the stream
   goes on; under "error" its stream ends and the request migrates. At most
   ``max_migrations`` migrations, then UNAVAILABLE naming the cause;
4. it ends finished (stop, length), aborted (:meth:`RequestRouter.abort`), cancelled
   (:meth:`ActiveRequest.cancel`: the client went away; never migrated) or failed
   (:class:`RouterError`). Abort, cancel and a failure cancel both calls, which makes
   both workers free the request's blocks.

Admission (:mod:`router.admission`) refuses a request in :meth:`RequestRouter.start`, before
anything is allocated, when the router is full or its predicted TTFT exceeds the SLO.

Errors are :class:`RouterError` with a gRPC status code; each front door maps them to
its own wire (gRPC status, HTTP status + OpenAI error body), with a retry-after hint where
the error carries one.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import grpc

from pdcluster.v1 import common_pb2, router_pb2, worker_pb2
from router.admission import Admission, Refused
from router.handle import RequestHandle, status_of
from router.load import LoadTracker
from router.migration import (
    DEFAULT_MAX_MIGRATIONS,
    MIGRATION_WAIT_S,
    Side,
    WorkerFailure,
    attempt_request,
    attempt_request_id,
    check_max_migrations,
    classify,
    closed_early,
    place_waiting,
)
from router.output import OutputAssembler
from router.placement import Placer
from router.policy import NoWorkerError, RequestContext
from router.stats import RequestStats, RouterGauges
from router.stubs import StubCache
from router.validation import InvalidRequest, PreparedRequest, RequestValidator
from serving.logs import REQUEST_ID_METADATA, request_scope
from serving.metrics import ProcessMetrics
from serving.rpc import retry_after_ms

log = logging.getLogger(__name__)

_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
            common_pb2.FINISH_REASON_ABORT: "abort"}


class RouterError(Exception):
    """A request failed; ``code`` is its gRPC status, ``message`` names the cause,
    ``retry_after_ms`` (RESOURCE_EXHAUSTED refusals) when a retry may succeed."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class RequestRouter:
    """Every request in flight on this router. Methods are thread-safe; a request's
    responses are produced on the caller's thread and block only on its own calls.

    Args:
        validator: request validation and tokenization.
        tokenizer: for detokenization.
        placer: the placement step (its registry view also learns of unreachable workers).
        load: the router's per-worker load, which the placer's policy reads.
        metrics: the router's Prometheus metrics.
        stubs: the router's channels to the workers.
        admission: the admission step (``None``: every valid request is admitted).
        max_migrations: how often one request may resume elsewhere after a worker failed
            it (:mod:`router.migration`; 0: never, the worker's status ends it).

    Raises:
        ValueError: ``max_migrations`` outside ``[0, router.migration.MAX_MIGRATIONS_LIMIT]``.
    """

    def __init__(self, validator: RequestValidator, tokenizer, placer: Placer, load: LoadTracker,
                 metrics: ProcessMetrics, stubs: StubCache, admission: Admission | None = None,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS) -> None:
        check_max_migrations(max_migrations)
        self.max_migrations = max_migrations
        self.validator = validator
        self.tokenizer = tokenizer
        self.placer = placer
        self.load = load
        self.metrics = metrics
        self.gauges = RouterGauges(metrics)
        self.stubs = stubs
        self.admission = admission
        self._lock = threading.Lock()
        self._table: dict[str, RequestHandle] = {}
        self._since: dict[str, float] = {}

    def start(self, request: router_pb2.GenerateRequest) -> "ActiveRequest":
        """Admit, validate and register ``request``; nothing is allocated yet.

        Raises:
            RouterError: RESOURCE_EXHAUSTED with ``retry_after_ms`` (refused by admission:
                the router is full, checked first and again when registering, or the
                predicted TTFT exceeds the SLO), INVALID_ARGUMENT (the message names the
                field or limit), ALREADY_EXISTS (a running request has this id).
        """
        capacity = self.admission.capacity() if self.admission is not None else None
        if capacity is not None and len(self._table) >= capacity:  # before any work on it
            self._refused(self.admission.queue_full(request.request_id, len(self._table), capacity))
        try:
            prep = self.validator.prepare(request)
            if self.admission is not None:
                self.admission.check_ttft(prep.request_id, prep.prompt_token_ids)
        except InvalidRequest as e:
            self.metrics.inc("request_errors", code=grpc.StatusCode.INVALID_ARGUMENT.name)
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except Refused as e:
            self._refused(e)
        handle = RequestHandle(prep.request_id)
        with self._lock:
            duplicate = prep.request_id in self._table
            admitted = len(self._table)
            full = capacity is not None and admitted >= capacity
            if not duplicate and not full:
                self._table[prep.request_id] = handle
                self._since[prep.request_id] = time.monotonic()
        if duplicate:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {prep.request_id!r} is already running")
        if full:
            self._refused(self.admission.queue_full(prep.request_id, admitted, capacity))
        return ActiveRequest(self, prep, handle)

    def _refused(self, e: Refused) -> None:
        self.metrics.inc("request_errors", code=grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message, e.retry_after_ms) from None

    def abort(self, request_id: str) -> bool:
        """Abort a running request (its stream ends with finish reason ABORT); returns
        whether it was found."""
        with self._lock:
            handle = self._table.get(request_id)
            if handle is None:
                return False
            handle.aborted = True
        for role, info in (("decode", handle.decode), ("prefill", handle.prefill)):
            if info is None:
                continue
            try:
                self.stubs.get(role, info.address).Abort(
                    worker_pb2.WorkerAbortRequest(request_id=handle.request_id), timeout=2.0,
                    metadata=((REQUEST_ID_METADATA, request_id),))
            except grpc.RpcError as e:
                log.warning("abort on %s worker %s failed: %s", role, info.worker_id, e.code())
        return True

    def _next_attempt(self, request_id: str, old: RequestHandle, migration: int) -> RequestHandle:
        """The handle of request ``request_id``'s attempt after its ``migration``-th
        migration (its workers see :func:`router.migration.attempt_request_id`), registered
        in place of ``old``; an abort of ``old`` carries over."""
        new = RequestHandle(attempt_request_id(request_id, migration), old.fail_transfer_timeout_s)
        with self._lock:
            new.aborted = old.aborted
            self._table[request_id] = new
        return new

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._table.pop(request_id, None)
            since = self._since.pop(request_id, None)
        if since is not None and self.admission is not None:
            self.admission.left(time.monotonic() - since)


class ActiveRequest:
    """One registered request: iterate :meth:`responses` once; :meth:`cancel` from any thread.

    ``h`` is the handle of its current attempt; a migration replaces it
    (:meth:`RequestRouter._next_attempt`)."""

    def __init__(self, router: RequestRouter, prep: PreparedRequest, handle: RequestHandle) -> None:
        self.router = router
        self.prep = prep
        self.h = handle
        self.request_id = prep.request_id
        self.client_gone = False
        self.stats = RequestStats(router.metrics, router.gauges, len(prep.prompt_token_ids))
        self._cached_prompt_tokens: int | None = None  # from the first attempt whose prefill answered

    def discard(self) -> None:
        """Forget a request whose :meth:`responses` will never run (a sibling was refused)."""
        self.stats.close()
        self.router._forget(self.request_id)

    def cancel(self) -> None:
        """The client went away: cancel both worker calls (both workers free the blocks)."""
        self.client_gone = True
        self.h.cancel_calls()

    def responses(self) -> Iterator[router_pb2.GenerateResponse]:
        """The request's responses: one per token delta when streaming, one in total otherwise.

        Raises:
            RouterError: UNAVAILABLE (no live worker, or a worker failed or a KV transfer
                failed more often than ``max_migrations`` allows), CANCELLED (the client
                went away), or a worker's refusal (e.g. RESOURCE_EXHAUSTED).
        """
        with request_scope(self.request_id):
            try:
                yield from self._serve()
            except RouterError as e:
                self.stats.failed(e.code.name)
                log.info("request failed: %s", e)
                raise
            finally:
                self.stats.close()
                self.router._forget(self.request_id)

    def _serve(self) -> Iterator[router_pb2.GenerateResponse]:
        """Attempts until one ends the request: a worker failure migrates it (module
        docstring) with the same output assembler, so nothing is streamed twice."""
        prep = self.prep
        out = OutputAssembler(self.router.tokenizer, prep.request_id, prep.prompt_token_ids, prep.stop)
        avoid: set[str] = set()
        cause = ""
        for migration in itertools.count():
            try:
                yield from self._attempt(out, frozenset(avoid), cause)
                return
            except WorkerFailure as f:
                self._check_migratable(f, migration)
                avoid |= f.suspects
                cause = f"{f.code.name}: {f.message}"
                self._remember_cached_tokens()
                self.h = self.router._next_attempt(prep.request_id, self.h, migration + 1)
                self.router.metrics.inc("request_migrations", failed_role=f.role)
                log.warning("migrating request %s (migration %d of at most %d) after %s; resuming after %d "
                            "output tokens", prep.request_id, migration + 1, self.router.max_migrations, cause,
                            len(out.token_ids))

    def _check_migratable(self, f: WorkerFailure, migrations: int) -> None:
        """Raises :class:`RouterError` unless the request may migrate after ``f``."""
        view = self.router.placer.view
        for worker_id in f.lost:
            view.mark_unreachable(worker_id)
        if not f.migratable or self.h.aborted or self.client_gone:
            raise RouterError(f.code, f.message, f.retry_after_ms)
        if migrations >= self.router.max_migrations:
            if migrations == 0:  # migration disabled: the worker's own status
                raise RouterError(f.code, f.message, f.retry_after_ms)
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"failed after {migrations} migrations "
                              f"(max_migrations {self.router.max_migrations}): {f.code.name}: {f.message}")

    def _attempt(self, out: OutputAssembler, avoid: frozenset[str], cause: str):
        """Place the request (avoiding the workers that failed it) and relay one attempt.

        Raises:
            RouterError: no live worker, or an ending that is not a worker failure.
            WorkerFailure: a worker call failed.
        """
        prep, h = self.prep, self.h
        tokens = prep.prompt_token_ids + out.token_ids
        try:
            placement = place_waiting(lambda: self.router.placer.place(RequestContext(prep.request_id, tokens), avoid),
                                      MIGRATION_WAIT_S if cause else 0.0, lambda: self.client_gone or h.aborted)
        except NoWorkerError as e:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{e} (migrating after {cause})" if cause else str(e)) \
                from None
        h.prefill, h.decode = placement.prefill, placement.decode
        log.debug("placed: prefill %s, decode %s, %d prompt + %d earlier output tokens", h.prefill.worker_id,
                  h.decode.worker_id, len(prep.prompt_token_ids), len(out.token_ids))
        h.load = self.router.load.begin(h.prefill.worker_id, h.decode.worker_id, len(tokens))
        try:
            yield from self._relay(out)
        finally:
            h.load.end()

    def _relay(self, out: OutputAssembler) -> Iterator[router_pb2.GenerateResponse]:
        prep, h, stubs = self.prep, self.h, self.router.stubs
        meta = ((REQUEST_ID_METADATA, prep.request_id),)
        transfer_id = h.transfer_id = uuid.uuid4().hex
        wreq = attempt_request(prep.worker_request, h.request_id, out.token_ids)
        h.decode_stub = stubs.get("decode", h.decode.address)
        h.d_call = h.decode_stub.Reserve(worker_pb2.ReserveRequest(request=wreq, transfer_id=transfer_id),
                                         metadata=meta)
        if self.client_gone:
            h.cancel_calls()
        decode_finished = False
        try:
            first = next(h.d_call)
            self.stats.reserved()
            if h.aborted:
                h.cancel_calls()
                yield from self._final(out, common_pb2.FINISH_REASON_ABORT)
                self.stats.finished("abort")
                return
            h.p_future = stubs.get("prefill", h.prefill.address).Prefill.future(
                worker_pb2.PrefillRequest(request=wreq, transfer_id=transfer_id, destination=first.reservation),
                metadata=meta)
            h.p_future.add_done_callback(h.on_prefill_done)
            h.p_future.add_done_callback(h.load.prefill_finished)
            for ev in h.d_call:
                msg = out.add(ev.tokens)
                decode_finished = ev.tokens.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                self.stats.tokens(len(msg.token_ids))
                if out.finished:  # recorded before the client can see the end
                    self._settle_usage(out, msg)
                    self.stats.finished(_REASONS.get(out.finish_reason, "stop"))
                if prep.stream and (msg.token_ids or msg.text or out.finished):
                    yield msg
                if out.finished:
                    break
                if h.aborted:
                    self.stats.finished("abort")
                    yield from self._final(out, common_pb2.FINISH_REASON_ABORT)
                    break
        except grpc.RpcError as e:
            self._fail(e)
        if not out.finished:
            h.cancel_calls()
            raise closed_early(h.decode.role, h.decode.worker_id)
        if not decode_finished:
            h.d_call.cancel()  # stopped here (stop string / abort): the decode worker frees
        if not prep.stream:
            yield out.whole()

    def _remember_cached_tokens(self) -> None:
        """Keep the prompt tokens the failed attempt's prefill found cached, if it answered:
        usage reports the first prefill's cache hits, not those of a migration's."""
        fut = self.h.p_future
        if self._cached_prompt_tokens is None and fut is not None and fut.done() and not fut.cancelled() \
                and fut.exception() is None:
            self._cached_prompt_tokens = fut.result().cached_prompt_tokens

    def _settle_usage(self, out: OutputAssembler, msg) -> None:
        """Fill cached_prompt_tokens from the prefill worker's answer, which follows the
        decode side's acknowledgement by moments (waits at most 5 s); a migrated request
        reports its first answered prefill's (at most the prompt's length)."""
        cached = self._cached_prompt_tokens
        if cached is None:
            try:
                cached = min(self.h.p_future.result(timeout=5.0).cached_prompt_tokens, out.num_prompt)
            except Exception:  # noqa: BLE001 - failed/cancelled prefill: usage stays without cache info
                return
        out.cached_prompt_tokens = cached
        msg.usage.cached_prompt_tokens = cached

    def _final(self, out: OutputAssembler, reason: int):
        out.finish_reason = reason
        if self.prep.stream:
            yield router_pb2.GenerateResponse(request_id=self.prep.request_id, finish_reason=reason,
                                              usage=out.usage())

    def _fail(self, e: grpc.RpcError) -> None:
        """Map a failed decode stream onto the request's ending; always raises:
        :class:`RouterError` for the client's own endings, else :class:`WorkerFailure`
        (:func:`router.migration.classify` says whom it blames)."""
        h = self.h
        h.cancel_calls()
        if e.code() == grpc.StatusCode.CANCELLED and self.client_gone:
            raise RouterError(grpc.StatusCode.CANCELLED, "client cancelled")
        decode = Side(h.decode.role, h.decode.worker_id, e.code(), e.details() or "")
        prefill = Side(h.prefill.role, h.prefill.worker_id)
        if h.prefill_error is not None:
            code, details = status_of(h.prefill_error)
            prefill = Side(h.prefill.role, h.prefill.worker_id, code, details)
        failure = classify(decode, prefill)
        failure.retry_after_ms = retry_after_ms(e)
        raise failure

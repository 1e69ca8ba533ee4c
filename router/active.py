"""One admitted request on its way through the cluster: placement, the decode worker's
reservation and token stream, the prefill call, detokenization and migration after a worker
failure (the lifecycle is :mod:`router.core`'s module docstring, steps 2-4)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from pdcluster.v1 import common_pb2, router_pb2, worker_pb2
from router.errors import RouterError
from router.handle import RequestHandle, status_of
from router.migration import (
    MIGRATABLE_CODES,
    MIGRATION_WAIT_S,
    Side,
    WorkerFailure,
    attempt_request,
    classify,
    closed_early,
    place_waiting,
)
from router.output import OutputAssembler
from router.policy import NoWorkerError, RequestContext
from router.stats import RequestStats
from router.validation import PreparedRequest
from serving.logs import REQUEST_ID_METADATA, request_scope
from serving.rpc import retry_after_ms

if TYPE_CHECKING:
    from router.core import RequestRouter

log = logging.getLogger(__name__)

NO_WORKER_RETRY_AFTER_MS = 1000
PROMPT_LOGPROBS_WAIT_S = 30.0
"""How long the first tokens wait for the prefill worker's answer carrying the prompt logprobs (it
follows the KV's acknowledgement by moments; seconds)."""
"""The retry-after hint (gRPC ``retry-after-ms`` trailer; HTTP 503 ``Retry-After``) of a new request that
found no live worker of a role: the cluster controller replaces a dead worker within a few heartbeats,
so a client retrying every second gets in as soon as the replacement registers."""

_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
            common_pb2.FINISH_REASON_ABORT: "abort"}


class ActiveRequest:
    """One registered request: iterate :meth:`responses` once; :meth:`cancel` from any thread.

    ``h`` is the handle of its current attempt; a migration replaces it
    (:meth:`router.core.RequestRouter._next_attempt`). ``arrival``: when the request arrived
    (:meth:`router.start_lane.StartLane.arrived`, monotonic seconds)."""

    def __init__(self, router: RequestRouter, prep: PreparedRequest, handle: RequestHandle, arrival: float) -> None:
        self.router = router
        self.arrival = arrival
        self.prep = prep
        self.h = handle
        self.request_id = prep.request_id
        self.client_gone = False
        self.stats = RequestStats(router.metrics, router.gauges, len(prep.prompt_token_ids),
                                  prep.worker_request.sampling.max_tokens)
        self._cached_prompt_tokens: int | None = None  # from the first attempt whose prefill answered

    def discard(self, error: RouterError | None = None) -> None:
        """Forget a request whose :meth:`responses` will never run: a sibling was refused (not
        counted: the sibling's refusal is), or ``error`` ends it (counted in ``request_errors``)."""
        if error is not None:
            self.stats.failed(error.code.name)
        self.stats.close()
        self.router._forget(self.request_id)

    def cancel(self) -> None:
        """The client went away: cancel both worker calls (both workers free the blocks)."""
        self.client_gone = True
        self.h.cancel_calls()

    def cancel_calls_quietly(self) -> None:
        """Cancel the current attempt's worker calls (both workers free the blocks) after a failure
        on the router's side; a failure to cancel is logged, not raised."""
        try:
            self.h.cancel_calls()
        except Exception:  # noqa: BLE001 - already failing: the original error is the one to report
            log.exception("cancelling the worker calls of %s failed", self.request_id)

    def responses(self) -> Iterator[router_pb2.GenerateResponse]:
        """The request's responses: one per token delta when streaming, one in total otherwise.

        Raises:
            RouterError: UNAVAILABLE (no live worker, or a worker failed or a KV transfer
                failed more often than ``max_migrations`` allows), CANCELLED (the client
                went away), a worker's refusal (e.g. RESOURCE_EXHAUSTED), or INTERNAL (an
                unexpected error on the router's side, logged with its traceback).
        """
        with request_scope(self.request_id):
            try:
                yield from self._serve()
            except RouterError as e:
                self.stats.failed(e.code.name)
                log.info("request failed: %s", e)
                raise
            except Exception as e:  # a bug on the router's side: counted and answered, never a silent end
                self.stats.failed(grpc.StatusCode.INTERNAL.name)
                log.exception("request failed: INTERNAL: %s: %s", type(e).__name__, e)
                self.cancel_calls_quietly()
                raise RouterError(grpc.StatusCode.INTERNAL, f"internal error on the router: {type(e).__name__}: {e}") \
                    from e
            except GeneratorExit:  # the front door stopped reading: its client went away mid-stream
                self.cancel()  # also after the final message (a stop string's): the decode call may run on
                if not self.stats.ended:
                    self.stats.failed(grpc.StatusCode.CANCELLED.name)
                    log.info("request failed: CANCELLED: client cancelled (the stream was closed)")
                raise
            finally:
                self.stats.close()
                self.router._forget(self.request_id)

    def _serve(self) -> Iterator[router_pb2.GenerateResponse]:
        """Attempts until one ends the request: a worker failure migrates it (module
        docstring) with the same output assembler, so nothing is streamed twice."""
        prep = self.prep
        out = OutputAssembler(self.router.tokenizer, prep.request_id, prep.prompt_token_ids, prep.stop,
                              stop_token_ids=prep.worker_request.sampling.stop_token_ids,
                              include_stop=prep.include_stop_str_in_output, min_tokens=prep.min_tokens,
                              ignore_eos=prep.worker_request.sampling.ignore_eos,
                              skip_special_tokens=prep.skip_special_tokens)
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
            raise RouterError(f.code, f.client_message, f.retry_after_ms)
        if migrations >= self.router.max_migrations:
            if migrations == 0:  # migration disabled: the worker's own status
                raise RouterError(f.code, f.client_message, f.retry_after_ms)
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"failed after {migrations} migrations "
                              f"(max_migrations {self.router.max_migrations}): {f.code.name}: {f.message}")

    def _attempt(self, out: OutputAssembler, avoid: frozenset[str], cause: str):
        """Place the request (avoiding the workers that failed it) and relay one attempt.

        Raises:
            RouterError: no live worker, or an ending that is not a worker failure.
            WorkerFailure: a worker call failed.
        """
        prep, h = self.prep, self.h
        if self.client_gone or h.aborted:  # before placing: a sibling's client left, or an abort came
            yield from self._ended_by_client(out)
            return
        tokens = prep.prompt_token_ids + out.token_ids
        if cause:  # the registry now: a worker that withdrew as it failed the request (broken) is not chosen again
            self.router.placer.view.refresh()
        # the first placement takes its turn in the start lane (refusals of the burst first); a
        # migration's may wait for a worker and is never deferred behind arrivals
        turn = contextlib.nullcontext() if cause else self.router.lane.turn(self.arrival)
        try:
            with turn:
                placement = place_waiting(lambda: self.router.placer.place(RequestContext(prep.request_id, tokens),
                                                                           avoid),
                                          MIGRATION_WAIT_S if cause else 0.0, lambda: self.client_gone or h.aborted)
        except NoWorkerError as e:
            if self.client_gone or h.aborted:  # the wait gave up for the client, not for want of a worker
                yield from self._ended_by_client(out)
                return
            if cause:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{e} (migrating after {cause})") from None
            raise RouterError(grpc.StatusCode.UNAVAILABLE, str(e), NO_WORKER_RETRY_AFTER_MS) from None
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
                self.stats.finished("abort")  # recorded before the client can see the end
                yield from self._final(out, common_pb2.FINISH_REASON_ABORT)
                if not prep.stream:
                    yield out.whole()
                return
            h.p_future = stubs.get("prefill", h.prefill.address).Prefill.future(
                worker_pb2.PrefillRequest(request=wreq, transfer_id=transfer_id, destination=first.reservation),
                metadata=meta)
            h.p_future.add_done_callback(h.on_prefill_done)
            h.p_future.add_done_callback(h.load.prefill_finished)
            for ev in h.d_call:
                self._await_prompt_logprobs(out, ev.tokens)
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

    def _ended_by_client(self, out: OutputAssembler) -> Iterator[router_pb2.GenerateResponse]:
        """End a request that was not placed (again) because its client went away (CANCELLED) or
        aborted it (finish reason ABORT, counted as a success like any abort).

        Raises:
            RouterError: CANCELLED, the client went away.
        """
        if self.client_gone:
            raise RouterError(grpc.StatusCode.CANCELLED, "client cancelled")
        self.stats.finished("abort")
        yield from self._final(out, common_pb2.FINISH_REASON_ABORT)
        if not self.prep.stream:
            yield out.whole()

    def _await_prompt_logprobs(self, out: OutputAssembler, delta: worker_pb2.TokenDelta) -> None:
        """Before the request's first tokens are consumed, take its prompt logprobs from the prefill
        worker's answer, which follows the first token by moments (the assembler puts them on the
        first message). A prefill call that failed meanwhile (its worker
        died after the KV arrived) fails the attempt, so the request migrates before any token
        reached the client.

        Raises:
            WorkerFailure: the prefill call failed or did not answer within :data:`PROMPT_LOGPROBS_WAIT_S`.
        """
        if out.prompt_logprobs is not None or not delta.token_ids or \
                not self.prep.worker_request.sampling.HasField("prompt_logprobs"):
            return
        h = self.h
        try:
            out.set_prompt_logprobs(h.p_future.result(timeout=PROMPT_LOGPROBS_WAIT_S).prompt_logprobs)
        except Exception as e:  # noqa: BLE001 - any failure of the call: the attempt fails
            h.cancel_calls()
            code, details = status_of(e) if isinstance(e, grpc.RpcError) else (grpc.StatusCode.UNAVAILABLE, str(e))
            raise WorkerFailure(h.prefill.role, code if code in MIGRATABLE_CODES else grpc.StatusCode.UNAVAILABLE,
                                f"{h.prefill.role} worker {h.prefill.worker_id}: no prompt logprobs: "
                                f"{code.name}: {details}", frozenset({h.prefill.worker_id})) from None

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

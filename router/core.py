"""The router's request path, shared by the gRPC and the OpenAI-compatible HTTP front doors.

Lifecycle of one request (DESIGN.md "decode-led reservation, prefill push"):

1. :meth:`RequestRouter.start` holds a seat for it (or refuses it: the router is full), then
   validates and tokenizes it (:mod:`router.validation`) and registers its id (a duplicate of
   a running id is refused);
2. :meth:`ActiveRequest.responses` places it in its turn of the start lane, once the burst it
   came in has been refused (:mod:`router.start_lane`; :mod:`router.placement`: a decode worker D
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
4. it ends finished (stop, length), aborted (:meth:`RequestRouter.abort`: by its owner, the
   API key that started it), cancelled
   (:meth:`ActiveRequest.cancel`: the client went away; never migrated) or failed
   (:class:`RouterError`). Abort, cancel and a failure cancel both calls, which makes
   both workers free the request's blocks.

Admission (:mod:`router.admission`) refuses a request in :meth:`RequestRouter.start`, before
anything is allocated: at once when the router is full, after tokenization when its predicted
TTFT exceeds the SLO.

Errors are :class:`RouterError` with a gRPC status code; each front door maps them to
its own wire (gRPC status, HTTP status + OpenAI error body), with a retry-after hint where
the error carries one.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from pdcluster.v1 import router_pb2, worker_pb2
from router.active import ActiveRequest
from router.admission import Admission, Refused
from router.errors import RouterError
from router.handle import RequestHandle
from router.load import LoadTracker
from router.migration import DEFAULT_MAX_MIGRATIONS, attempt_request_id, check_max_migrations, first_attempt_id
from router.placement import Placer
from router.start_lane import StartLane
from router.stats import RouterGauges
from router.stubs import StubCache
from router.validation import InvalidRequest, PreparedRequest, RequestValidator, mint_request_id, request_id_problem
from serving.logs import REQUEST_ID_METADATA, ThrottledLog
from serving.metrics import ProcessMetrics

log = logging.getLogger(__name__)
_invalid = ThrottledLog(log, "requests refused (invalid)")  # one line a second under a storm of bad requests


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
        lane: where admitted requests wait for their placement's turn (:mod:`router.start_lane`;
            default: a lane of its own, told of arrivals only as this router sees them).

    Raises:
        ValueError: ``max_migrations`` outside ``[0, router.migration.MAX_MIGRATIONS_LIMIT]``.
    """

    def __init__(self, validator: RequestValidator, tokenizer, placer: Placer, load: LoadTracker,
                 metrics: ProcessMetrics, stubs: StubCache, admission: Admission | None = None,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, lane: StartLane | None = None) -> None:
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
        self._owners: dict[str, str] = {}  # request id -> who started it (an API key's digest; "": anyone)
        self._starting = 0  # admitted requests holding a seat, not yet registered
        self.lane = lane if lane is not None else StartLane()  # placements wait for bursts to be refused first

    def start(self, request: router_pb2.GenerateRequest, owner: str = "") -> ActiveRequest:
        """Admit, validate and register ``request``; nothing is allocated yet. A full router
        refuses it at once, before any work on it (registered requests and those being
        validated count); an admitted one holds its seat from then on. Its arrival is noted
        for the start lane (:mod:`router.start_lane`), in which it is placed. ``owner``: who
        may abort it by id (:meth:`abort`).

        Raises:
            RouterError: RESOURCE_EXHAUSTED with ``retry_after_ms`` (refused by admission: the
                router is full, or the predicted TTFT exceeds the SLO), INVALID_ARGUMENT (the
                message names the field or limit), ALREADY_EXISTS (a running request has this id).
        """
        self._name(request)
        arrival = self.lane.arrived()
        room = self.admission.room() if self.admission is not None else None
        with self._lock:
            held = len(self._table) + self._starting
            full = room is not None and held >= room.capacity
            if not full:
                self._starting += 1
        if full:
            self._refused(self.admission.queue_full(request.request_id, held, room))
        try:
            prep = self._prepare(request)
            handle = RequestHandle(first_attempt_id(prep.request_id))
            with self._lock:
                duplicate = prep.request_id in self._table
                if not duplicate:
                    self._table[prep.request_id] = handle
                    self._since[prep.request_id] = time.monotonic()
                    self._owners[prep.request_id] = owner
        finally:
            with self._lock:
                self._starting -= 1
        if duplicate:
            self.metrics.inc("request_errors", code=grpc.StatusCode.ALREADY_EXISTS.name)
            _invalid.info(prep.request_id, "request %s refused: ALREADY_EXISTS (a running request has its id)",
                          prep.request_id)
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {prep.request_id!r} is already running")
        return ActiveRequest(self, prep, handle, arrival)

    def _prepare(self, request: router_pb2.GenerateRequest) -> PreparedRequest:
        """Validate and tokenize ``request`` and check its predicted TTFT.

        Raises:
            RouterError: INVALID_ARGUMENT or RESOURCE_EXHAUSTED (``ttft_slo``); INTERNAL for any
                other exception (logged with its traceback).
        """
        try:
            prep = self.validator.prepare(request)
            if self.admission is not None:
                self.admission.check_ttft(prep.request_id, prep.prompt_token_ids)
            return prep
        except InvalidRequest as e:
            raise self._invalid_argument(request.request_id, str(e)) from None
        except Refused as e:
            self._refused(e)
        except Exception as e:  # noqa: BLE001 - a bug here answers INTERNAL, counted, never a raw exception
            log.exception("request %s: preparing it failed", request.request_id)
            self.metrics.inc("request_errors", code=grpc.StatusCode.INTERNAL.name)
            raise RouterError(grpc.StatusCode.INTERNAL, f"internal error while preparing the request "
                              f"({type(e).__name__}); the router's log has the details") from None

    def _name(self, request: router_pb2.GenerateRequest) -> None:
        """Give ``request`` an id every log line and answer can carry: minted when it has none; an
        invalid one (not printable ASCII, too long: it would forge log lines) is refused under a
        minted id, the bad one shown escaped and clipped in the message.

        Raises:
            RouterError: INVALID_ARGUMENT naming ``request_id``.
        """
        problem = request_id_problem(request.request_id) if request.request_id else None
        if request.request_id and problem is None:
            return
        request.request_id = mint_request_id()
        if problem is not None:
            raise self._invalid_argument(request.request_id, problem)

    def refuse_unparsable(self, reason: str) -> str:
        """Count and log a ``Generate`` request gRPC could not parse (refused with INVALID_ARGUMENT
        before it reached :meth:`start`); returns the id minted to name it."""
        request_id = mint_request_id()
        self._invalid_argument(request_id, reason)
        return request_id

    def refuse_invalid(self, request: router_pb2.GenerateRequest, message: str) -> RouterError:
        """Count and log an INVALID_ARGUMENT refusal a front door found before :meth:`start` (its
        request named first, as :meth:`start` names it); returns the error to answer."""
        try:
            self._name(request)
        except RouterError as e:
            return e
        return self._invalid_argument(request.request_id, message)

    def _invalid_argument(self, request_id: str, message: str) -> RouterError:
        """Count and log (throttled) an INVALID_ARGUMENT refusal of ``request_id``; returns its error."""
        self.metrics.inc("request_errors", code=grpc.StatusCode.INVALID_ARGUMENT.name)
        _invalid.info(request_id, "request %s refused: INVALID_ARGUMENT: %s", request_id, message)
        return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _refused(self, e: Refused) -> None:
        self.metrics.inc("request_errors", code=grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message, e.retry_after_ms) from None

    def abort(self, request_id: str, owner: str | None = None) -> bool:
        """Abort a running request (its stream ends with finish reason ABORT); returns
        whether it was found. With ``owner``, only a request that owner started: another
        one is not found (a client learns nothing of other clients' requests)."""
        with self._lock:
            handle = self._table.get(request_id)
            if handle is None or owner not in (None, self._owners.get(request_id)):
                return False
            handle.aborted = True
        calls = [(role, info, self.stubs.get(role, info.address).Abort.future(
                     worker_pb2.WorkerAbortRequest(request_id=handle.request_id), timeout=2.0,
                     metadata=((REQUEST_ID_METADATA, request_id),)))
                 for role, info in (("decode", handle.decode), ("prefill", handle.prefill)) if info is not None]
        for role, info, call in calls:  # both sent at once: an unresponsive worker delays the answer 2 s, not 4
            try:
                call.result()
            except grpc.RpcError as e:
                log.warning("abort on %s worker %s failed: %s", role, info.worker_id, e.code())
        return True

    def _next_attempt(self, request_id: str, old: RequestHandle, migration: int) -> RequestHandle:
        """The handle of request ``request_id``'s attempt after its ``migration``-th
        migration (its workers see :func:`router.migration.attempt_request_id`), registered
        in place of ``old``; an abort of ``old`` carries over."""
        new = RequestHandle(attempt_request_id(old.first_id, migration), old.fail_transfer_timeout_s, old.first_id)
        with self._lock:
            new.aborted = old.aborted
            self._table[request_id] = new
        return new

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._table.pop(request_id, None)
            since = self._since.pop(request_id, None)
            self._owners.pop(request_id, None)
        if since is not None and self.admission is not None:
            self.admission.left(time.monotonic() - since)

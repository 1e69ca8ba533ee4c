"""Request migration: which worker failures a request survives, and whom they are blamed on.

When a worker call of a request fails (:meth:`router.active.ActiveRequest._relay`),
:func:`classify` turns the decode stream's status and the prefill call's status (if
that call failed) into a :class:`WorkerFailure`:

1. the decode stream failed on its own (a transport error such as UNAVAILABLE "Socket
   closed" when the decode worker died, a failed decode step, or a stream the worker
   cut without a status it explains): the **decode** worker is blamed (and, for
   UNAVAILABLE, marked unreachable in the registry view);
2. the prefill call failed (the decode stream then ends because the KV never came:
   policy "error", or the router cancelled it): the **prefill** worker is blamed (and
   marked unreachable when it was lost, not just its transfer); a prefill worker that
   could not deliver the KV ("KV transfer failed") casts suspicion on the decode
   worker too;
3. the decode worker reports the KV transfer failed (lease expired, corrupt chunk)
   with no prefill failure known: both workers are suspects, the prefill side blamed.

A failure whose status is in :data:`MIGRATABLE_CODES` is migrated: the router cancels
both calls (both workers free the request's blocks) and resumes the request on a new
placement that avoids the suspects, with the tokens already streamed as
``WorkerRequest.output_token_ids`` (prefilled again after the prompt, the prompt part
from the prefix cache), so the client sees neither an error nor a repeated or missing
token. Client-caused endings (cancel, abort) never reach this module, and a refusal
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS, ...) is not retried. After
``max_migrations`` migrations (``pdcluster up --max-migrations``) the request fails
with UNAVAILABLE naming the last cause.

A migrating request that finds no live worker of a role (the only decode worker died, and
the cluster controller is restarting it) waits up to :data:`MIGRATION_WAIT_S` seconds for
one to register (:func:`place_waiting`) instead of failing at once.

Each attempt runs under its own worker-side request id (:func:`first_attempt_id`,
:func:`attempt_request_id`): the client's id, a nonce of this admission and the
migration's number, so a resumed request never collides with its own earlier attempt
still being torn down on a worker that serves it again, nor a client that reuses an id at
once (a retry after a cancel) with its earlier request (vLLM makes its internal request
ids unique the same way). The workers' log lines carry the client's id (the
``x-request-id`` metadata), so logs still join on it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdcluster.v1 import worker_pb2

DEFAULT_MAX_MIGRATIONS = 3
# A restarted worker registers ~5-10 s after its death on a small CPU machine; a hung one is killed
# after 20 s without a heartbeat and then restarts: 35 s seen on a loaded 2-core machine.
MIGRATION_WAIT_S = 60.0
MAX_MIGRATIONS_LIMIT = 100

#: Statuses of a failed worker call that a request survives by migrating.
MIGRATABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
})
_KV = "KV transfer"


def check_max_migrations(n: int) -> None:
    """Raises:
        ValueError: ``n`` is not an int in ``[0, MAX_MIGRATIONS_LIMIT]`` (the message names
            ``max_migrations`` and the limit)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_MIGRATIONS_LIMIT:
        raise ValueError(f"max_migrations must be an integer in [0, {MAX_MIGRATIONS_LIMIT}], got {n!r}")


def first_attempt_id(request_id: str) -> str:
    """The request id the workers see for the first attempt of the client's ``request_id``:
    ``<request_id>/<8 hex digits>``, new at every admission (at most 9 characters more than the
    client's id)."""
    return f"{request_id}/{uuid.uuid4().hex[:8]}"


def attempt_request_id(first_id: str, migration: int) -> str:
    """The request id the workers see for the request's ``migration``-th migration (0: the
    first attempt's id, ``first_id`` from :func:`first_attempt_id`)."""
    return first_id if migration == 0 else f"{first_id}/migration-{migration}"


def attempt_request(wreq: worker_pb2.WorkerRequest, worker_request_id: str,
                    output_token_ids: list[int]) -> worker_pb2.WorkerRequest:
    """``wreq`` as one attempt's workers see it: under ``worker_request_id``, resuming after
    the ``output_token_ids`` already streamed (``wreq`` itself for a first attempt)."""
    if not output_token_ids and worker_request_id == wreq.request_id:
        return wreq
    resumed = worker_pb2.WorkerRequest()
    resumed.CopyFrom(wreq)
    resumed.request_id = worker_request_id
    resumed.output_token_ids[:] = output_token_ids
    return resumed


class WorkerFailure(Exception):
    """A worker call of one attempt failed.

    Attributes:
        role: the blamed worker's registry role (``decode``, ``prefill`` or ``colocated``;
            the metric label of the migration).
        code: the failed call's gRPC status.
        message: the cause, naming the blamed worker.
        suspects: worker ids a new placement avoids.
        lost: worker ids to mark unreachable in the registry view now.
        retry_after_ms: the failed call's retry-after hint, if it carried one (a worker's
            RESOURCE_EXHAUSTED refusal), for the client's error.
        details: the failed call's own status details (without the worker's name).
    """

    def __init__(self, role: str, code: grpc.StatusCode, message: str, suspects: frozenset[str],
                 lost: frozenset[str] = frozenset(), details: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.role = role
        self.code = code
        self.message = message
        self.details = details
        self.suspects = suspects
        self.lost = lost
        self.retry_after_ms: int | None = None

    @property
    def client_message(self) -> str:
        """The message for the client: a worker's INVALID_ARGUMENT refusal (a request field the
        router cannot check, e.g. a structured output that does not compile) is the worker's own
        message, which names the field as the router's refusals do; anything else names the worker."""
        return self.details if self.code == grpc.StatusCode.INVALID_ARGUMENT and self.details else self.message

    @property
    def migratable(self) -> bool:
        """Whether the request may resume elsewhere after this failure."""
        return self.code in MIGRATABLE_CODES


@dataclass(frozen=True)
class Side:
    """One worker call of an attempt: the worker (``role``, ``worker_id``) and, if the
    call failed, its status (``code`` None: it did not fail)."""

    role: str
    worker_id: str
    code: grpc.StatusCode | None = None
    details: str = ""


def classify(decode: Side, prefill: Side) -> WorkerFailure:
    """The failure of an attempt whose decode stream failed with ``decode.code`` (rules 1-3
    of the module docstring); ``prefill.code`` is set when the prefill call failed too."""
    d_code, d_details = decode.code or grpc.StatusCode.UNKNOWN, decode.details
    decode_own = _KV not in d_details and (d_code != grpc.StatusCode.CANCELLED or prefill.code is None)
    if decode_own:
        lost = frozenset({decode.worker_id}) if d_code == grpc.StatusCode.UNAVAILABLE else frozenset()
        return WorkerFailure(decode.role, d_code, f"{decode.role} worker {decode.worker_id}: {d_details}",
                             frozenset({decode.worker_id}), lost, d_details)
    both = frozenset({decode.worker_id, prefill.worker_id})
    if prefill.code is not None:
        undelivered = f"{_KV} failed" in prefill.details
        lost = frozenset() if undelivered or prefill.code != grpc.StatusCode.UNAVAILABLE \
            else frozenset({prefill.worker_id})
        return WorkerFailure(prefill.role, prefill.code, f"{prefill.role} worker {prefill.worker_id}: "
                             f"{prefill.details}", both if undelivered else frozenset({prefill.worker_id}), lost,
                             prefill.details)
    return WorkerFailure(prefill.role, d_code, f"{decode.role} worker {decode.worker_id}: {d_details}", both,
                         details=d_details)


def closed_early(role: str, worker_id: str) -> WorkerFailure:
    """A decode stream that ended without a finish reason and without an error."""
    return WorkerFailure(role, grpc.StatusCode.UNAVAILABLE,
                         f"{role} worker {worker_id} closed the stream before finishing", frozenset({worker_id}))


def place_waiting(place: Callable[[], object], wait_s: float, give_up: Callable[[], bool], poll_s: float = 0.25):
    """``place()``, retried every ``poll_s`` seconds for up to ``wait_s`` seconds while it raises
    :class:`router.policy.NoWorkerError` (and ``give_up()`` stays false: the client went away
    or aborted); returns its placement.

    Raises:
        router.policy.NoWorkerError: still no worker after ``wait_s`` seconds (at once when 0).
    """
    from router.policy import NoWorkerError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return place()
        except NoWorkerError:
            if time.monotonic() >= deadline or give_up():
                raise
            time.sleep(poll_s)

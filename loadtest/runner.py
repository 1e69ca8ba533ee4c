"""Send a request plan to one server and record every request's token timestamps.

The server is a pdcluster router over gRPC, or any OpenAI-compatible HTTP server
(:mod:`loadtest.backends`), so the same workload replays against pdcluster and vLLM.

Open loop (default): each request is sent at its planned arrival time from a thread
pool, so slow responses never delay later arrivals (a send later than planned, e.g.
when ``max_inflight`` threads are busy, shows as ``max_send_lag_ms``). Closed loop
(``concurrency`` set): that many clients each send their next request as soon as the
previous one ends, ignoring arrival times.

Bounds: no request is sent after ``duration_s`` seconds; requests still running
``drain_timeout_s`` seconds after sending stopped are cancelled and recorded as
``CANCELLED``; every stream also has a ``request_timeout_s`` gRPC deadline. Every sent
request yields exactly one :class:`RequestRecord`; the runner raises if one cannot be
accounted for. Only ``address`` is contacted.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from loadtest.backends import BACKENDS, BackendError, open_session
from loadtest.records import OK, RequestRecord
from loadtest.workload import PlannedRequest

_CANCEL_GRACE_S = 10.0


@dataclass(frozen=True)
class RunConfig:
    """How to send. Times in seconds; ``api_key``: the server's API key (grpc: ``authorization``
    metadata, openai: the SDK's ``api_key``), never written to the run's summary; ``tls_ca``: a
    PEM CA file verifying a TLS server (grpc: a TLS channel; openai: an ``https://`` base URL).

    Raises:
        ValueError: from ``__post_init__`` on an invalid value.
    """

    address: str
    backend: str = "grpc"
    concurrency: int | None = None
    duration_s: float = 300.0
    drain_timeout_s: float = 60.0
    request_timeout_s: float = 300.0
    ready_timeout_s: float = 30.0
    max_inflight: int = 512
    temperature: float = 0.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    api_key: str | None = field(default=None, repr=False)
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "openai":
            if not self.address.startswith(("http://", "https://")):
                raise ValueError(f"the openai backend needs a base URL (http://HOST:PORT), got {self.address!r}")
        else:
            host, sep, port = self.address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"address must be HOST:PORT, got {self.address!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not (self.duration_s > 0 and self.drain_timeout_s > 0 and self.request_timeout_s > 0
                and self.ready_timeout_s > 0):
            raise ValueError("duration_s, drain_timeout_s, request_timeout_s and ready_timeout_s must be > 0")
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


@dataclass(frozen=True)
class Counters:
    """Live counters: requests sent / completed / failed / in flight, output tokens received."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def inflight(self) -> int:
        return self.sent - self.completed - self.failed


@dataclass
class RunResult:
    """Records in plan order; ``sent`` as counted at send time; ``not_sent``: planned
    requests skipped by the duration limit or an interrupt; ``duration_s``: run start ->
    last stream end (seconds)."""

    records: list[RequestRecord]
    sent: int
    not_sent: int
    duration_s: float
    interrupted: bool = False


class LoadRunner:
    """Runs ``plan`` (with its ``prompts``, token ids per request) against ``cfg.address``.

    ``on_request_end(counters)`` is called (from worker threads) after each request ends.
    """

    def __init__(self, cfg: RunConfig, plan: Sequence[PlannedRequest], prompts: Sequence[Sequence[int]],
                 on_request_end: Callable[[Counters], None] | None = None):
        if len(plan) != len(prompts):
            raise ValueError("plan and prompts differ in length")
        self.cfg, self.plan, self.prompts = cfg, list(plan), list(prompts)
        self._on_end = on_request_end
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._streams: dict[int, object] = {}
        self._records: list[RequestRecord] = []
        self._sent = self._completed = self._failed = self._tokens = 0
        self._t0 = 0.0
        self._next = 0

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def counters(self) -> Counters:
        """A consistent snapshot of the live counters."""
        with self._lock:
            return Counters(self._sent, self._completed, self._failed, self._tokens,
                            self._now() if self._t0 else 0.0)

    def _send(self, client, req: PlannedRequest, scheduled_s: float) -> None:
        with self._lock:
            self._sent += 1
        rec = RequestRecord(req.index, f"lt-{self.cfg.run_id}-{req.index}", scheduled_s, self._now(),
                            req.input_tokens, req.output_tokens)
        stream = None
        try:
            stream = client.stream(self.prompts[req.index], req.output_tokens, self.cfg.temperature, rec.request_id)
            with self._lock:
                self._streams[req.index] = stream
            if self._stop.is_set():
                stream.cancel()
            finish = ""
            for chunk in stream:
                if chunk.num_tokens:
                    now = self._now()
                    rec.token_times_s.extend([now] * chunk.num_tokens)
                    with self._lock:
                        self._tokens += chunk.num_tokens
                finish = chunk.finish_reason or finish
            rec.finish_reason = finish or "UNSPECIFIED"
            if stream.cancelled:
                rec.status, rec.error = "CANCELLED", "cancelled by the load tester (drain timeout or interrupt)"
            elif rec.finish_reason not in ("STOP", "LENGTH"):
                rec.status, rec.error = rec.finish_reason, "stream ended without STOP or LENGTH"
        except BackendError as exc:
            rec.status, rec.error = exc.status, str(exc)
        except Exception as exc:  # noqa: BLE001 - recorded as a failure, never lost
            rec.status, rec.error = "CLIENT_ERROR", repr(exc)
        finally:
            self._record(rec, req.index)

    def _record(self, rec: RequestRecord, index: int) -> None:
        rec.end_s = self._now()
        with self._lock:
            self._streams.pop(index, None)
            self._records.append(rec)
            if rec.status == OK:
                self._completed += 1
            else:
                self._failed += 1
        if self._on_end is not None:
            self._on_end(self.counters())

    def _open_loop(self, client, pool: ThreadPoolExecutor, futures: list[Future]) -> None:
        for req in self.plan:
            if req.arrival_s > self.cfg.duration_s or self._now() > self.cfg.duration_s:
                return
            delay = req.arrival_s - self._now()
            if delay > 0 and self._stop.wait(delay):
                return
            futures.append(pool.submit(self._send, client, req, req.arrival_s))
            self._next += 1

    def _closed_worker(self, client) -> None:
        while not self._stop.is_set() and self._now() <= self.cfg.duration_s:
            with self._lock:
                if self._next >= len(self.plan):
                    return
                req = self.plan[self._next]
                self._next += 1
            self._send(client, req, self._now())

    def _cancel_all(self) -> None:
        self._stop.set()
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.cancel()

    def run(self) -> RunResult:
        """Send the plan and wait for every request to end.

        Raises:
            TimeoutError: the router is not SERVING within ``ready_timeout_s``.
            RuntimeError: requests still running after being cancelled (a stuck client).
        """
        cfg = self.cfg
        interrupted = False
        workers = cfg.concurrency or min(cfg.max_inflight, max(1, len(self.plan)))
        client = open_session(cfg.backend, cfg.address, cfg.request_timeout_s, cfg.api_key, cfg.tls_ca)
        with contextlib.closing(client), \
                ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loadtest") as pool:
            client.wait_ready(cfg.ready_timeout_s)
            futures: list[Future] = []
            self._t0 = time.perf_counter()
            try:
                if cfg.concurrency:
                    futures = [pool.submit(self._closed_worker, client) for _ in range(cfg.concurrency)]
                    wait(futures, timeout=max(0.0, cfg.duration_s - self._now()))
                else:
                    self._open_loop(client, pool, futures)
                sending_ended = min(self._now(), cfg.duration_s)
                wait(futures, timeout=max(0.0, sending_ended + cfg.drain_timeout_s - self._now()))
            except KeyboardInterrupt:
                interrupted = True
            self._cancel_all()
            _, stuck = wait(futures, timeout=_CANCEL_GRACE_S)
            if stuck:
                raise RuntimeError(f"{len(stuck)} request thread(s) still running {_CANCEL_GRACE_S}s after cancel")
        with self._lock:
            records = sorted(self._records, key=lambda r: r.index)
            sent = self._sent
        duration = max((r.end_s for r in records if r.end_s is not None), default=0.0)
        return RunResult(records, sent, len(self.plan) - self._next, duration, interrupted)

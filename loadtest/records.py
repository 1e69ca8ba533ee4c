"""Per-request records of a load test (client-side timestamps).

All times are seconds since the run's start (``time.perf_counter`` based). A request
whose stream ended normally with ``finish_reason`` STOP or LENGTH has status ``"OK"``;
any other outcome is a failure whose status is the gRPC status code name
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``CANCELLED`` ...), ``"ABORT"`` (the server
finished it with ``FINISH_REASON_ABORT``) or ``"CLIENT_ERROR"`` (an exception in the
load tester itself; ``error`` holds it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

OK = "OK"


@dataclass
class RequestRecord:
    """One sent request.

    ``scheduled_s``: planned arrival; ``arrival_s``: when it was sent; ``token_times_s``:
    one receive time per output token (tokens of one streamed chunk share its time);
    ``end_s``: when the stream ended (success or failure).
    """

    index: int
    request_id: str
    scheduled_s: float
    arrival_s: float
    input_tokens: int
    expected_output_tokens: int
    token_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    status: str = OK
    error: str = ""
    finish_reason: str = ""

    @property
    def ok(self) -> bool:
        """The request completed (stream ended with STOP or LENGTH)."""
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        """Tokens received."""
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival -> first token (seconds); ``None`` without tokens."""
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: arrival -> last token (seconds); ``None`` without tokens."""
        return self.token_times_s[-1] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1), in
        seconds (vLLM benchmarks/serve.py); ``None`` with fewer than 2 tokens."""
        n = self.output_tokens
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n >= 2 else None

    @property
    def itls_s(self) -> list[float]:
        """Every gap between consecutive output tokens (seconds; 0 inside one chunk)."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        """Inverse of :meth:`as_dict` (a line of ``requests.jsonl``); the derived keys are recomputed.

        Raises:
            TypeError: a field without a default is missing.
        """
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def as_dict(self) -> dict:
        """JSON-ready dict with the derived ``ttft_s``, ``tpot_s``, ``e2e_s`` (``None`` when undefined)."""
        d = asdict(self)
        d.update(ok=self.ok, output_tokens=self.output_tokens, ttft_s=self.ttft_s, tpot_s=self.tpot_s,
                 e2e_s=self.e2e_s)
        return d

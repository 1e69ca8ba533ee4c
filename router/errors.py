"""The router's request errors, shared by its request path and both front doors."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """A request failed; ``code`` is its gRPC status, ``message`` names the cause,
    ``retry_after_ms`` (RESOURCE_EXHAUSTED refusals, UNAVAILABLE for want of a live worker) when a retry
    may succeed."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms

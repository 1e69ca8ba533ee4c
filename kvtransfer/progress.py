"""Layer-by-layer readiness of one request's KV, shared by the compute loop and a sender.

The prefill worker starts a request's transfer at the beginning of its final
prefill step and reports each layer as soon as its KV is written; the sender
ships a chunk once all its layers are ready, so layer ``l`` travels while layer
``l + 1`` computes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvtransfer.errors import KvTransferError


class LayerProgress:
    """Thread-safe progress of one request's KV: layers ready, then the first token.

    Producer (one thread): :meth:`layer_done` for layers in increasing order,
    then :meth:`finish`; or :meth:`fail` at any time. Consumers (any threads):
    :meth:`wait_layers` and :meth:`wait_finished`. After ``finish`` every layer
    counts as ready; after ``fail`` every wait raises.

    Times are ``time.monotonic()`` seconds: :attr:`ready_times` (per layer,
    ``None`` until ready; ``finish`` stamps the layers it implies) and
    :attr:`finished_at`.

    Args:
        num_layers: layers of the model (>= 1).

    Raises:
        ValueError: ``num_layers`` < 1.
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._layers_ready = 0
        self._ready_times: list[float | None] = [None] * num_layers
        self._finished: tuple[int, dict[Any, Any] | None] | None = None
        self._finished_at: float | None = None
        self._error: str | None = None

    @classmethod
    def ready(
        cls, num_layers: int, first_token_id: int, first_token_logprobs: dict[Any, Any] | None = None
    ) -> LayerProgress:
        """A progress already finished: the send-after-compute case."""
        p = cls(num_layers)
        p.finish(first_token_id, first_token_logprobs)
        return p

    @property
    def layers_ready(self) -> int:
        """Layers ``[0, layers_ready)`` are ready (``num_layers`` once finished)."""
        with self._cond:
            return self._layers_ready

    @property
    def ready_times(self) -> list[float | None]:
        """Monotonic time each layer became ready (``None``: not yet); a copy."""
        with self._cond:
            return list(self._ready_times)

    @property
    def finished_at(self) -> float | None:
        """Monotonic time of :meth:`finish`, or ``None``."""
        with self._cond:
            return self._finished_at

    @property
    def error(self) -> str | None:
        """The reason given to :meth:`fail`, or ``None``."""
        with self._cond:
            return self._error

    def layer_done(self, layer: int) -> None:
        """Layers ``[0, layer]`` are ready. Ignored after :meth:`fail` or :meth:`finish`.

        Raises:
            ValueError: ``layer`` outside ``[0, num_layers)`` or below a layer
                already reported.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must lie in [0, {self.num_layers}), got {layer}")
        with self._cond:
            if self._error is not None or self._finished is not None:
                return
            if layer + 1 < self._layers_ready:
                raise ValueError(f"layer {layer} reported after layer {self._layers_ready - 1}")
            self._mark_ready(layer + 1, time.monotonic())

    def finish(self, first_token_id: int, first_token_logprobs: dict[Any, Any] | None = None) -> None:
        """All layers are ready and the first token is sampled. Ignored after :meth:`fail` or a first finish.

        ``first_token_logprobs`` is not checked here; a sender that cannot
        encode it raises from its ``send`` (see :meth:`KvSender.send`).
        """
        with self._cond:
            if self._error is not None or self._finished is not None:
                return
            now = time.monotonic()
            self._mark_ready(self.num_layers, now)
            self._finished = (int(first_token_id), first_token_logprobs)
            self._finished_at = now
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """The producer gave up (step failed, request aborted); waiters raise. Ignored after finish."""
        with self._cond:
            if self._error is not None or self._finished is not None:
                return
            self._error = reason or "producer failed"
            self._cond.notify_all()

    def wait_layers(self, layer_end: int, timeout_s: float) -> None:
        """Block until layers ``[0, layer_end)`` are ready.

        Args:
            layer_end: 1 .. ``num_layers``.
            timeout_s: seconds to wait at most (<= 0: just check).

        Raises:
            KvTransferError: :meth:`fail` was called, or the timeout passed
                (``transfer_id`` is ``""``; senders re-raise with theirs).
            ValueError: ``layer_end`` outside ``[1, num_layers]``.
        """
        if not 1 <= layer_end <= self.num_layers:
            raise ValueError(f"layer_end must lie in [1, {self.num_layers}], got {layer_end}")
        self._wait(lambda: self._layers_ready >= layer_end, timeout_s, f"layers [0, {layer_end})")

    def wait_finished(self, timeout_s: float) -> tuple[int, dict[Any, Any] | None]:
        """Block until :meth:`finish`; returns ``(first_token_id, first_token_logprobs)``.

        Raises:
            KvTransferError: :meth:`fail` was called, or the timeout passed.
        """
        self._wait(lambda: self._finished is not None, timeout_s, "the first token")
        assert self._finished is not None
        return self._finished

    def _mark_ready(self, layers: int, now: float) -> None:
        for i in range(self._layers_ready, layers):
            self._ready_times[i] = now
        self._layers_ready = max(self._layers_ready, layers)
        self._cond.notify_all()

    def _wait(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while True:
                if self._error is not None:
                    raise KvTransferError("", f"producer failed: {self._error}")
                if done():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KvTransferError("", f"timed out after {timeout_s:.3g}s waiting for {what}")
                self._cond.wait(left)

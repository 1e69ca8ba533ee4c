"""Per-transfer state: the ordered :class:`TransferState` enum and a bounded table of it."""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict


class TransferState(enum.IntEnum):
    """Where one KV transfer stands, ordered like SGLang's ``KVPoll``.

    ``FAILED`` is lowest so ``state < TransferState.SUCCESS`` reads "not done
    yet or failed"; ``state == SUCCESS`` is the only state that lets a decode
    worker run the request.
    """

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def is_terminal(self) -> bool:
        """True for ``FAILED`` and ``SUCCESS`` (no further transition)."""
        return self in (TransferState.FAILED, TransferState.SUCCESS)


class TransferStateTable:
    """Thread-safe ``transfer_id -> TransferState`` map for non-blocking ``poll()``.

    In-flight entries are always kept; finished ones (``FAILED``/``SUCCESS``)
    are evicted oldest-first once the table holds more than ``history``
    entries, so a long-running worker does not grow without bound.

    Args:
        history: entries kept before finished ones are evicted (>= 1).

    Raises:
        ValueError: ``history`` < 1.
    """

    def __init__(self, history: int = 4096) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self._history = history
        self._states: OrderedDict[str, TransferState] = OrderedDict()
        self._lock = threading.Lock()

    def set(self, transfer_id: str, state: TransferState) -> None:
        """Record ``state`` for ``transfer_id`` (most recent entry last)."""
        with self._lock:
            self._states[transfer_id] = state
            self._states.move_to_end(transfer_id)
            if len(self._states) > self._history:
                self._evict_finished()

    def get(self, transfer_id: str) -> TransferState:
        """Current state of ``transfer_id``.

        Raises:
            KeyError: the id was never recorded or has been evicted.
        """
        with self._lock:
            return self._states[transfer_id]

    def _evict_finished(self) -> None:
        excess = len(self._states) - self._history
        for tid in [t for t, s in self._states.items() if s.is_terminal][:excess]:
            del self._states[tid]

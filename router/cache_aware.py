"""Cache-aware choice of a prefill worker.

Score of a worker = the prompt tokens it would have to compute (those past its
longest cached prefix, from the blocks it publishes: :mod:`serving.cache_index`)
plus the prompt tokens the router has already sent it and not yet seen finish
(its queue). The lowest score wins; ties go to the most free KV blocks. This is
the "expected prefill work" rule of SGLang's cache-aware router and of Mooncake's
KVCache-centric scheduler (Qin et al., FAST'25), with the queue measured in tokens.
"""

from __future__ import annotations

import threading
from collections import Counter

from common.prefix_hash import block_hashes
from router.policy import NoWorkerError
from serving.cache_index import CacheIndexView
from serving.registry import WorkerInfo, WorkerLoadSnapshot

Candidate = tuple[WorkerInfo, WorkerLoadSnapshot]


class QueuedTokens:
    """Prompt tokens in flight per prefill worker, as the router sent them (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: Counter[str] = Counter()

    def add(self, worker_id: str, tokens: int) -> None:
        with self._lock:
            self._n[worker_id] += tokens

    def done(self, worker_id: str, tokens: int) -> None:
        with self._lock:
            self._n[worker_id] -= tokens
            if self._n[worker_id] <= 0:
                del self._n[worker_id]

    def get(self, worker_id: str) -> int:
        with self._lock:
            return self._n[worker_id]


def cached_prefix_tokens(prompt: list[int], meta: dict, hashes: set[bytes]) -> int:
    """Tokens of ``prompt`` covered by the longest run of leading blocks in ``hashes``."""
    size = int(meta["block_size"])
    n = 0
    for h in block_hashes(prompt, size, meta["model_id"]):
        if h not in hashes:
            break
        n += size
    return n


def choose_prefill(candidates: list[Candidate], prompt: list[int], index: CacheIndexView,
                   queued: QueuedTokens) -> tuple[WorkerInfo, int]:
    """The worker with the least expected prefill work; returns it and its cached tokens.

    Raises:
        NoWorkerError: no candidate.
    """
    candidates = [c for c in candidates if not c[1].draining]
    if not candidates:
        raise NoWorkerError("no live prefill worker")
    best = None
    for info, load in candidates:
        entry = index.get(info.worker_id)
        cached = cached_prefix_tokens(prompt, *entry) if entry else 0
        score = (len(prompt) - cached + queued.get(info.worker_id), -load.num_free_blocks, info.worker_id)
        if best is None or score < best[0]:
            best = (score, info, cached)
    return best[1], best[2]

"""The ``cache_aware`` policy: prefill workers by least expected prefill work.

Score of a prefill worker = the prompt tokens it would have to compute (those past
its longest cached prefix, from the blocks it publishes: :mod:`serving.cache_index`)
plus the prompt tokens the router has already sent it and not yet seen finish (its
queue, :meth:`router.load.LoadTracker.queued_tokens`). The lowest score wins; ties go
to the most free KV blocks. This is the "expected prefill work" rule of SGLang's
cache-aware router and of Mooncake's KVCache-centric scheduler (Qin et al., FAST'25),
with the queue measured in tokens. Decode and colocated workers are chosen as by
:class:`router.policy.LeastLoaded`.
"""

from __future__ import annotations

from common.prefix_hash import block_hashes
from router.policy import Candidate, Choice, LeastLoaded, Policy, RequestContext, Signals


def cached_prefix_tokens(prompt: list[int], meta: dict, hashes: set[bytes]) -> int:
    """Tokens of ``prompt`` covered by the longest run of leading blocks in ``hashes``."""
    size = int(meta["block_size"])
    n = 0
    for h in block_hashes(prompt, size, meta["model_id"]):
        if h not in hashes:
            break
        n += size
    return n


class CacheAware(Policy):
    """Least expected prefill work for the ``prefill`` role, least loaded for the others.

    Raises:
        ValueError: ``signals`` has no cache index.
    """

    needs_cache_index = True

    def __init__(self, signals: Signals) -> None:
        if signals.cache_index is None:
            raise ValueError("the cache_aware policy needs the prefill workers' cache index")
        super().__init__(signals)
        self._least_loaded = LeastLoaded(signals)

    def pick(self, role: str, candidates: list[Candidate], request: RequestContext) -> Choice:
        if role != "prefill":
            return self._least_loaded.pick(role, candidates, request)
        prompt = request.prompt_token_ids
        best = None
        for info, load in candidates:
            entry = self.signals.cache_index.get(info.worker_id)
            cached = cached_prefix_tokens(prompt, *entry) if entry else 0
            score = (len(prompt) - cached + self.signals.load.queued_tokens(info.worker_id),
                     -load.num_free_blocks, info.worker_id)
            if best is None or score < best[0]:
                best = (score, Choice(info, cached))
        return best[1]

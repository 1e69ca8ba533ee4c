"""KV block manager of a decode worker (nano-vllm's ``BlockManager``, vLLM v1's ``KVCacheManager``).

It owns the decode worker's :class:`engine.block_pool.BlockPool` and every rule about
blocks; the scheduler (:mod:`decode_worker.scheduler`) owns the request state machine
and asks it, on the loop thread only, whether blocks fit and for blocks:

* **Admission watermark** (:meth:`DecodeKvManager.can_allocate`): a request is
  admitted or resumed only when its blocks plus one token of growth fit while
  ``watermark_blocks`` (``SchedulerConfig.watermark`` of the usable blocks, rounded
  down) stay free, so running requests can grow before anything is preempted. An idle
  pool (no block held) ignores the watermark: a request that fits the pool always runs.
* **Transfer reservations**: blocks handed to a transfer still in flight are held
  (out of the free list, so admission counts them as used) and accounted per request
  in :attr:`DecodeKvManager.num_in_transfer` until the KV lands, the request keeps
  them to rebuild its KV here, or they are freed.
* **Growth** (:meth:`DecodeKvManager.grow`): one more block when a request's newest
  token starts a new block. The watermark rules only admission: growth may use the
  blocks it kept free.
* **Preemption choice** (:meth:`DecodeKvManager.choose_victim`): when growth finds the
  pool empty, the most recently admitted running request gives its blocks back
  (vLLM's recompute preemption order).

Block tables are :attr:`engine.request.Request.block_table` lists; this manager is the
only code that fills or empties them. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import BlockPool, blocks_needed
from engine.config import CacheConfig
from engine.request import Request


class DecodeKvManager:
    """Blocks of one decode worker's KV cache.

    Args:
        cache: pool geometry (``num_blocks`` blocks of ``block_size`` tokens; block 0
            is the null block and never handed out).
        watermark: share of the usable blocks kept free at admission, in ``[0, 1)``
            (``SchedulerConfig.watermark``).
    """

    def __init__(self, cache: CacheConfig, watermark: float) -> None:
        self.block_size = cache.block_size
        self._pool = BlockPool(cache.num_blocks)
        self.watermark_blocks = int(watermark * self._pool.num_usable)
        self._in_transfer: dict[str, int] = {}  # request id -> blocks reserved for its transfer

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self._pool.num_usable

    @property
    def num_free(self) -> int:
        """Blocks in the free list."""
        return self._pool.num_free

    @property
    def num_in_transfer(self) -> int:
        """Blocks reserved for transfers whose KV has not landed yet."""
        return sum(self._in_transfer.values())

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a request holding no blocks may take blocks for ``num_tokens`` tokens
        now: the blocks for ``num_tokens + 1`` tokens (one token of growth) fit while
        ``watermark_blocks`` stay free, or the pool is idle and they fit at all."""
        need = blocks_needed(num_tokens + 1, self.block_size)
        idle = self._pool.num_free == self._pool.num_usable
        return self._pool.num_free - need >= (0 if idle else self.watermark_blocks)

    def allocate(self, req: Request, num_tokens: int, *, in_transfer: bool = False) -> list[int]:
        """Give ``req`` a fresh block table for ``num_tokens`` tokens and return it (the
        same list as ``req.block_table``). With ``in_transfer`` the blocks are reserved
        for a transfer until :meth:`transfer_ended` or :meth:`free`.

        Raises:
            ValueError: ``req`` already holds blocks.
            engine.block_pool.NoFreeBlocksError: fewer blocks are free than needed
                (nothing is taken); check :meth:`can_allocate` first.
        """
        if req.block_table:
            raise ValueError(f"request {req.request_id} already holds {len(req.block_table)} KV blocks")
        req.block_table = self._pool.allocate(blocks_needed(num_tokens, self.block_size))
        if in_transfer:
            self._in_transfer[req.request_id] = len(req.block_table)
        return req.block_table

    def transfer_ended(self, req: Request) -> None:
        """The blocks of ``req``'s transfer no longer wait on the wire: its KV landed, or
        the request keeps them to rebuild its KV here (no-op if none were reserved)."""
        self._in_transfer.pop(req.request_id, None)

    def grow(self, req: Request) -> bool:
        """Make room in the cache for ``req``'s newest token (position
        ``req.num_tokens - 1``), appending a block when it starts a new one.

        Returns:
            True when the token has a slot; False when the pool has too few free
            blocks (nothing taken): preempt someone (:meth:`choose_victim`) and retry.
        """
        need = blocks_needed(req.num_tokens, self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        if need > self._pool.num_free:
            return False
        req.block_table.extend(self._pool.allocate(need))
        return True

    def choose_victim(self, running: Sequence[str]) -> str:
        """The request to preempt when growth finds no free block: the most recently
        admitted one of ``running`` (request ids in admission order).

        Raises:
            ValueError: ``running`` is empty.
        """
        if not running:
            raise ValueError("no running request to preempt")
        return running[-1]

    def free(self, req: Request) -> None:
        """Return every block of ``req`` to the pool and empty its block table (no-op
        without blocks); its transfer reservation, if any, ends."""
        self._in_transfer.pop(req.request_id, None)
        if req.block_table:
            self._pool.free(req.block_table)
            req.block_table = []

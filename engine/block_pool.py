"""KV block pool: free list in eviction order, reference counts, prefix cache.

Block 0 is reserved as the null block (block-table padding points at it) and is
never handed out. A block whose reference count drops to zero goes to the tail
of the free list; the head is the least recently freed block, taken first.
Full blocks can carry a chained content hash (:mod:`common.prefix_hash`): such a
block stays findable by :meth:`lookup` while it sits unreferenced in the free list
(an evictable cached block) and loses its hash only when :meth:`allocate` hands it
out again — LRU eviction, as in vLLM v1's ``BlockPool``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked."""


class BlockPool:
    """Allocator over ``num_blocks`` KV blocks (block 0 reserved).

    Not thread-safe: one scheduler owns it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._hash_of: dict[int, bytes] = {}      # block -> content hash
        self._cached: dict[bytes, int] = {}       # content hash -> block

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Unreferenced blocks (cached-but-evictable ones included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks findable by :meth:`lookup` (referenced or not)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref count 1 each), evicting cached ones from the head.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free (nothing is taken).
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._cached[h]
            self._ref[b] = 1
            out.append(b)
        return out

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (no references taken)."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take one reference to each (cached) block, pulling free ones off the free list.

        Raises:
            ValueError: a block id outside ``1 .. num_blocks - 1`` (nothing is taken).
        """
        for b in block_ids:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"invalid block {b}")
        for b in block_ids:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Make a referenced, fully written block findable under ``block_hash``. Call it
        only after the block's KV is completely written. An existing entry for the
        hash wins (the duplicate block stays private)."""
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
        if block_hash in self._cached or block_id in self._hash_of:
            return
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def cached_hashes(self) -> list[bytes]:
        return list(self._cached)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference of each block; blocks reaching zero go to the free list tail
        (keeping their hash: still findable until evicted).

        Raises:
            ValueError: a block that is not allocated (double free); nothing is freed then.
        """
        drops = Counter(block_ids)
        for b, n in drops.items():
            if not 0 < b < self.num_blocks or self._ref[b] < n:
                raise ValueError(f"double free or invalid block {b}")
        for b in block_ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)

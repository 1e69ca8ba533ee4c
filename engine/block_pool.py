"""KV block pool: free list in eviction order plus reference counts.

Block 0 is reserved as the null block (block-table padding points at it) and is
never handed out. Blocks return to the tail of the free list when their reference
count drops to zero, so the head of the list is the least recently freed block
(the eviction order used by prefix caching, as in vLLM v1's ``BlockPool``).
"""

from __future__ import annotations

from collections import Counter, deque


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
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref count 1 each).

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free (nothing is taken).
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if not 0 < b < self.num_blocks or self._ref[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
        for b in block_ids:
            self._ref[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference of each block; blocks reaching zero go to the free list tail.

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
                self._free.append(b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)

"""Reservations of a decode worker that are waiting for their KV.

Each open transfer owns destination blocks and a generation number. KV writes
check (transfer id, generation, block ids) and copy into the cache under the
table's lock; closing a transfer takes the same lock, so once the scheduler
closes one (finish, abort, lease expiry) no late or duplicated chunk can write
into its blocks, even after they are reused by another request.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from kvtransfer.errors import StaleTransferError


@dataclass
class OpenTransfer:
    transfer_id: str
    request_id: str
    generation: int
    block_ids: list[int]
    deadline: float  # time.monotonic() seconds
    bytes_written: int = 0


class TransferTable:
    """Thread-safe table of open transfers writing into ``kv_cache``.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._lock = threading.Lock()
        self._open: dict[str, OpenTransfer] = {}
        self._generations = itertools.count(1)

    def open(self, transfer_id: str, request_id: str, block_ids: list[int], deadline: float) -> int:
        """Open a transfer into ``block_ids``; returns its generation number."""
        with self._lock:
            gen = next(self._generations)
            self._open[transfer_id] = OpenTransfer(transfer_id, request_id, gen, list(block_ids), deadline)
            return gen

    def close(self, transfer_id: str, generation: int | None) -> OpenTransfer | None:
        """Close a transfer (``generation`` None = whatever is open). Returns it, or
        None when it was not open with that generation."""
        with self._lock:
            t = self._open.get(transfer_id)
            if t is None or (generation is not None and t.generation != generation):
                return None
            return self._open.pop(transfer_id)

    def is_open(self, transfer_id: str, generation: int) -> bool:
        with self._lock:
            t = self._open.get(transfer_id)
            return t is not None and t.generation == generation

    def write(self, transfer_id: str, generation: int, layer_start: int, layer_end: int,
              block_ids: list[int], kv: torch.Tensor) -> None:
        """Copy ``kv`` ``[layer_end-layer_start, 2, len(block_ids), block_size, kv_heads,
        head_dim]`` into the reserved blocks.

        Raises:
            StaleTransferError: the transfer is not open with this generation, or
                ``block_ids`` are not among its reserved blocks.
            ValueError: shape or layer range does not fit the cache.
        """
        with self._lock:
            t = self._open.get(transfer_id)
            if t is None or t.generation != generation:
                raise StaleTransferError(f"transfer {transfer_id} generation {generation} is not open")
            if not set(block_ids) <= set(t.block_ids):
                raise StaleTransferError(f"blocks {block_ids} are not reserved for transfer {transfer_id}")
            expected = (layer_end - layer_start, 2, len(block_ids), *self.kv_cache.shape[3:])
            if tuple(kv.shape) != expected or not 0 <= layer_start < layer_end <= self.kv_cache.shape[0]:
                raise ValueError(f"KV chunk shape {tuple(kv.shape)} != expected {expected}")
            idx = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)
            dst = self.kv_cache[layer_start:layer_end]
            dst.index_copy_(2, idx, kv.to(device=dst.device, dtype=dst.dtype))
            t.bytes_written += kv.numel() * kv.element_size()

    def expired(self, now: float) -> list[OpenTransfer]:
        """Close and return every transfer whose lease deadline has passed."""
        with self._lock:
            gone = [t for t in self._open.values() if t.deadline <= now]
            for t in gone:
                del self._open[t.transfer_id]
            return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

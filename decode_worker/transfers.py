"""Reservations of a decode worker that are waiting for their KV.

Each open transfer owns destination blocks and a generation number. KV writes
check (transfer id, generation, block ids of the token range) and copy tokens
into the cache, re-blocking when the sender's block size differs, under the
table's lock; closing a transfer takes the same lock, so once the scheduler
closes one (finish, abort, lease expiry) no late or duplicated chunk can write
into its blocks, even after they are reused by another request.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import torch

from kvtransfer.errors import StaleTransferError
from kvtransfer.reblock import dest_block_range, scatter_tokens


@dataclass
class OpenTransfer:
    transfer_id: str
    request_id: str
    generation: int
    block_ids: list[int]
    deadline: float  # time.monotonic() seconds
    bytes_written: int = 0
    lease_s: float = 0.0  # > 0: every accepted chunk pushes the deadline to now + lease_s


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

    def open(self, transfer_id: str, request_id: str, block_ids: list[int], deadline: float,
             lease_s: float = 0.0) -> int:
        """Open a transfer into ``block_ids`` until ``deadline`` (``time.monotonic()``
        seconds); with ``lease_s`` > 0 each written chunk renews the lease to now +
        ``lease_s`` (a slow transfer that keeps moving is not reclaimed; a silent one is).
        Returns its generation number."""
        with self._lock:
            gen = next(self._generations)
            self._open[transfer_id] = OpenTransfer(transfer_id, request_id, gen, list(block_ids), deadline,
                                                   lease_s=lease_s)
            return gen

    def close(self, transfer_id: str, generation: int | None) -> OpenTransfer | None:
        """Close a transfer (``generation`` None = whatever is open). Returns it, or
        None when it was not open with that generation."""
        with self._lock:
            t = self._open.get(transfer_id)
            if t is None or (generation is not None and t.generation != generation):
                return None
            return self._open.pop(transfer_id)

    def is_open(self, transfer_id: str, generation: int, request_id: str | None = None) -> bool:
        """Whether ``transfer_id`` is open with ``generation`` (and, when given, for ``request_id``)."""
        with self._lock:
            t = self._open.get(transfer_id)
            return t is not None and t.generation == generation and request_id in (None, t.request_id)

    def write(self, transfer_id: str, generation: int, layer_start: int, layer_end: int,
              block_ids: list[int], kv: torch.Tensor, *, token_start: int = 0) -> None:
        """Copy the tokens of sender blocks ``kv`` into the transfer's reserved blocks (re-blocking).

        Args:
            block_ids: the reserved blocks tokens ``[token_start, token_start + n * src_bs)``
                map to (clipped to the reservation's capacity), in order.
            kv: ``[layer_end - layer_start, 2, n, src_bs, kv_heads, head_dim]``, any
                floating dtype and device (cast on write); ``src_bs`` may differ from the
                cache's block size.
            token_start: position in the transfer of ``kv``'s first token; token ``t`` goes
                to reserved block ``t // block_size``, slot ``t % block_size``, and tokens
                past the reservation are dropped. The default 0 with the whole reservation
                and the cache's block size writes whole blocks (one ``index_copy_``).

        Raises:
            StaleTransferError: the transfer is not open with this generation, or
                ``block_ids`` are not exactly the reserved blocks the token range maps to
                (or it starts past the reservation). Nothing was written.
            ValueError: shape or layer range does not fit the cache.
        """
        with self._lock:
            t = self._open.get(transfer_id)
            if t is None or t.generation != generation:
                raise StaleTransferError(f"transfer {transfer_id} generation {generation} is not open")
            bs = self.kv_cache.shape[3]
            n_tokens = kv.shape[2] * kv.shape[3] if kv.dim() == 6 else 0
            try:
                first, last = dest_block_range(len(t.block_ids), bs, token_start, token_start + n_tokens)
            except ValueError as exc:
                raise StaleTransferError(f"transfer {transfer_id}: {exc}") from None
            if list(block_ids) != t.block_ids[first:last]:
                raise StaleTransferError(
                    f"blocks {list(block_ids)} are not the blocks reserved for tokens "
                    f"[{token_start}, {token_start + n_tokens}) of transfer {transfer_id}"
                )
            scatter_tokens(self.kv_cache, layer_start, layer_end, t.block_ids, token_start, kv)
            t.bytes_written += kv.numel() * kv.element_size()
            if t.lease_s > 0:
                t.deadline = max(t.deadline, time.monotonic() + t.lease_s)

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

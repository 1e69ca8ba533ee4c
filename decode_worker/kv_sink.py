"""The decode worker's :class:`KvReceiverSink`: reservation checks + cache writes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from decode_worker.scheduler import DecodeScheduler
from kvtransfer import KvReceiverSink, StaleTransferError
from serving.convert import logprobs_from_dict


class DecodeKvSink(KvReceiverSink):
    """Bridges the KV transport to the scheduler's :class:`TransferTable` and inbox."""

    def __init__(self, scheduler: DecodeScheduler, on_write: Callable[[int], None] | None = None) -> None:
        """``on_write(nbytes)`` is told the payload bytes of every chunk written (metrics)."""
        self.scheduler = scheduler
        self.table = scheduler.transfers
        self.on_write = on_write

    def begin(self, transfer_id: str, generation: int, request_id: str) -> bool:
        """Admit a stream only for a transfer open with this generation for this request."""
        return self.table.is_open(transfer_id, generation, request_id)

    def write(self, transfer_id: str, generation: int, layer_start: int, layer_end: int,
              block_ids: Sequence[int], tensor: torch.Tensor, *, token_start: int) -> None:
        """See :meth:`KvReceiverSink.write`; :meth:`TransferTable.write` maps the tokens under its lock."""
        self.table.write(transfer_id, generation, layer_start, layer_end, list(block_ids), tensor,
                         token_start=token_start)
        if self.on_write is not None:
            self.on_write(tensor.numel() * tensor.element_size())

    def complete(self, transfer_id: str, generation: int, first_token_id: int,
                 first_token_logprobs: dict[Any, Any] | None) -> None:
        if not self.table.is_open(transfer_id, generation):
            raise StaleTransferError(f"transfer {transfer_id} generation {generation} is not open")
        self.scheduler.kv_complete(transfer_id, generation, first_token_id, logprobs_from_dict(first_token_logprobs))

    def fail(self, transfer_id: str, generation: int, reason: str) -> None:
        self.scheduler.kv_failed(transfer_id, generation, reason)

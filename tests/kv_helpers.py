"""Shared helpers of the KV transport tests: a decode side over the real ``TransferTable``.

The receiver is a real gRPC server on loopback with a registered transport's receiver
(:func:`kvtransfer.attach_receiver`, as a decode worker attaches it) and a :class:`TableSink`
(the decode worker's reservation table, minus the scheduler). :func:`faulty_config` names
the fault-injecting transport of ``tests/kv_faults.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from decode_worker.transfers import TransferTable
from kvtransfer import (
    KvReceiver,
    KvReceiverSink,
    KvTransferConfig,
    StaleTransferError,
    attach_receiver,
    kv_server_options,
)
from pdcluster.v1 import worker_pb2
from serving.rpc import add_health, set_serving
from serving.security import Plane, SecurityConfig, bind, make_server

HEADS, HEAD_DIM = 2, 4
FAULTY_MODULE = "tests.kv_faults"
"""The fault-injecting transport's module, by the one name it may be imported under."""


def faulty_config(fault: str, inner: str = "grpc", timeout_s: float = 10.0, **options: str) -> KvTransferConfig:
    """A config of the ``"faulty"`` transport around ``inner`` (options as in ``tests/kv_faults.py``)."""
    return KvTransferConfig(transport="faulty", transport_module=FAULTY_MODULE, timeout_s=timeout_s,
                            transport_options={"inner": inner, "fault": fault, **options})


class TableSink(KvReceiverSink):
    """:class:`KvReceiverSink` over a :class:`TransferTable`; ``complete``/``fail`` close the reservation."""

    def __init__(self, table: TransferTable) -> None:
        self.table = table
        self.lock = threading.Lock()
        self.completed: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        self.writes = 0

    def begin(self, transfer_id, generation, request_id) -> bool:
        return self.table.is_open(transfer_id, generation)

    def write(self, transfer_id, generation, layer_start, layer_end, block_ids, tensor, *, token_start) -> None:
        self.table.write(transfer_id, generation, layer_start, layer_end, list(block_ids), tensor,
                         token_start=token_start)
        with self.lock:
            self.writes += 1

    def complete(self, transfer_id, generation, first_token_id, first_token_logprobs) -> None:
        if self.table.close(transfer_id, generation) is None:
            raise StaleTransferError(f"transfer {transfer_id} generation {generation} is not open")
        with self.lock:
            self.completed[transfer_id] = first_token_id

    def fail(self, transfer_id, generation, reason) -> None:
        if self.table.close(transfer_id, generation) is not None:
            with self.lock:
                self.failed[transfer_id] = reason


@dataclass
class Receiver:
    server: grpc.Server
    sink: TableSink
    servicer: KvReceiver
    endpoint: str
    block_size: int

    @property
    def cache(self) -> torch.Tensor:
        return self.sink.table.kv_cache

    def reserve(self, transfer_id: str, block_ids: Sequence[int]) -> worker_pb2.KvDestination:
        gen = self.sink.table.open(transfer_id, "r-" + transfer_id, list(block_ids), time.monotonic() + 60)
        return worker_pb2.KvDestination(worker_id="d0", kv_endpoint=self.endpoint, block_ids=list(block_ids),
                                        block_size=self.block_size, generation=gen, dtype="float32")

    def wait_closed(self, transfer_id: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(t == transfer_id for t in list(self.sink.table._open)) and time.monotonic() < deadline:
            time.sleep(0.01)


def start_receiver(layers: int, num_blocks: int, block_size: int, cfg: KvTransferConfig | None = None,
                   security: SecurityConfig | None = None) -> Receiver:
    """A started receiver of the transport ``cfg`` names (default ``"grpc"``) on 127.0.0.1, on a
    server made and bound as a decode worker's KV server (its internal plane: the cluster secret
    and internal TLS of ``security``, none by default; the health service SERVING)."""
    cfg = cfg if cfg is not None else KvTransferConfig()
    security = security if security is not None else SecurityConfig()
    cache = torch.full((layers, 2, num_blocks, block_size, HEADS, HEAD_DIM), -1.0)
    sink = TableSink(TransferTable(cache))
    server = make_server(security, Plane.INTERNAL, max_workers=4, options=kv_server_options())
    servicer = attach_receiver(cfg, server, sink)
    set_serving(add_health(server), ["pdcluster.v1.KvTransfer"])
    port = bind(server, "127.0.0.1", 0, security, Plane.INTERNAL)
    server.start()
    return Receiver(server, sink, servicer, f"127.0.0.1:{port}", block_size)


def sender_cache(layers: int, num_blocks: int, block_size: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, num_blocks, block_size, HEADS, HEAD_DIM), generator=g)


def tokens_of(cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
    """``[L, 2, num_tokens, H, D]``: the first ``num_tokens`` tokens held by ``block_ids`` in order."""
    picked = cache[:, :, list(block_ids)]
    L, _, n, bs, h, d = picked.shape
    return picked.reshape(L, 2, n * bs, h, d)[:, :, :num_tokens]

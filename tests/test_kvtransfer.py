"""End-to-end KV transfer over a real gRPC server on loopback (the ``"grpc"`` transport).

The decode side is an in-test :class:`KvReceiverSink` with its own paged cache
(4 layers, 8 blocks, block_size 4, 2 KV heads, head_dim 8) behind the registered
receiver; corrupt chunks come from the ``"faulty"`` transport of ``tests/kv_faults.py``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
from kv_helpers import faulty_config

from kvtransfer import (
    GrpcKvSender,
    KvReceiver,
    KvReceiverSink,
    KvTransferConfig,
    KvTransferError,
    StaleTransferError,
    TransferState,
    attach_receiver,
    create_sender,
    kv_server_options,
)
from kvtransfer.reblock import dest_block_range, scatter_tokens
from pdcluster.v1 import worker_pb2

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 8, 4, 2, 8
SHAPE = (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
GEN = 7


@dataclass
class _Reservation:
    generation: int
    request_id: str
    block_ids: list[int]


@dataclass
class CacheSink(KvReceiverSink):
    """Decode-side fake: a reservation table and a paged cache, checked and written under one lock."""

    kv_cache: torch.Tensor
    lock: threading.Lock = field(default_factory=threading.Lock)
    reservations: dict[str, _Reservation] = field(default_factory=dict)
    writes: list[tuple[str, int, int, list[int]]] = field(default_factory=list)
    completed: dict[str, tuple[int, Any]] = field(default_factory=dict)
    failed: list[tuple[str, int, str]] = field(default_factory=list)
    reclaim_after_writes: int | None = None  # reclaim the transfer once this many writes happened
    write_gate: threading.Event | None = None  # write waits for it (to observe TRANSFERRING)
    write_entered: threading.Event = field(default_factory=threading.Event)

    def reserve(self, transfer_id: str, generation: int, request_id: str, block_ids: Sequence[int]) -> None:
        with self.lock:
            self.reservations[transfer_id] = _Reservation(generation, request_id, list(block_ids))

    def _reserved(self, transfer_id: str, generation: int) -> _Reservation | None:
        r = self.reservations.get(transfer_id)
        return r if r is not None and r.generation == generation else None

    def begin(self, transfer_id: str, generation: int, request_id: str) -> bool:
        with self.lock:
            r = self._reserved(transfer_id, generation)
            return r is not None and r.request_id == request_id

    def write(self, transfer_id, generation, layer_start, layer_end, block_ids, tensor, *, token_start) -> None:
        self.write_entered.set()
        if self.write_gate is not None:
            self.write_gate.wait(10)
        with self.lock:
            if self.reclaim_after_writes is not None and len(self.writes) >= self.reclaim_after_writes:
                self.reservations.pop(transfer_id, None)
            r = self._reserved(transfer_id, generation)
            if r is None:
                raise StaleTransferError(f"transfer {transfer_id} generation {generation} not reserved")
            bs = self.kv_cache.shape[3]
            first, last = dest_block_range(len(r.block_ids), bs, token_start,
                                           token_start + tensor.shape[2] * tensor.shape[3])
            if list(block_ids) != r.block_ids[first:last]:
                raise StaleTransferError(f"blocks {block_ids} do not match the reservation")
            scatter_tokens(self.kv_cache, layer_start, layer_end, r.block_ids, token_start, tensor)
            self.writes.append((transfer_id, layer_start, layer_end, list(block_ids)))

    def complete(self, transfer_id, generation, first_token_id, first_token_logprobs) -> None:
        with self.lock:
            if self._reserved(transfer_id, generation) is None:
                raise StaleTransferError(f"transfer {transfer_id} reclaimed")
            self.completed[transfer_id] = (first_token_id, first_token_logprobs)

    def fail(self, transfer_id, generation, reason) -> None:
        with self.lock:
            self.failed.append((transfer_id, generation, reason))
            if self._reserved(transfer_id, generation) is not None:
                del self.reservations[transfer_id]


@dataclass
class Decode:
    sink: CacheSink
    servicer: KvReceiver
    endpoint: str


def _start_decode(dtype: torch.dtype = torch.float32) -> tuple[grpc.Server, Decode]:
    sink = CacheSink(torch.full(SHAPE, -1.0, dtype=dtype))
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=kv_server_options())
    servicer = attach_receiver(KvTransferConfig(transport="grpc"), server, sink)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, Decode(sink, servicer, f"127.0.0.1:{port}")


@pytest.fixture
def decode() -> Iterator[Decode]:
    server, d = _start_decode()
    yield d
    server.stop(0)


@pytest.fixture
def decode_bf16() -> Iterator[Decode]:
    server, d = _start_decode(torch.bfloat16)
    yield d
    server.stop(0)


@pytest.fixture
def sender() -> Iterator[GrpcKvSender]:
    s = GrpcKvSender(timeout_s=5.0)
    yield s
    s.close()


def _prefill_cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(dtype)


def _dest(d: Decode, block_ids: Sequence[int], generation: int = GEN) -> worker_pb2.KvDestination:
    return worker_pb2.KvDestination(
        worker_id="decode-0",
        kv_endpoint=d.endpoint,
        block_ids=list(block_ids),
        block_size=BLOCK_SIZE,
        generation=generation,
        dtype=str(d.sink.kv_cache.dtype).removeprefix("torch."),
    )


SRC = [5, 1, 6]  # non-contiguous, out of order
DST = [2, 7, 0]


def _assert_copied(src_cache: torch.Tensor, dst_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    for s, t in zip(src, dst):
        assert torch.equal(dst_cache[:, :, t], src_cache[:, :, s].to(dst_cache.dtype)), (s, t)
    others = [b for b in range(BLOCKS) if b not in dst]
    assert torch.all(dst_cache[:, :, others] == -1), "blocks outside the reservation were touched"


@pytest.mark.parametrize("layers_per_chunk", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(dtype, layers_per_chunk, decode, decode_bf16, sender) -> None:
    d = decode_bf16 if dtype == torch.bfloat16 else decode
    cache = _prefill_cache(dtype)
    d.sink.reserve("t1", GEN, "r1", DST)
    logprobs = {"logprob": -0.5, "top": {42: -0.5, 7: -1.25}}
    result = sender.send("r1", "t1", _dest(d, DST), cache, SRC, 42, logprobs, layers_per_chunk=layers_per_chunk)

    _assert_copied(cache, d.sink.kv_cache, SRC, DST)
    expected_bytes = LAYERS * 2 * len(SRC) * BLOCK_SIZE * HEADS * HEAD_DIM * cache.element_size()
    assert result.bytes_sent == result.bytes_acknowledged == expected_bytes
    assert result.num_chunks == -(-LAYERS // layers_per_chunk)
    assert result.seconds > 0
    assert d.sink.completed == {"t1": (42, logprobs)}
    assert d.sink.failed == []
    assert sender.poll("t1") == TransferState.SUCCESS
    assert d.servicer.poll("t1") == TransferState.SUCCESS


def test_receiver_casts_sender_dtype(decode, sender) -> None:
    cache = _prefill_cache(torch.bfloat16)  # bf16 -> fp32 is exact
    decode.sink.reserve("t1", GEN, "r1", DST)
    sender.send("r1", "t1", _dest(decode, DST), cache, SRC, 3)
    _assert_copied(cache, decode.sink.kv_cache, SRC, DST)


def test_chunks_split_by_blocks_under_small_message_limit(decode) -> None:
    block_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4
    s = GrpcKvSender(timeout_s=5.0, max_chunk_bytes=2 * block_bytes)
    try:
        src, dst = [0, 3, 4, 7, 2], [6, 1, 3, 5, 4]
        cache = _prefill_cache(torch.float32)
        decode.sink.reserve("t1", GEN, "r1", dst)
        result = s.send("r1", "t1", _dest(decode, dst), cache, src, 1, layers_per_chunk=4)
        assert result.num_chunks == LAYERS * 3  # 5 blocks -> 2 + 2 + 1 per layer
        _assert_copied(cache, decode.sink.kv_cache, src, dst)
    finally:
        s.close()


@pytest.mark.parametrize("corrupt_index", [0, 2])
def test_corrupt_chunk_fails_transfer(corrupt_index, decode) -> None:
    cache = _prefill_cache(torch.float32)
    decode.sink.reserve("t1", GEN, "r1", DST)
    before = decode.sink.kv_cache.clone()
    s = create_sender(faulty_config("corrupt", chunk=str(corrupt_index), timeout_s=5.0))
    try:
        with pytest.raises(KvTransferError, match="checksum") as ei:
            s.send("r1", "t1", _dest(decode, DST), cache, SRC, 42, layers_per_chunk=1)
    finally:
        s.close()
    assert ei.value.transfer_id == "t1"
    assert [(t, g) for t, g, _ in decode.sink.failed] == [("t1", GEN)]
    assert "checksum" in decode.sink.failed[0][2]
    assert decode.sink.completed == {}
    assert len(decode.sink.writes) == corrupt_index  # chunks before the corrupt one only
    corrupt_layer = corrupt_index  # one layer per chunk
    assert torch.equal(decode.sink.kv_cache[corrupt_layer:], before[corrupt_layer:])
    assert s.poll("t1") == TransferState.FAILED
    assert decode.servicer.poll("t1") == TransferState.FAILED


def test_stale_generation_is_dropped(decode, sender) -> None:
    decode.sink.reserve("t1", GEN, "r1", DST)
    before = decode.sink.kv_cache.clone()
    with pytest.raises(KvTransferError, match="stale"):
        sender.send("r1", "t1", _dest(decode, DST, generation=GEN - 1), _prefill_cache(torch.float32), SRC, 42)
    assert decode.sink.writes == [] and decode.sink.completed == {} and decode.sink.failed == []
    assert torch.equal(decode.sink.kv_cache, before)
    assert sender.poll("t1") == TransferState.FAILED
    with pytest.raises(KeyError):  # never admitted on the receiver
        decode.servicer.poll("t1")
    assert "t1" in decode.sink.reservations  # the live reservation is untouched


def test_unknown_transfer_is_dropped(decode, sender) -> None:
    with pytest.raises(KvTransferError, match="stale"):
        sender.send("r1", "nope", _dest(decode, DST), _prefill_cache(torch.float32), SRC, 42)
    assert decode.sink.writes == []


def test_transfer_reclaimed_mid_stream_stops_writing(decode, sender) -> None:
    decode.sink.reserve("t1", GEN, "r1", DST)
    decode.sink.reclaim_after_writes = 1
    before = decode.sink.kv_cache.clone()
    with pytest.raises(KvTransferError, match="stale"):
        sender.send("r1", "t1", _dest(decode, DST), _prefill_cache(torch.float32), SRC, 42, layers_per_chunk=1)
    assert len(decode.sink.writes) == 1
    assert torch.equal(decode.sink.kv_cache[1:], before[1:])
    assert decode.servicer.poll("t1") == TransferState.FAILED


def test_block_ids_outside_reservation_are_stale(decode, sender) -> None:
    decode.sink.reserve("t1", GEN, "r1", DST)
    before = decode.sink.kv_cache.clone()
    with pytest.raises(KvTransferError, match="stale"):
        sender.send("r1", "t1", _dest(decode, [2, 7, 3]), _prefill_cache(torch.float32), SRC, 42)
    assert torch.equal(decode.sink.kv_cache, before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_endpoint_fails_within_timeout() -> None:
    s = GrpcKvSender(timeout_s=2.0)
    dest = worker_pb2.KvDestination(
        kv_endpoint=f"127.0.0.1:{_free_port()}", block_ids=DST, block_size=BLOCK_SIZE, generation=GEN
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(KvTransferError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
            s.send("r1", "t1", dest, _prefill_cache(torch.float32), SRC, 42)
    finally:
        s.close()
    assert time.monotonic() - t0 < 2.0 + 1.0
    assert s.poll("t1") == TransferState.FAILED
    time.sleep(0.1)  # gRPC's request thread may still pull a chunk: it must not revive the state
    assert s.poll("t1") == TransferState.FAILED


def test_deadline_while_receiver_stalls_fails_both_sides(decode) -> None:
    decode.sink.reserve("t1", GEN, "r1", DST)
    decode.sink.write_gate = threading.Event()
    s = GrpcKvSender(timeout_s=0.5)
    try:
        with pytest.raises(KvTransferError, match="DEADLINE_EXCEEDED"):
            s.send("r1", "t1", _dest(decode, DST), _prefill_cache(torch.float32), SRC, 42)
    finally:
        decode.sink.write_gate.set()
        s.close()
    deadline = time.monotonic() + 5
    while decode.servicer.poll("t1") != TransferState.FAILED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode.servicer.poll("t1") == TransferState.FAILED
    assert [(t, g) for t, g, _ in decode.sink.failed] == [("t1", GEN)]
    assert decode.sink.completed == {}


def test_mismatched_destination_fails_before_sending(decode, sender) -> None:
    decode.sink.reserve("t1", GEN, "r1", DST)
    cache = _prefill_cache(torch.float32)
    dest = _dest(decode, DST)
    dest.block_size = 4 * BLOCK_SIZE  # 3 blocks of 4 tokens can't fill 3 blocks of 16
    with pytest.raises(KvTransferError, match="same tokens"):
        sender.send("r1", "t1", dest, cache, SRC, 42)
    with pytest.raises(KvTransferError, match="same tokens"):
        sender.send("r1", "t2", _dest(decode, DST[:2]), cache, SRC, 42)
    with pytest.raises(ValueError, match="src_block_ids"):
        sender.send("r1", "t3", _dest(decode, DST), cache, [0, 1, BLOCKS], 42)
    with pytest.raises(TypeError):
        sender.send("r1", "t4", _dest(decode, DST), cache, SRC, 42, {"x": object()})
    assert sender.poll("t1") == sender.poll("t2") == TransferState.FAILED
    assert decode.sink.writes == []


def test_poll_states_during_transfer(decode, sender) -> None:
    with pytest.raises(KeyError):
        sender.poll("t1")
    with pytest.raises(KeyError):
        decode.servicer.poll("t1")
    decode.sink.reserve("t1", GEN, "r1", DST)
    decode.sink.write_gate = threading.Event()
    outcome: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault(
            "result", sender.send("r1", "t1", _dest(decode, DST), _prefill_cache(torch.float32), SRC, 42)
        )
    )
    thread.start()
    try:
        assert decode.sink.write_entered.wait(5)
        assert sender.poll("t1") == TransferState.TRANSFERRING
        assert decode.servicer.poll("t1") == TransferState.TRANSFERRING
        with pytest.raises(ValueError, match="already being sent"):
            sender.send("r1", "t1", _dest(decode, DST), _prefill_cache(torch.float32), SRC, 42)
    finally:
        decode.sink.write_gate.set()
        thread.join(10)
    assert outcome["result"].bytes_sent > 0
    assert sender.poll("t1") == TransferState.SUCCESS
    assert decode.servicer.poll("t1") == TransferState.SUCCESS


def test_concurrent_transfers(decode, sender) -> None:
    cache = _prefill_cache(torch.float32)
    plans = {"ta": ([0, 1], [1, 3]), "tb": ([2, 3], [4, 5]), "tc": ([4, 5], [6, 0])}
    for tid, (_, dst) in plans.items():
        decode.sink.reserve(tid, GEN, "r-" + tid, dst)
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(sender.send, "r-" + tid, tid, _dest(decode, dst), cache, src, 1)
            for tid, (src, dst) in plans.items()
        ]
        for f in futures:
            f.result(10)
    for src, dst in plans.values():
        for s_, t in zip(src, dst):
            assert torch.equal(decode.sink.kv_cache[:, :, t], cache[:, :, s_])


def test_closed_sender_refuses(decode) -> None:
    s = GrpcKvSender(timeout_s=1.0)
    s.close()
    decode.sink.reserve("t1", GEN, "r1", DST)
    with pytest.raises(KvTransferError, match="closed"):
        s.send("r1", "t1", _dest(decode, DST), _prefill_cache(torch.float32), SRC, 42)

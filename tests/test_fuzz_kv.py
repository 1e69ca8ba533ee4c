"""Property-based KV chunks against a decode worker's KV receiver (hypothesis): the registered
``"grpc"`` receiver (:class:`kvtransfer.grpc_receiver.KvTransferServicer`) on a real gRPC server,
writing through the decode worker's own sink and transfer table (:class:`DecodeKvSink`,
:class:`TransferTable`) into a paged cache.

Each example opens a reservation, then opens a stream whose first chunk is a correct chunk
of that transfer with something wrong: a header field set to another value of any type or
deleted, a garbled header, a truncated / extended / flipped payload, a consistent header
whose layers lie past the cache or whose blocks are not the reserved ones, or a ``"done"``
chunk first. Every such stream is refused and nothing is written to the cache. A chunk that
does not address the reservation (wrong transfer id, generation, request id, blocks) or whose
header does not parse is dropped and the reservation stays intact; a chunk that addresses it
but is corrupt fails the transfer through the sink (the decode worker's KV failure policy
takes over: ``decode_worker/kv_failure.py``). Either way a correct transfer into the same
blocks then succeeds (into the intact reservation, or into a new one).
"""

from __future__ import annotations

import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from decode_worker.kv_sink import DecodeKvSink
from decode_worker.transfers import TransferTable
from kvtransfer import KvChunkMeta, KvTransferConfig, attach_receiver, encode_done_chunk, encode_kv_chunk
from kvtransfer.frames import KvFrame, push_kv
from pdcluster.v1 import kv_pb2

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 8, 4, 2, 8
RESERVED = [3, 5]
SENTINEL = -1.0
REFUSED_HEADERS = ("v", "kind", "request_id", "transfer_id", "generation", "layer_start", "layer_end", "block_ids",
                   "block_size", "token_start", "dtype", "shape", "checksum")


@dataclass
class Scheduler:
    """What :class:`DecodeKvSink` needs of the decode scheduler: its transfer table, and the
    completion / failure notices (the real scheduler closes the transfer on either)."""

    transfers: TransferTable
    completed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def kv_complete(self, transfer_id, generation, first_token_id, first_logprobs) -> None:
        assert self.transfers.close(transfer_id, generation) is not None
        self.completed.append(transfer_id)

    def kv_failed(self, transfer_id, generation, reason) -> None:
        self.transfers.close(transfer_id, generation)
        self.failed.append(transfer_id)


@pytest.fixture(scope="module")
def decode():
    cache = torch.full((LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), SENTINEL)
    scheduler = Scheduler(TransferTable(cache))
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    attach_receiver(KvTransferConfig(transport="grpc"), server, DecodeKvSink(scheduler))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield scheduler, push_kv(channel)
    server.stop(None)


def _tensor(layers: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, len(RESERVED), BLOCK_SIZE, HEADS, HEAD_DIM), generator=g)


def _transfer(rid: str, tid: str, gen: int) -> list[KvFrame]:
    """A correct transfer of all layers into the reservation: two ``"kv"`` chunks and ``"done"``."""
    chunks = [encode_kv_chunk(KvChunkMeta(rid, tid, gen, start, start + 2, RESERVED, BLOCK_SIZE), _tensor(2, start))
              for start in (0, 2)]
    return chunks + [encode_done_chunk(rid, tid, gen, 2, LAYERS, 7, None)]


def _reheader(chunk: KvFrame, **changes) -> KvFrame:
    header = msgpack.unpackb(chunk.header, strict_map_key=False)
    header.update(changes)
    return KvFrame(header=msgpack.packb(header), payload=chunk.payload)


_any_value = st.one_of(st.integers(-2**63, 2**64 - 1), st.integers(-3, 20), st.text(max_size=8), st.floats(),
                       st.none(), st.booleans(), st.lists(st.integers(-3, 20), max_size=6), st.binary(max_size=4))


@st.composite
def broken_first_chunks(draw, first: KvFrame, rid: str, tid: str, gen: int) -> tuple[str, KvFrame]:
    """``(what was broken, chunk)`` from the correct first chunk of the transfer."""
    header = msgpack.unpackb(first.header, strict_map_key=False)
    how = draw(st.sampled_from(["set", "delete", "garble header", "payload", "layers past the cache",
                                "blocks not reserved", "done first"]))
    if how == "set":
        key, value = draw(st.sampled_from(REFUSED_HEADERS)), draw(_any_value)
        assume(value != header[key] or type(value) is not type(header[key]))
        return f"set {key}", _reheader(first, **{key: value})
    if how == "delete":
        key = draw(st.sampled_from(REFUSED_HEADERS))
        del header[key]
        return f"delete {key}", KvFrame(header=msgpack.packb(header), payload=first.payload)
    if how == "garble header":
        garbage = draw(st.binary(max_size=40))
        return how, KvFrame(header=garbage, payload=first.payload)
    if how == "payload":
        p = bytearray(first.payload)
        edit = draw(st.sampled_from(["truncate", "extend", "flip"]))
        if edit == "truncate":
            p = p[:draw(st.integers(0, len(p) - 1))]
        elif edit == "extend":
            p += draw(st.binary(min_size=1, max_size=8))
        else:
            p[draw(st.integers(0, len(p) - 1))] ^= draw(st.integers(1, 255))
        return f"payload {edit}", KvFrame(header=first.header, payload=bytes(p))
    if how == "layers past the cache":  # a consistent header: only the receiver's cache can refuse it
        start = draw(st.integers(LAYERS - 1, LAYERS + 2))
        return how, encode_kv_chunk(KvChunkMeta(rid, tid, gen, start, start + 2, RESERVED, BLOCK_SIZE), _tensor(2, 9))
    if how == "blocks not reserved":
        blocks = draw(st.lists(st.integers(0, 2**20), min_size=len(RESERVED), max_size=len(RESERVED), unique=True))
        assume(blocks != RESERVED)
        return how, encode_kv_chunk(KvChunkMeta(rid, tid, gen, 0, 2, blocks, BLOCK_SIZE), _tensor(2, 9))
    done = encode_done_chunk(rid, tid, gen, draw(st.integers(0, 3)), draw(st.integers(1, LAYERS + 1)), 7, None)
    return how, done


def _push(push, chunks: list[KvFrame]) -> kv_pb2.KvAck:
    return push(iter(chunks), timeout=10)


def _assert_transfer_lands(scheduler: Scheduler, stub, rid: str, tid: str, gen: int) -> None:
    ack = _push(stub, _transfer(rid, tid, gen))
    assert ack.ok, ack.error
    assert scheduler.completed[-1] == tid
    cache = scheduler.transfers.kv_cache
    sent = torch.cat([_tensor(2, 0), _tensor(2, 2)])
    assert torch.equal(cache[:, :, RESERVED], sent)
    cache.fill_(SENTINEL)


def test_broken_chunks_are_refused_and_write_nothing(decode, fuzz_examples):
    scheduler, stub = decode
    table = scheduler.transfers
    outcomes: Counter = Counter()

    @settings(max_examples=fuzz_examples(300), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.data())
    def check(data):
        rid, tid = f"req-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        gen = table.open(tid, rid, RESERVED, deadline=float("inf"))
        try:
            what, chunk = data.draw(broken_first_chunks(_transfer(rid, tid, gen)[0], rid, tid, gen))
            before = table.kv_cache.clone()
            ack = _push(stub, [chunk])
            assert not ack.ok, what
            assert torch.equal(table.kv_cache, before), f"{what}: the cache was written"
            failed = tid in scheduler.failed
            reasons = ("corrupt:", "incomplete:", "sink error:") if failed else ("stale:", "corrupt:")
            assert ack.error.startswith(reasons), (what, ack.error)
            assert table.is_open(tid, gen, rid) == (not failed), (what, ack.error)
            outcomes["transfer failed" if failed else "reservation intact"] += 1
            if failed:  # the decode worker reserves again (KV failure policy) into the same blocks
                tid, gen = uuid.uuid4().hex, None
                gen = table.open(tid, rid, RESERVED, deadline=float("inf"))
            _assert_transfer_lands(scheduler, stub, rid, tid, gen)
        finally:
            table.close(tid, None)

    check()
    print(f"KV outcomes: {dict(outcomes)}")
    assert outcomes["transfer failed"] and outcomes["reservation intact"], outcomes

"""The torch_dist transport (through the registry): gRPC control plane on loopback, gloo pair groups in-process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from kv_helpers import Receiver, TableSink, faulty_config, sender_cache, start_receiver, tokens_of

from decode_worker.transfers import TransferTable
from kvtransfer import (
    GrpcKvSender,
    KvDataPlaneError,
    KvTransferConfig,
    KvTransferError,
    KvTransferServicer,
    LayerProgress,
    TransferState,
    create_sender,
    kv_server_options,
)
from kvtransfer.dist_transport import PairSendPlane
from kvtransfer.grpc_receiver import add_kv_transfer_servicer

DIST = KvTransferConfig(transport="torch_dist", timeout_s=10.0)
LAYERS = 3
SRC = [4, 1, 2]


@pytest.fixture
def sender() -> Iterator[GrpcKvSender]:
    s = create_sender(DIST)
    yield s
    s.close()


def _receiver(block_size: int) -> Iterator[Receiver]:
    r = start_receiver(LAYERS, 10, block_size, DIST)
    yield r
    r.server.stop(0)


@pytest.fixture
def recv16() -> Iterator[Receiver]:
    yield from _receiver(16)


@pytest.fixture
def recv32() -> Iterator[Receiver]:
    yield from _receiver(32)


def test_composes_the_grpc_control_plane_and_checks_options() -> None:
    s = create_sender(KvTransferConfig(transport="torch_dist", transport_options={"max_pairs_per_endpoint": "2"}))
    try:
        assert isinstance(s, GrpcKvSender) and isinstance(s._data, PairSendPlane)
    finally:
        s.close()
    with pytest.raises(ValueError, match="takes no option"):
        create_sender(KvTransferConfig(transport="torch_dist", transport_options={"pairs": "2"}))
    with pytest.raises(ValueError, match="max_pairs_per_endpoint"):
        create_sender(KvTransferConfig(transport="torch_dist", transport_options={"max_pairs_per_endpoint": "x"}))


def test_a_grpc_sender_is_received_too(recv16) -> None:
    cache = sender_cache(LAYERS, 6, 16)
    s = create_sender(KvTransferConfig(transport="grpc", timeout_s=10.0))
    try:
        s.send("r1", "t1", recv16.reserve("t1", [7, 0, 3]), cache, SRC, 9, layers_per_chunk=2)
    finally:
        s.close()
    assert torch.equal(recv16.cache[:, :, [7, 0, 3]], cache[:, :, SRC])


def test_a_grpc_receiver_refuses_dist_chunks(sender) -> None:
    recv = start_receiver(LAYERS, 10, 16)
    try:
        with pytest.raises(KvTransferError, match="corrupt: chunk without payload"):
            sender.send("r1", "t1", recv.reserve("t1", [7, 0, 3]), sender_cache(LAYERS, 6, 16), SRC, 9)
        recv.wait_closed("t1")
        assert "t1" in recv.sink.failed and torch.all(recv.cache == -1)
    finally:
        recv.server.stop(0)


def test_token_exact_16_to_16(sender, recv16) -> None:
    cache = sender_cache(LAYERS, 6, 16)
    result = sender.send("r1", "t1", recv16.reserve("t1", [7, 0, 3]), cache, SRC, 9, {"lp": -0.5},
                         layers_per_chunk=2)
    assert torch.equal(recv16.cache[:, :, [7, 0, 3]], cache[:, :, SRC])
    assert torch.all(recv16.cache[:, :, [1, 2, 4, 5, 6, 8, 9]] == -1)
    assert result.bytes_sent == result.bytes_acknowledged == cache[:, :, SRC].numel() * 4
    assert result.num_chunks == 2 and recv16.sink.completed == {"t1": 9}
    assert sender.poll("t1") == recv16.servicer.poll("t1") == TransferState.SUCCESS


def test_token_exact_16_to_32_layerwise(sender, recv32) -> None:
    cache = sender_cache(LAYERS, 6, 16)
    progress = LayerProgress(LAYERS)

    def produce() -> None:
        for layer in range(LAYERS):
            time.sleep(0.03)
            progress.layer_done(layer)
        progress.finish(4)

    producer = threading.Thread(target=produce)
    producer.start()
    result = sender.send("r1", "t1", recv32.reserve("t1", [5, 2]), cache, SRC, None, layers_per_chunk=1,
                         progress=progress)
    producer.join()
    assert torch.equal(tokens_of(recv32.cache, [5, 2], 40), tokens_of(cache, SRC, 40))
    assert result.num_chunks == LAYERS and result.first_chunk_at < progress.finished_at


def test_two_concurrent_transfers_to_one_receiver(sender, recv16) -> None:
    cache = sender_cache(LAYERS, 6, 16)
    plans = {"ta": ([0, 1], [2, 3]), "tb": ([5, 4], [9, 8])}
    dests = {tid: recv16.reserve(tid, dst) for tid, (_, dst) in plans.items()}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(sender.send, "r-" + t, t, dests[t], cache, src, 1, layers_per_chunk=1)
                   for t, (src, _) in plans.items()]
        for f in futures:
            f.result(30)
    for src, dst in plans.values():
        assert torch.equal(recv16.cache[:, :, dst], cache[:, :, src])
    assert set(recv16.sink.completed) == {"ta", "tb"}


def test_corrupt_chunk_is_rejected_then_a_new_pair_works(recv16) -> None:
    """Chunk 1 of the first transfer corrupted (its header's CRC32, the "faulty" transport around
    torch_dist); the second transfer of the same sender runs unharmed on a new pair."""
    s = create_sender(faulty_config("corrupt", inner="torch_dist", chunk="1", transfers="1"))
    cache = sender_cache(LAYERS, 6, 16)
    try:
        with pytest.raises(KvTransferError, match="corrupt: checksum"):
            s.send("r1", "t1", recv16.reserve("t1", [7, 0, 3]), cache, SRC, 9, layers_per_chunk=1)
        recv16.wait_closed("t1")
        assert "checksum" in recv16.sink.failed["t1"] and len(recv16.sink.table) == 0
        assert s.poll("t1") == recv16.servicer.poll("t1") == TransferState.FAILED
        assert torch.all(recv16.cache[1:] == -1)  # nothing past the chunk before the corrupt one
        s.send("r1", "t2", recv16.reserve("t2", [7, 0, 3]), cache, SRC, 9, layers_per_chunk=1)
        assert torch.equal(recv16.cache[:, :, [7, 0, 3]], cache[:, :, SRC])
    finally:
        s.close()


def test_stale_reservation_drops_chunks_then_next_transfer_works(sender, recv16) -> None:
    cache = sender_cache(LAYERS, 6, 16)
    sender.send("r0", "t0", recv16.reserve("t0", [1, 2, 3]), cache, SRC, 1)  # a pair exists now
    dest = recv16.reserve("t1", [7, 0, 3])
    recv16.sink.table.close("t1", None)  # reservation gone (lease expired)
    before = recv16.cache.clone()
    t0 = time.monotonic()
    with pytest.raises(KvTransferError, match="stale"):
        sender.send("r1", "t1", dest, cache, SRC, 9)
    assert time.monotonic() - t0 < 5
    assert torch.equal(recv16.cache, before) and "t1" not in recv16.sink.failed
    sender.send("r2", "t2", recv16.reserve("t2", [8, 9, 6]), cache, SRC, 2)
    assert torch.equal(recv16.cache[:, :, [8, 9, 6]], cache[:, :, SRC])


class _NeverJoins:
    """A receiving data plane that never gets a tensor (until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def open_stream(self):
        return self

    def note(self, header) -> None:
        pass

    def prepare(self, header) -> None:
        pass

    def tensor(self, header):
        self.release.wait(30)
        raise KvDataPlaneError("never joined")

    def drop(self) -> None:
        pass


def test_sender_times_out_when_receiver_never_joins() -> None:
    sink = TableSink(TransferTable(torch.full((LAYERS, 2, 10, 16, 2, 4), -1.0)))
    pairs = _NeverJoins()
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=kv_server_options())
    servicer: KvTransferServicer = add_kv_transfer_servicer(server, sink, pairs)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    recv = Receiver(server, sink, servicer, f"127.0.0.1:{port}", 16)
    s = create_sender(KvTransferConfig(transport="torch_dist", timeout_s=1.5))
    try:
        t0 = time.monotonic()
        with pytest.raises(KvTransferError):
            s.send("r1", "t1", recv.reserve("t1", [7, 0, 3]), sender_cache(LAYERS, 6, 16), SRC, 9)
        assert time.monotonic() - t0 < 1.5 + 1.0
        assert s.poll("t1") == TransferState.FAILED
    finally:
        pairs.release.set()
        s.close()
        server.stop(0)


class _RecordingPairs:
    """ReceiverPairs stand-in: records posts and receives (a unit test of _PairStream alone)."""

    def __init__(self, fail_post: bool = False) -> None:
        self.fail_post, self.posts, self.received, self.dropped = fail_post, [], [], []

    def post(self, header):
        if self.fail_post:
            raise KvDataPlaneError("cannot reach the sender's store")
        self.posts.append(header["dist"]["tag"])
        return f"posted-{header['dist']['tag']}"

    def receive(self, header, posted=None):
        self.received.append((header["dist"]["tag"], posted))
        return torch.zeros(1)

    def drop(self, pair_id) -> None:
        self.dropped.append(pair_id)


def test_a_chunks_receive_is_posted_when_its_header_arrives_and_used_when_it_is_handled() -> None:
    from kvtransfer.dist_transport import _PairStream

    def header(tag: int) -> dict:
        return {"data": "dist", "dist": {"pair": "p1", "tag": tag}}

    pairs = _RecordingPairs()
    stream = _PairStream(pairs)
    stream.prepare(header(1))
    stream.prepare(header(2))
    stream.prepare({"kind": "done"})  # no tensor: nothing posted
    assert pairs.posts == [1, 2]
    stream.tensor(header(1))
    stream.tensor(header(3))  # never prepared (the transfer's first chunk): received on demand
    assert pairs.received == [(1, "posted-1"), (3, None)]
    stream.note(header(2))
    stream.drop()
    assert pairs.dropped == ["p1"]

    failing = _PairStream(_RecordingPairs(fail_post=True))
    failing.prepare(header(5))  # must not raise on the read-ahead thread
    with pytest.raises(KvDataPlaneError, match="cannot reach"):
        failing.tensor(header(5))

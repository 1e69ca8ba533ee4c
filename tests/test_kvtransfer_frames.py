"""The hand-framed ``PushKv`` messages (kvtransfer/frames.py), wire version 2 and CRC32C.

Unit tests of the framing (a valid ``KvChunk`` encoding both ways, malformed messages turned
into corrupt chunks, never exceptions), of the no-copy tensor view the receiver hands its
sink, and, over a real gRPC server on loopback, that a malformed message and a version-1
chunk are refused as corrupt (not with a bare gRPC error) and that a plain protobuf stub
still talks to the receiver.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import grpc
import msgpack
import numpy as np
import pytest
import torch

from kvtransfer import (
    KvChunkMeta,
    KvIntegrityError,
    KvReceiverSink,
    KvTransferConfig,
    attach_receiver,
    decode_chunk,
    encode_done_chunk,
    encode_kv_chunk,
)
from kvtransfer.checksum import crc32c
from kvtransfer.frames import KvFrame, frame_bytes, parse_frame, push_kv
from kvtransfer.wire import WIRE_VERSION
from pdcluster.v1 import kv_pb2, kv_pb2_grpc

META = KvChunkMeta("r1", "t1", 3, 0, 2, [4, 0], 4)


def _blocks() -> torch.Tensor:
    return torch.randn(2, 2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(0))


def test_frames_are_kvchunk_encodings_both_ways() -> None:
    frame = encode_kv_chunk(META, _blocks())
    wire = frame_bytes(frame)
    msg = kv_pb2.KvChunk.FromString(wire)
    assert msg.header == frame.header and msg.payload == bytes(frame.payload)
    assert msg.SerializeToString() == wire  # the same bytes protobuf writes
    back = parse_frame(msg.SerializeToString())
    assert back.error is None and back.header == frame.header and bytes(back.payload) == bytes(frame.payload)
    assert frame_bytes(msg) == wire  # a KvChunk (a relay's) goes through protobuf
    # fields in another order, unknown fields of every wire type, a repeated field (the last counts)
    reordered = (b"\x12\x02ab" + b"\x18\x96\x01" + b"\x21" + bytes(8) + b"\x2d" + bytes(4) + b"\x32\x01z"
                 + b"\x0a\x01x" + b"\x0a\x03hdr")
    got = parse_frame(reordered)
    assert (got.error, got.header, bytes(got.payload)) == (None, b"hdr", b"ab")
    empty = parse_frame(b"")
    assert (empty.error, empty.header, bytes(empty.payload)) == (None, b"", b"")


@pytest.mark.parametrize("wire", [b"\x0a\x05abc", b"\x0a", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                  b"\x0b\x00", b"\x12\x80", b"\x19\x00\x00"])
def test_malformed_messages_become_corrupt_chunks(wire: bytes) -> None:
    frame = parse_frame(wire)
    assert frame.error and "malformed KvChunk" in frame.error and frame.header == b""
    with pytest.raises(KvIntegrityError, match="malformed") as ei:
        decode_chunk(frame)
    assert ei.value.header is None


def test_receiver_view_is_no_copy_and_read_only_by_contract() -> None:
    t = _blocks()
    received = parse_frame(frame_bytes(encode_kv_chunk(META, t)))
    header, view = decode_chunk(received, copy=False)
    assert torch.equal(view, t)
    base = memoryview(received.payload)
    assert view.data_ptr() == np.frombuffer(base, dtype=np.uint8).ctypes.data  # a view, not a copy
    del received, base
    assert torch.equal(view, t)  # the view keeps the message alive
    _, copied = decode_chunk(parse_frame(frame_bytes(encode_kv_chunk(META, t))))
    copied.add_(1)  # the default copy is writable and owns its memory


def test_checksum_is_crc32c_and_version_is_two() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    t = _blocks()
    frame = encode_kv_chunk(META, t)
    header = msgpack.unpackb(frame.header)
    assert header["v"] == WIRE_VERSION == 2
    assert header["checksum"] == google_crc32c.value(t.numpy().tobytes()) == crc32c(t)
    assert crc32c(t.transpose(4, 5).contiguous().transpose(4, 5)) == header["checksum"]  # strided: C order
    assert msgpack.unpackb(encode_done_chunk("r1", "t1", 3, 1, 2, 5, None).header)["v"] == 2
    for version in (None, 1, 3, "2"):
        h = dict(header)
        if version is None:
            del h["v"]
        else:
            h["v"] = version
        with pytest.raises(KvIntegrityError, match="wire version 2") as ei:
            decode_chunk(KvFrame(msgpack.packb(h), frame.payload))
        assert ei.value.header["transfer_id"] == "t1"


class _Sink(KvReceiverSink):
    """Admits transfer ``t1`` generation 3; records writes and failures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.written: list[torch.Tensor] = []
        self.failed: list[str] = []
        self.completed: list[str] = []

    def begin(self, transfer_id, generation, request_id) -> bool:
        return (transfer_id, generation) == ("t1", 3)

    def write(self, transfer_id, generation, layer_start, layer_end, block_ids, tensor, *, token_start) -> None:
        with self.lock:
            self.written.append(tensor.clone())

    def complete(self, transfer_id, generation, first_token_id, first_token_logprobs) -> None:
        self.completed.append(transfer_id)

    def fail(self, transfer_id, generation, reason) -> None:
        self.failed.append(reason)


@pytest.fixture
def receiver():
    sink = _Sink()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    attach_receiver(KvTransferConfig(transport="grpc"), server, sink)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    channel.endpoint = f"127.0.0.1:{port}"
    yield sink, channel
    channel.close()
    server.stop(None)


def test_server_refuses_malformed_and_old_version_as_corrupt(receiver) -> None:
    sink, channel = receiver
    raw = channel.stream_unary("/pdcluster.v1.KvTransfer/PushKv", request_serializer=None,
                               response_deserializer=kv_pb2.KvAck.FromString)
    first = frame_bytes(encode_kv_chunk(META, _blocks()))
    ack = raw(iter([first, b"\x0a\x05abc"]), timeout=10)  # admitted, then a message that is no KvChunk
    assert not ack.ok and ack.error.startswith("corrupt: malformed KvChunk") and len(sink.failed) == 1
    old = dict(msgpack.unpackb(encode_kv_chunk(META, _blocks()).header))
    del old["v"]
    ack = push_kv(channel)(iter([KvFrame(msgpack.packb(old), encode_kv_chunk(META, _blocks()).payload)]), timeout=10)
    assert not ack.ok and "wire version 2" in ack.error and ack.error.startswith("corrupt:")
    assert len(sink.written) == 1  # only the first, admitted chunk was written


def test_protobuf_stub_still_talks_to_the_receiver(receiver) -> None:
    sink, channel = receiver
    t = _blocks()
    frames = [encode_kv_chunk(META, t), encode_done_chunk("r1", "t1", 3, 1, 2, 5, None)]
    chunks = [kv_pb2.KvChunk(header=f.header, payload=bytes(f.payload)) for f in frames]
    ack = kv_pb2_grpc.KvTransferStub(channel).PushKv(iter(chunks), timeout=10)
    assert ack.ok and ack.bytes_received == t.numel() * 4 and sink.completed == ["t1"]
    assert torch.equal(sink.written[0], t)


def test_gather_into_a_reused_buffer() -> None:
    from kvtransfer import gather_blocks

    cache = torch.randn(4, 2, 8, 4, 2, 8)
    buf = torch.empty(4 * 2 * 8 * 4 * 2 * 8)
    got = gather_blocks(cache, 1, 3, [6, 2], out=buf)
    assert got.data_ptr() == buf.data_ptr() and got.shape == (2, 2, 2, 4, 2, 8)
    assert torch.equal(got, gather_blocks(cache, 1, 3, [6, 2]))
    strided = cache.transpose(4, 5).contiguous().transpose(4, 5)  # the slow path fills the buffer too
    assert torch.equal(gather_blocks(strided, 0, 2, [1, 7], out=buf), gather_blocks(cache, 0, 2, [1, 7]))
    for bad in (torch.empty(10), torch.empty(4096, dtype=torch.float64), torch.empty(2, 4096).t()):
        with pytest.raises(ValueError, match="out must be"):
            gather_blocks(cache, 1, 3, [6, 2], out=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_copies_equal_index_copy(dtype) -> None:
    from kvtransfer.blocks import copy_rows

    dst = torch.randn(4, 9, 24).to(dtype)
    want = dst.clone()
    src = torch.randn(4, 3, 48).to(dtype)[:, :, ::2]  # a strided source
    idx = torch.tensor([7, 0, 4])
    copy_rows(dst, idx, src)
    want.index_copy_(1, idx, src)
    assert torch.equal(dst, want)
    other = torch.zeros(4, 9, 24)  # another dtype: index_copy_ casts
    copy_rows(other, idx, src.to(torch.float32))
    assert torch.equal(other[:, idx], src.to(torch.float32))


def test_malloc_keeps_freed_memory_once() -> None:
    from kvtransfer.memory import keep_freed_memory

    assert keep_freed_memory() is keep_freed_memory()  # idempotent; True on glibc


def test_send_leaves_no_producer_thread(receiver) -> None:
    from kvtransfer import GrpcKvSender
    from pdcluster.v1 import worker_pb2

    sink, channel = receiver
    sender = GrpcKvSender(timeout_s=10.0, max_chunk_bytes=2 * 4 * 2 * 8 * 4)  # one block per chunk
    cache = torch.randn(2, 2, 4, 4, 2, 8)
    dest = worker_pb2.KvDestination(worker_id="d", kv_endpoint=channel.endpoint,
                                    block_ids=[4, 0], block_size=4, generation=3, dtype="float32")
    try:
        result = sender.send("r1", "t1", dest, cache, [1, 3], 5)
    finally:
        sender.close()
    assert result.num_chunks == 4 and sink.completed == ["t1"]
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-send-")]
    # one layer and one block per chunk, in send order; each gathered into the same reused buffer
    want = [cache[layer:layer + 1, :, [b]] for layer in (0, 1) for b in (1, 3)]
    assert len(sink.written) == 4 and all(torch.equal(w, x) for w, x in zip(sink.written, want, strict=True))

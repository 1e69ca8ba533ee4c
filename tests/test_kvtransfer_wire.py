"""Unit tests of the KV wire format, chunk planning, block gather/scatter and transport registry."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from kvtransfer import (
    KvChunkMeta,
    KvIntegrityError,
    TransferState,
    TransferStateTable,
    decode_chunk,
    encode_done_chunk,
    encode_kv_chunk,
    gather_blocks,
    get_transport,
    register_transport,
    scatter_blocks,
)
from kvtransfer.chunking import plan_chunks
from kvtransfer.frames import KvFrame
from kvtransfer.wire import encode_dist_kv_chunk, verify_tensor

META = KvChunkMeta(
    request_id="r1", transfer_id="t1", generation=3, layer_start=1, layer_end=3, block_ids=[4, 0, 2], block_size=4
)


def _blocks(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, 2, 3, 4, 2, 8, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_chunk_round_trip_is_exact(dtype: torch.dtype) -> None:
    t = _blocks(dtype)
    header, out = decode_chunk(encode_kv_chunk(META, t))
    assert out.dtype == dtype and torch.equal(out, t)
    assert header["kind"] == "kv" and header["block_ids"] == [4, 0, 2] and header["generation"] == 3
    assert header["shape"] == [2, 2, 3, 4, 2, 8] and header["dtype"] == str(dtype).removeprefix("torch.")
    out.add_(1)  # decoded tensors are writable and own their memory


def test_non_contiguous_tensor_is_encoded_in_c_order() -> None:
    t = _blocks(torch.float32)
    strided = t.transpose(4, 5).contiguous().transpose(4, 5)
    assert not strided.is_contiguous()
    _, out = decode_chunk(encode_kv_chunk(META, strided))
    assert torch.equal(out, t)


def test_encode_rejects_shape_not_matching_meta() -> None:
    with pytest.raises(ValueError, match="does not match"):
        encode_kv_chunk(META, torch.zeros(2, 2, 3, 8, 2, 8))  # block size 8, meta says 4
    with pytest.raises(ValueError, match="does not match"):
        encode_kv_chunk(META, torch.zeros(3, 2, 3, 4, 2, 8))  # 3 layers, meta says 2
    with pytest.raises(ValueError, match="token_start"):
        encode_kv_chunk(dataclasses.replace(META, token_start=6), _blocks(torch.float32))
    with pytest.raises(ValueError, match="block ids"):
        encode_kv_chunk(dataclasses.replace(META, block_ids=[]), _blocks(torch.float32))


def test_payload_block_count_is_the_senders() -> None:
    """Re-blocking: the payload holds n sender blocks whatever the destination ids (here 1 block of 16)."""
    meta = dataclasses.replace(META, block_ids=[9], token_start=12)
    t = torch.randn(2, 2, 5, 4, 2, 8)
    header, out = decode_chunk(encode_kv_chunk(meta, t))
    assert torch.equal(out, t) and header["block_ids"] == [9] and header["token_start"] == 12


def _dist_chunk(**dist_changes: object) -> KvFrame:
    d = {"pair": "p1", "store": "127.0.0.1:1234", "backend": "gloo", "tag": 3, "timeout_s": 2.0}
    d.update(dist_changes)
    return encode_dist_kv_chunk(META, _blocks(torch.float32), d)


def test_dist_chunk_has_header_only_and_tensor_verifies() -> None:
    t = _blocks(torch.float32)
    chunk = _dist_chunk()
    assert chunk.payload == b""
    header, tensor = decode_chunk(chunk)
    assert tensor is None and header["data"] == "dist" and header["dist"]["tag"] == 3
    verify_tensor(header, t.clone())
    bad = t.clone()
    bad.view(-1)[5] += 1
    with pytest.raises(KvIntegrityError, match="checksum"):
        verify_tensor(header, bad)
    with pytest.raises(KvIntegrityError, match="does not match"):
        verify_tensor(header, t.to(torch.bfloat16))


@pytest.mark.parametrize("changes", [{"backend": "mpi"}, {"pair": ""}, {"store": "nohost"}, {"tag": -1},
                                     {"timeout_s": 0}])
def test_bad_dist_fields_raise(changes: dict) -> None:
    with pytest.raises(KvIntegrityError, match="dist"):
        decode_chunk(_dist_chunk(**changes))
    chunk = _dist_chunk()
    with pytest.raises(KvIntegrityError, match="payload"):
        decode_chunk(KvFrame(header=chunk.header, payload=b"x"))


def test_checksum_mismatch_raises_with_header() -> None:
    chunk = encode_kv_chunk(META, _blocks(torch.bfloat16))
    bad = bytearray(chunk.payload)
    bad[7] ^= 0x01
    with pytest.raises(KvIntegrityError, match="checksum") as ei:
        decode_chunk(KvFrame(header=chunk.header, payload=bytes(bad)))
    assert ei.value.header["transfer_id"] == "t1"


def _with_header(chunk: KvFrame, **changes: object) -> KvFrame:
    header = msgpack.unpackb(chunk.header)
    header.update(changes)
    return KvFrame(header=msgpack.packb(header), payload=chunk.payload)


def test_payload_size_mismatch_raises() -> None:
    chunk = encode_kv_chunk(META, _blocks(torch.float32))
    with pytest.raises(KvIntegrityError, match="bytes"):
        decode_chunk(KvFrame(header=chunk.header, payload=chunk.payload[:-4]))
    with pytest.raises(KvIntegrityError, match="bytes"):  # same shape, half the element size
        decode_chunk(_with_header(chunk, dtype="bfloat16"))


@pytest.mark.parametrize("dtype", ["int8", "complex", "nonsense", 7])
def test_bad_dtype_raises(dtype: object) -> None:
    with pytest.raises(KvIntegrityError, match="dtype"):
        decode_chunk(_with_header(encode_kv_chunk(META, _blocks(torch.float32)), dtype=dtype))


@pytest.mark.parametrize(
    "changes",
    [
        {"kind": "other"},
        {"generation": -1},
        {"layer_end": 1},
        {"block_ids": [4, 4, 2]},
        {"shape": [2, 2, 3, 4, 2]},
        {"shape": [3, 2, 3, 4, 2, 8]},
        {"block_size": 8},
        {"token_start": 2},
        {"token_start": -4},
        {"data": "shm"},
    ],
)
def test_inconsistent_header_raises(changes: dict) -> None:
    with pytest.raises(KvIntegrityError):
        decode_chunk(_with_header(encode_kv_chunk(META, _blocks(torch.float32)), **changes))


def test_garbage_header_raises_without_header() -> None:
    with pytest.raises(KvIntegrityError) as ei:
        decode_chunk(KvFrame(header=b"\xc1\xff", payload=b""))
    assert ei.value.header is None
    with pytest.raises(KvIntegrityError, match="not a map"):
        decode_chunk(KvFrame(header=msgpack.packb([1, 2]), payload=b""))


def test_done_chunk_round_trip() -> None:
    logprobs = {"token": -0.25, "top": {11: -0.25, 3: -1.5}}
    header, tensor = decode_chunk(encode_done_chunk("r1", "t1", 3, 4, 2, 11, logprobs))
    assert tensor is None
    assert header["kind"] == "done" and header["num_chunks"] == 4 and header["num_layers"] == 2
    assert header["first_token_id"] == 11 and header["first_token_logprobs"] == logprobs
    assert decode_chunk(encode_done_chunk("r1", "t1", 3, 4, 2, 11, None))[0]["first_token_logprobs"] is None
    chunk = encode_done_chunk("r1", "t1", 3, 4, 2, 11, None)
    with pytest.raises(KvIntegrityError, match="payload"):
        decode_chunk(KvFrame(header=chunk.header, payload=b"x"))


def test_plan_chunks_respects_layers_and_bytes() -> None:
    plan = plan_chunks(num_layers=4, num_blocks=3, bytes_per_layer_block=100, layers_per_chunk=3, max_chunk_bytes=10_000)
    assert [(c.layer_start, c.layer_end, c.block_start, c.block_end) for c in plan] == [(0, 3, 0, 3), (3, 4, 0, 3)]
    plan = plan_chunks(4, 3, 100, layers_per_chunk=4, max_chunk_bytes=650)  # 2 layers of 3 blocks fit
    assert [(c.layer_start, c.layer_end) for c in plan] == [(0, 2), (2, 4)]
    plan = plan_chunks(2, 5, 100, layers_per_chunk=2, max_chunk_bytes=250)  # blocks split, 1 layer each
    assert [(c.layer_start, c.block_start, c.block_end) for c in plan] == [
        (0, 0, 2), (0, 2, 4), (0, 4, 5), (1, 0, 2), (1, 2, 4), (1, 4, 5),
    ]
    with pytest.raises(ValueError, match="over max_chunk_bytes"):
        plan_chunks(1, 1, 101, 1, 100)
    with pytest.raises(ValueError, match="layers_per_chunk"):
        plan_chunks(1, 1, 1, 0, 100)


def test_gather_scatter_blocks() -> None:
    # values < 256 so the bfloat16 round trip below is exact
    cache = (torch.arange(4 * 2 * 8 * 4 * 2 * 8) % 251).to(torch.float32).reshape(4, 2, 8, 4, 2, 8)
    got = gather_blocks(cache, 1, 3, [6, 2])
    assert got.shape == (2, 2, 2, 4, 2, 8) and got.is_contiguous()
    assert torch.equal(got[:, :, 0], cache[1:3, :, 6]) and torch.equal(got[:, :, 1], cache[1:3, :, 2])
    dst = torch.zeros_like(cache)
    scatter_blocks(dst, 1, 3, [0, 5], got.to(torch.bfloat16))  # cast on write
    assert torch.equal(dst[1:3, :, 0], cache[1:3, :, 6]) and torch.equal(dst[1:3, :, 5], cache[1:3, :, 2])
    assert dst[0].abs().sum() == 0 and dst[3].abs().sum() == 0
    with pytest.raises(ValueError, match="block ids"):
        gather_blocks(cache, 0, 1, [8])
    with pytest.raises(ValueError, match="layer range"):
        gather_blocks(cache, 3, 5, [0])
    with pytest.raises(ValueError, match="shape"):
        scatter_blocks(dst, 0, 1, [0], got)


def test_state_order_and_table_eviction() -> None:
    S = TransferState
    assert S.FAILED < S.BOOTSTRAPPING < S.WAITING_FOR_INPUT < S.TRANSFERRING < S.SUCCESS
    table = TransferStateTable(history=2)
    table.set("a", S.TRANSFERRING)
    table.set("b", S.SUCCESS)
    table.set("c", S.FAILED)
    table.set("d", S.SUCCESS)
    assert table.get("a") == S.TRANSFERRING  # in flight: never evicted
    assert table.get("d") == S.SUCCESS
    with pytest.raises(KeyError):
        table.get("b")


def test_registry_has_grpc_and_rejects_duplicates() -> None:
    t = get_transport("grpc")
    assert t.name == "grpc"
    with pytest.raises(ValueError, match="already registered"):
        register_transport("grpc", t.sender_factory, t.receiver_factory)
    with pytest.raises(KeyError, match="grpc"):
        get_transport("nccl-not-registered")

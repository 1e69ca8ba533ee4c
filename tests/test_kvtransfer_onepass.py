"""The one-pass KV copies (kvtransfer/onepass.py, the C++ kernel ``block_copy``): the sender's fused
gather + CRC32C + framing writes exactly the bytes of the plain path, and the torch_dist sender's
fused gather returns the blocks and their CRC32C; where the kernel cannot run both say so
(``None``) and the plain path is taken. Argument checks of the kernel raise, naming the argument.

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import msgpack
import pytest
import torch

from engine.kernels.cpu.build import load
from kvtransfer import KvChunkMeta, decode_chunk, encode_kv_chunk, gather_blocks
from kvtransfer.blocks import HeadShards
from kvtransfer.checksum import crc32c, crc32c_extend_address
from kvtransfer.frames import frame_bytes, parse_frame
from kvtransfer.onepass import available, frame_kv_chunk

pytestmark = pytest.mark.skipif(not available(), reason="the block_copy C++ extension could not be built here")


def _cache(dtype: torch.dtype = torch.float32, layers: int = 5, blocks: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(layers, 2, blocks, 4, 3, 8, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layers,ids", [((0, 5), [8, 0, 3]), ((2, 3), [4]), ((1, 4), list(range(9)))])
def test_fused_frame_equals_the_plain_path_byte_for_byte(dtype, layers, ids) -> None:
    kv = _cache(dtype)
    meta = KvChunkMeta("r", "t", 7, layers[0], layers[1], [11, 12], 4, 8)
    fused = frame_kv_chunk(meta, kv, ids)
    plain = frame_bytes(encode_kv_chunk(meta, gather_blocks(kv, *layers, ids)))
    assert isinstance(fused, bytes) and fused == plain
    header, tensor = decode_chunk(parse_frame(fused))  # the receiver verifies the checksum
    assert header["checksum"] == crc32c(gather_blocks(kv, *layers, ids))
    assert torch.equal(tensor, gather_blocks(kv, *layers, ids))


def test_small_checksums_keep_their_fixed_width_encoding() -> None:
    # a CRC below 2**16 still fills the 4-byte slot; the header decodes to the same number
    kv = torch.zeros(1, 2, 1, 4, 1, 2)
    meta = KvChunkMeta("r", "t", 0, 0, 1, [0], 4)
    for value in range(200):
        kv.view(-1)[0] = float(value)
        wire = frame_kv_chunk(meta, kv, [0])
        header, _ = decode_chunk(parse_frame(wire))
        assert header["checksum"] == crc32c(kv)
        assert wire == frame_bytes(encode_kv_chunk(meta, kv))


def test_caches_the_kernel_cannot_read_take_the_plain_path() -> None:
    kv = _cache()
    meta = KvChunkMeta("r", "t", 0, 1, 3, [0], 4)
    strided = kv.transpose(0, 1).contiguous().transpose(0, 1)  # layers not contiguous
    assert frame_kv_chunk(meta, strided, [1]) is None
    shards = HeadShards.of([(kv[..., :2, :].contiguous(), 0, 2), (kv[..., 2:, :].contiguous(), 2, 3)])
    assert frame_kv_chunk(meta, shards, [1]) is None


def test_bad_chunk_arguments_raise_like_the_plain_path() -> None:
    kv = _cache()
    with pytest.raises(ValueError, match="block ids must lie in"):
        frame_kv_chunk(KvChunkMeta("r", "t", 0, 0, 1, [0], 4), kv, [9])
    with pytest.raises(ValueError, match="layer range"):
        frame_kv_chunk(KvChunkMeta("r", "t", 0, 4, 6, [0], 4), kv, [0])
    with pytest.raises(ValueError, match="token_start"):
        frame_kv_chunk(KvChunkMeta("r", "t", 0, 0, 1, [0], 4, 3), kv, [0])


def test_kernel_argument_checks_name_the_argument() -> None:
    kernel, crc = load("block_copy"), crc32c_extend_address()
    rows = torch.zeros(2, 4, 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"index\[1\] = 4 outside \[0, 4\)"):
        kernel.gather_framed(b"\x00" * 8, rows, torch.tensor([0, 4]), crc, 0)
    with pytest.raises(RuntimeError, match="crc_pos 6 leaves no 4 bytes"):
        kernel.gather_framed(b"\x00" * 8, rows, torch.tensor([0]), crc, 6)
    with pytest.raises(RuntimeError, match="rows must be a CPU uint8"):
        kernel.gather_framed(b"", rows.float(), torch.tensor([0]), crc, 0)
    with pytest.raises(RuntimeError, match="null function address"):
        kernel.gather_crc(rows, torch.tensor([1]), torch.zeros(32, dtype=torch.uint8), 0)
    assert msgpack.unpackb(b"\xce\x00\x00\x00\x05") == 5  # the slot's encoding is plain msgpack


def test_fused_gather_returns_the_blocks_and_their_checksum() -> None:
    from kvtransfer.onepass import gather_checked

    kv = _cache(torch.bfloat16)
    tensor, crc = gather_checked(kv, 1, 4, [7, 2])
    assert torch.equal(tensor, gather_blocks(kv, 1, 4, [7, 2])) and crc == crc32c(tensor)
    assert gather_checked(kv.transpose(0, 1).contiguous().transpose(0, 1), 1, 4, [7]) is None
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU uint8 tensor of 64 bytes"):
        load("block_copy").gather_crc(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.tensor([1, 2]),
                                      torch.zeros(63, dtype=torch.uint8), crc32c_extend_address())

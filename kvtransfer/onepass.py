"""KV blocks to a sender's wire bytes (or tensor) in one pass over memory: copy and CRC32C fused.

The plain path of a ``"kv"`` chunk streams its bytes three times on the sender: it gathers the
blocks into a buffer (:func:`~kvtransfer.blocks.gather_blocks`), checksums it
(:func:`~kvtransfer.checksum.crc32c`) and copies it into the framed message
(:func:`~kvtransfer.frames.frame_bytes`, holding the GIL). The C++ kernel ``block_copy``
(:mod:`engine.kernels.cpu.build`) does it in one pass: every block row is copied straight to its
place and checksummed while it is in cache, by google-crc32c's own ``crc32c_extend`` (its
address from :func:`~kvtransfer.checksum.crc32c_extend_address`), with the GIL released
throughout. (The receiver keeps checking before it writes: it checks each message on its
read-ahead thread while the previous one is written, :mod:`kvtransfer.grpc_receiver`.)

* :func:`frame_kv_chunk` (sender): the chunk's wire bytes, the gathered rows written straight
  into the one ``bytes`` object gRPC sends, after a header whose ``checksum`` is filled in
  (:func:`~kvtransfer.wire.kv_header_template`). The bytes equal
  ``frame_bytes(encode_kv_chunk(meta, gather_blocks(...)))``.
* :func:`gather_checked` (a sender whose tensor travels outside the message, ``torch_dist``): the
  gathered tensor and its CRC32C.

Both return ``None`` where the fused kernel cannot run (no compiler at install, google-crc32c
without its C library, a cache off the CPU, in head shards or not contiguous): the caller
takes the plain path, which produces the same bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.kernels.cpu.build import load
from kvtransfer.blocks import block_index, check_kv_cache, check_layers
from kvtransfer.checksum import crc32c_extend_address
from kvtransfer.frames import frame_prefix
from kvtransfer.wire import KvChunkMeta, kv_header_template


@functools.cache
def _kernel() -> tuple[ModuleType, int] | None:
    address = crc32c_extend_address()
    if address is None:
        return None
    module = load("block_copy")
    return None if module is None else (module, address)


def available() -> bool:
    """Whether the fused kernel runs in this process (else both functions return ``None``)."""
    return _kernel() is not None


@dataclass(frozen=True, slots=True)
class _Rows:
    """The kernel's view of one chunk's source: the block rows ``[layers * 2, num_blocks, row bytes]``
    (uint8) of the layer range, the block ids and the gathered tensor's shape."""

    module: ModuleType
    crc_extend: int
    rows: torch.Tensor
    index: torch.Tensor
    shape: tuple[int, ...]


def _rows(kv_cache: torch.Tensor, layer_start: int, layer_end: int,
          block_ids: Sequence[int] | torch.Tensor) -> _Rows | None:
    """The chunk's rows, or ``None`` where the kernel cannot read this cache (module docstring).

    Raises:
        ValueError: bad cache layout, layer range or block id.
    """
    kernel = _kernel()
    if kernel is None or not isinstance(kv_cache, torch.Tensor) or kv_cache.device.type != "cpu":
        return None
    check_kv_cache(kv_cache)
    check_layers(kv_cache, layer_start, layer_end)
    part = kv_cache[layer_start:layer_end]
    if not part.is_contiguous():
        return None
    idx = block_index(block_ids, kv_cache.shape[2], kv_cache.device)
    rows = part.view(part.shape[0] * 2, part.shape[2], -1).view(torch.uint8)
    return _Rows(*kernel, rows, idx, (part.shape[0], 2, idx.numel(), *part.shape[3:]))


def frame_kv_chunk(meta: KvChunkMeta, kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> bytes | None:
    """The wire bytes of the ``"kv"`` chunk of ``meta`` over the blocks ``block_ids`` of ``kv_cache``.

    Args:
        meta: the chunk's addressing (its layers ``[meta.layer_start, meta.layer_end)``).
        kv_cache: the sender's ``[L, 2, num_blocks, block_size, H, D]`` paged cache (floating dtype).
        block_ids: the source blocks, in payload order.

    Returns:
        ``frame_bytes(encode_kv_chunk(meta, gather_blocks(kv_cache, ...)))``, byte for byte: header and
        payload (``layers * 2 * n * block_size * H * D`` elements) with the payload's CRC32C; or ``None``
        where the fused kernel cannot run on this cache (module docstring).

    Raises:
        ValueError: bad cache layout, layer range, block id, or ``meta`` (as :func:`encode_kv_chunk`).
    """
    src = _rows(kv_cache, meta.layer_start, meta.layer_end, block_ids)
    if src is None:
        return None
    header = kv_header_template(meta, kv_cache.dtype, src.shape)
    prefix, header_end = frame_prefix(header, src.rows.shape[0] * src.index.numel() * src.rows.shape[2])
    return src.module.gather_framed(prefix, src.rows, src.index, src.crc_extend, header_end - 4)


def gather_checked(kv_cache: torch.Tensor, layer_start: int, layer_end: int,
                   block_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """:func:`~kvtransfer.blocks.gather_blocks` into a new tensor and that tensor's CRC32C, in one pass.

    Returns:
        ``([layer_end - layer_start, 2, n, block_size, H, D] tensor of the cache's dtype, CRC32C)``,
        or ``None`` where the fused kernel cannot run on this cache (module docstring).

    Raises:
        ValueError: bad cache layout, layer range or block id.
    """
    src = _rows(kv_cache, layer_start, layer_end, block_ids)
    if src is None:
        return None
    out = torch.empty(src.shape, dtype=kv_cache.dtype)
    return out, src.module.gather_crc(src.rows, src.index, out.view(-1).view(torch.uint8), src.crc_extend)

"""Split one transfer (layers x blocks) into chunks that fit a message size limit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: layers ``[layer_start, layer_end)`` of the transfer's blocks ``[block_start, block_end)``.

    Block indices are positions in the transfer's block lists (the same
    position in the source and destination lists), not block ids.
    """

    layer_start: int
    layer_end: int
    block_start: int
    block_end: int


def plan_chunks(
    num_layers: int,
    num_blocks: int,
    bytes_per_layer_block: int,
    layers_per_chunk: int,
    max_chunk_bytes: int,
) -> list[ChunkSpec]:
    """Cover ``num_layers x num_blocks`` with layer-major chunks of at most ``max_chunk_bytes``.

    Each chunk has at most ``layers_per_chunk`` layers; when a chunk of all
    blocks would be too large, fewer layers are used, down to one layer, and
    below that the blocks are split.

    Args:
        num_layers: layers of the transfer (>= 1).
        num_blocks: blocks of the transfer (>= 1).
        bytes_per_layer_block: payload bytes of one block of one layer, K and V
            (``2 * block_size * num_kv_heads * head_dim * itemsize``).
        layers_per_chunk: upper bound on layers per chunk (>= 1).
        max_chunk_bytes: upper bound on payload bytes per chunk.

    Returns:
        Chunks in send order: layer groups ascending, blocks ascending within.

    Raises:
        ValueError: a non-positive argument, or one block of one layer is larger
            than ``max_chunk_bytes``.
    """
    for name, v in (
        ("num_layers", num_layers),
        ("num_blocks", num_blocks),
        ("bytes_per_layer_block", bytes_per_layer_block),
        ("layers_per_chunk", layers_per_chunk),
        ("max_chunk_bytes", max_chunk_bytes),
    ):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if bytes_per_layer_block > max_chunk_bytes:
        raise ValueError(
            f"one block of one layer is {bytes_per_layer_block} bytes, "
            f"over max_chunk_bytes={max_chunk_bytes}"
        )
    blocks_per_chunk = min(num_blocks, max_chunk_bytes // bytes_per_layer_block)
    if blocks_per_chunk < num_blocks:
        layers = 1
    else:
        layers = min(layers_per_chunk, max(1, max_chunk_bytes // (num_blocks * bytes_per_layer_block)))
    return [
        ChunkSpec(l0, min(l0 + layers, num_layers), b0, min(b0 + blocks_per_chunk, num_blocks))
        for l0 in range(0, num_layers, layers)
        for b0 in range(0, num_blocks, blocks_per_chunk)
    ]

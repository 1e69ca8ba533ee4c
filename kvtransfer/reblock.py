"""Re-blocking: map a transfer's tokens from the sender's blocks onto the receiver's.

A transfer moves ``n`` tokens. The sender holds them in ``len(src)`` blocks of
``src_block_size`` tokens, the receiver reserved ``len(dst)`` blocks of
``dst_block_size`` tokens; the sizes may differ (any positive sizes, powers of
two in practice). Token ``t`` of the transfer lives in source block
``src[t // src_block_size]`` slot ``t % src_block_size`` and goes to
destination block ``dst[t // dst_block_size]`` slot ``t % dst_block_size``.
Source tokens past the destination's capacity (the padding of the last source
block) are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtransfer.blocks import HeadShards, check_kv_cache, copy_rows, scatter_blocks, synchronize_shards


def check_same_tokens(num_src_blocks: int, src_block_size: int, num_dst_blocks: int, dst_block_size: int) -> None:
    """Check that both block lists can hold the same token count ``n``.

    Each side holds ``n`` tokens in its blocks with only its last block partly
    filled: ``(num_blocks - 1) * block_size < n <= num_blocks * block_size``.
    Such an ``n`` must exist on both sides. This is stricter than "the
    capacities differ by less than one block": it also rules out a destination
    block that no source token reaches (or a source block wholly past the
    destination), which would leave reserved KV unwritten.

    Raises:
        ValueError: a count or size below 1, or no common token count.
    """
    for name, v in (("num_src_blocks", num_src_blocks), ("src_block_size", src_block_size),
                    ("num_dst_blocks", num_dst_blocks), ("dst_block_size", dst_block_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    low = max((num_src_blocks - 1) * src_block_size, (num_dst_blocks - 1) * dst_block_size)
    high = min(num_src_blocks * src_block_size, num_dst_blocks * dst_block_size)
    if low >= high:
        raise ValueError(
            f"source ({num_src_blocks} blocks of {src_block_size} tokens) and destination "
            f"({num_dst_blocks} blocks of {dst_block_size} tokens) cannot hold the same tokens"
        )


def dest_block_range(num_dst_blocks: int, dst_block_size: int, token_start: int, token_end: int) -> tuple[int, int]:
    """Positions ``[first, last)`` in the destination block list that tokens ``[token_start, token_end)`` touch.

    ``token_end`` is clipped to the destination's capacity
    ``num_dst_blocks * dst_block_size``.

    Raises:
        ValueError: ``token_start`` negative, not below ``token_end`` or not
            below the capacity.
    """
    capacity = num_dst_blocks * dst_block_size
    if not 0 <= token_start < min(token_end, capacity):
        raise ValueError(
            f"token range [{token_start}, {token_end}) does not start inside the destination's "
            f"{capacity} tokens"
        )
    end = min(token_end, capacity)
    return token_start // dst_block_size, -(-end // dst_block_size)


def _scatter_shards(shards: HeadShards, layer_start: int, layer_end: int, reserved_block_ids: Sequence[int],
                    token_start: int, blocks: torch.Tensor) -> int:
    if blocks.dim() != 6 or blocks.shape[4] != shards.num_heads:
        raise ValueError(f"blocks shape {tuple(blocks.shape)} does not carry the cache's {shards.num_heads} KV heads")
    n = [scatter_tokens(t, layer_start, layer_end, reserved_block_ids, token_start, blocks[..., lo:hi, :])
         for t, lo, hi in shards.parts]
    synchronize_shards(shards)
    return n[0]


def scatter_tokens(
    kv_cache: "torch.Tensor | HeadShards",
    layer_start: int,
    layer_end: int,
    reserved_block_ids: Sequence[int],
    token_start: int,
    blocks: torch.Tensor,
) -> int:
    """Write the tokens of sender blocks into a reservation of the receiver's cache, in place.

    Args:
        kv_cache: ``[L, 2, num_blocks, dst_block_size, H, D]`` receiver cache (modified), contiguous
            unless the fast path applies; or its :class:`~kvtransfer.blocks.HeadShards` (each part its heads).
        layer_start: first layer (inclusive).
        layer_end: last layer (exclusive).
        reserved_block_ids: the whole reservation, in token order.
        token_start: position in the transfer of ``blocks``' first token.
        blocks: ``[layer_end - layer_start, 2, n, src_block_size, H, D]``, any
            floating dtype and device (cast/copied to the cache's).

    Returns:
        Tokens written (tokens past the reservation's capacity are dropped).

    Fast path: same block size and whole destination blocks -> one
    ``index_copy_`` over blocks; otherwise one ``index_copy_`` over token slots.

    Raises:
        ValueError: bad cache layout, layer range, shape, block id, or a token
            range that does not start inside the reservation.
    """
    if isinstance(kv_cache, HeadShards):  # each tensor-parallel rank's heads into its own share
        return _scatter_shards(kv_cache, layer_start, layer_end, reserved_block_ids, token_start, blocks)
    check_kv_cache(kv_cache)
    num_layers, _, num_blocks, dst_bs, heads, head_dim = kv_cache.shape
    if not 0 <= layer_start < layer_end <= num_layers:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) outside [0, {num_layers})")
    n_layers = layer_end - layer_start
    if blocks.dim() != 6 or tuple(blocks.shape[:2]) != (n_layers, 2) or tuple(blocks.shape[4:]) != (heads, head_dim):
        raise ValueError(f"blocks shape {tuple(blocks.shape)} != ({n_layers}, 2, n, block_size, {heads}, {head_dim})")
    n_tokens = blocks.shape[2] * blocks.shape[3]
    first, last = dest_block_range(len(reserved_block_ids), dst_bs, token_start, token_start + n_tokens)
    end = min(token_start + n_tokens, len(reserved_block_ids) * dst_bs)
    touched = list(reserved_block_ids[first:last])
    if blocks.shape[3] == dst_bs and token_start % dst_bs == 0 and end - token_start == n_tokens:
        scatter_blocks(kv_cache, layer_start, layer_end, touched, blocks)
        return n_tokens
    ids = torch.as_tensor(list(reserved_block_ids), dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {list(reserved_block_ids)}")
    if not kv_cache.is_contiguous():
        raise ValueError("re-blocking writes need a contiguous kv_cache")
    t = torch.arange(token_start, end)
    slots = (ids[t // dst_bs] * dst_bs + t % dst_bs).to(kv_cache.device)
    tokens = blocks.reshape(n_layers * 2, n_tokens, heads * head_dim)[:, : end - token_start]
    # token rows of a [layers * 2, slots, H * D] view: one row copy per token and layer
    flat = kv_cache[layer_start:layer_end].view(n_layers * 2, num_blocks * dst_bs, heads * head_dim)
    copy_rows(flat, slots, tokens.to(device=kv_cache.device, dtype=kv_cache.dtype))
    return end - token_start

"""Re-blocking: sender and receiver with different block sizes, token-exact, over gRPC on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kv_helpers import Receiver, sender_cache, start_receiver, tokens_of

from decode_worker.transfers import TransferTable
from kvtransfer import GrpcKvSender, KvTransferError, StaleTransferError, TransferState
from kvtransfer.reblock import check_same_tokens, dest_block_range, scatter_tokens

LAYERS = 3


def test_same_tokens_check() -> None:
    check_same_tokens(3, 16, 2, 32)  # 33..48 tokens fit both
    check_same_tokens(1, 64, 4, 16)  # 49..64
    check_same_tokens(2, 16, 2, 16)
    with pytest.raises(ValueError, match="same tokens"):
        check_same_tokens(2, 16, 3, 16)  # a destination block no token reaches
    with pytest.raises(ValueError, match="same tokens"):
        check_same_tokens(5, 16, 1, 64)  # a source block wholly past the destination
    with pytest.raises(ValueError, match=">= 1"):
        check_same_tokens(1, 0, 1, 16)


def test_dest_block_range_clips_to_capacity() -> None:
    assert dest_block_range(2, 32, 0, 48) == (0, 2)
    assert dest_block_range(2, 32, 32, 48) == (1, 2)
    assert dest_block_range(2, 32, 48, 64) == (1, 2)  # splits destination block 1
    assert dest_block_range(4, 16, 0, 64) == (0, 4)
    assert dest_block_range(3, 16, 32, 96) == (2, 3)  # tail padding past 48 dropped
    with pytest.raises(ValueError):
        dest_block_range(2, 16, 32, 48)


def test_scatter_tokens_fast_and_token_paths_agree() -> None:
    src = sender_cache(LAYERS, 4, 8)
    blocks = src[:, :, [2, 0]]  # 16 tokens in blocks of 8
    fast = torch.zeros(LAYERS, 2, 6, 8, 2, 4)
    assert scatter_tokens(fast, 0, LAYERS, [5, 1, 3], 8, blocks) == 16  # whole blocks, same size
    assert torch.equal(fast[:, :, 1], src[:, :, 2]) and torch.equal(fast[:, :, 3], src[:, :, 0])
    wide = torch.zeros(LAYERS, 2, 3, 16, 2, 4)
    assert scatter_tokens(wide, 0, LAYERS, [2, 0], 8, blocks) == 16  # tokens 8..23 into blocks of 16
    assert torch.equal(wide[:, :, 2, 8:], src[:, :, 2]) and torch.equal(wide[:, :, 0, :8], src[:, :, 0])
    assert wide[:, :, 2, :8].abs().sum() == 0 and wide[:, :, 1].abs().sum() == 0


def test_table_rejects_block_ids_not_matching_the_token_range() -> None:
    table = TransferTable(torch.zeros(LAYERS, 2, 8, 32, 2, 4))
    gen = table.open("t", "r", [4, 6], deadline=1e18)
    kv = sender_cache(LAYERS, 3, 16)
    before = table.kv_cache.clone()
    for ids, start in (([6, 4], 0), ([4], 0), ([4, 6], 32), ([6], 64)):
        with pytest.raises(StaleTransferError):
            table.write("t", gen, 0, LAYERS, ids, kv, token_start=start)
    with pytest.raises(StaleTransferError, match="not open"):
        table.write("t", gen + 1, 0, LAYERS, [4, 6], kv)
    assert torch.equal(table.kv_cache, before)
    table.write("t", gen, 0, LAYERS, [4, 6], kv)  # 48 tokens into 2 blocks of 32
    assert torch.equal(tokens_of(table.kv_cache, [4, 6], 48), tokens_of(kv, [0, 1, 2], 48))


@pytest.fixture
def sender() -> Iterator[GrpcKvSender]:
    s = GrpcKvSender(timeout_s=10.0)
    yield s
    s.close()


def _receiver(block_size: int) -> Receiver:
    return start_receiver(LAYERS, 12, block_size)


@pytest.mark.parametrize(
    "src_bs, dst_bs, num_tokens",
    [(16, 32, 64), (32, 16, 64), (16, 16, 48), (16, 32, 33), (64, 16, 50), (32, 16, 33)],
)
def test_reblocked_transfer_is_token_exact(src_bs, dst_bs, num_tokens, sender) -> None:
    recv = _receiver(dst_bs)
    try:
        cache = sender_cache(LAYERS, 10, src_bs)
        src = list(range(9, 9 - (-(-num_tokens // src_bs)), -1))
        n_dst = -(-num_tokens // dst_bs)
        dst = [11 - 2 * i for i in range(n_dst)]
        dest = recv.reserve("t1", dst)
        result = sender.send("r1", "t1", dest, cache, src, 5, layers_per_chunk=2)
        assert result.num_chunks == 2 and recv.sink.completed == {"t1": 5}
        assert torch.equal(tokens_of(recv.cache, dst, num_tokens), tokens_of(cache, src, num_tokens))
        others = [b for b in range(12) if b not in dst]
        assert torch.all(recv.cache[:, :, others] == -1)
        assert sender.poll("t1") == recv.servicer.poll("t1") == TransferState.SUCCESS
    finally:
        recv.server.stop(0)


@pytest.mark.parametrize("src_bs, dst_bs, blocks_per_chunk", [(8, 32, 1), (16, 32, 3)])
def test_chunk_plan_splitting_a_destination_block(src_bs, dst_bs, blocks_per_chunk) -> None:
    """Chunks of 1 (or 3) sender blocks: a destination block is filled by several chunks."""
    recv = _receiver(dst_bs)
    block_bytes = 2 * src_bs * 2 * 4 * 4
    s = GrpcKvSender(timeout_s=10.0, max_chunk_bytes=blocks_per_chunk * block_bytes)
    try:
        num_tokens = 70
        cache = sender_cache(LAYERS, 10, src_bs)
        src = list(range(-(-num_tokens // src_bs)))
        dst = [3, 0, 7]
        result = s.send("r1", "t1", recv.reserve("t1", dst), cache, src, 1, layers_per_chunk=LAYERS)
        assert result.num_chunks == LAYERS * -(-len(src) // blocks_per_chunk)
        assert torch.equal(tokens_of(recv.cache, dst, num_tokens), tokens_of(cache, src, num_tokens))
    finally:
        s.close()
        recv.server.stop(0)


def test_stale_block_ids_are_dropped(sender) -> None:
    """The sender was told other block ids than reserved: the first chunk is stale, nothing written."""
    recv = _receiver(32)
    try:
        dest = recv.reserve("t1", [4, 6])
        del dest.block_ids[:]
        dest.block_ids.extend([6, 4])
        before = recv.cache.clone()
        with pytest.raises(KvTransferError, match="stale"):
            sender.send("r1", "t1", dest, sender_cache(LAYERS, 4, 16), [0, 1, 2], 5)
        assert torch.equal(recv.cache, before) and recv.sink.writes == 0
        assert recv.servicer.poll("t1") == TransferState.FAILED
    finally:
        recv.server.stop(0)

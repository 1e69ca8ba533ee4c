"""Chained content hashes of full KV blocks, for prefix caching.

``hash(block i) = blake2b(hash(block i-1) || model id || token ids of block i)``,
so equal hashes mean equal token prefixes up to and including that block (vLLM v1's
``hash_block_tokens`` scheme). Hashes are 8-byte ``bytes``, stable across processes,
so a router can compute them and compare them with what prefill workers publish.
"""

from __future__ import annotations

import hashlib
import struct

HASH_BYTES = 8


def block_hashes(token_ids: list[int], block_size: int, model_id: str, parent: bytes = b"") -> list[bytes]:
    """Hashes of every *full* block of ``token_ids`` (a partial last block has none).

    Args:
        token_ids: the sequence's tokens.
        block_size: tokens per block.
        model_id: model identity (KV from another model must never match).
        parent: hash of the block before ``token_ids[0]`` (``b""`` at the start).

    Returns:
        ``len(token_ids) // block_size`` hashes of :data:`HASH_BYTES` bytes.
    """
    out: list[bytes] = []
    prev = parent
    salt = model_id.encode()
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        h = hashlib.blake2b(prev + salt + struct.pack(f"<{block_size}I", *block), digest_size=HASH_BYTES)
        prev = h.digest()
        out.append(prev)
    return out

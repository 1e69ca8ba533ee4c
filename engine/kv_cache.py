"""The paged KV cache tensor of one worker."""

from __future__ import annotations

import torch

from common.model_config import ModelConfig
from engine.config import CacheConfig


def allocate_kv_cache(model: ModelConfig, cache: CacheConfig, device: torch.device) -> torch.Tensor:
    """Zeroed cache ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Index 0 of dim 1 is K, 1 is V. Size in bytes:
    ``num_blocks * block_size * model.kv_bytes_per_token(dtype bytes)``.
    """
    dtype = getattr(torch, cache.dtype)
    return torch.zeros(
        model.num_layers, 2, cache.num_blocks, cache.block_size, model.num_kv_heads, model.head_dim,
        dtype=dtype, device=device,
    )

"""Name -> attention backend registry (``"torch"`` serves on CPU: the C++ paged decode kernel for
decode rows where it is built, gather + SDPA for the rest; ``"sdpa"``: gather + SDPA only, the
plain-torch path; ``"batch-invariant"``: every row through the C++ paged decode kernel, each row's
output the same whatever the step holds; ``"triton"`` on CUDA)."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """``forward(q, k_cache, v_cache, meta, scale, window=None) -> out``.

    q: ``[T, num_heads, head_dim]``; k_cache / v_cache: one layer's cache,
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; returns ``[T, num_heads, head_dim]``.
    ``window``: the layer's sliding window in tokens (a query at position ``p`` attends to
    positions ``p - window + 1 .. p``), None = the whole causal context.
    """

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, window: int | None = None,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def attention_backend_names() -> list[str]:
    """The registered backends' names, sorted (:data:`engine.config.ATTENTION_BACKENDS` lists them
    with ``"auto"`` for the flags and configs that cannot import torch)."""
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """Raises KeyError naming the known backends."""
    if name not in _BACKENDS:
        raise KeyError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def _torch_factory() -> AttentionBackend:
    from engine.attention.torch_backend import paged_attention_torch

    return paged_attention_torch


register_attention_backend("torch", _torch_factory)


def _sdpa_factory() -> AttentionBackend:
    from engine.attention.torch_backend import paged_attention_sdpa

    return paged_attention_sdpa


register_attention_backend("sdpa", _sdpa_factory)


def _batch_invariant_factory() -> AttentionBackend:
    from engine.attention.torch_backend import paged_attention_batch_invariant

    return paged_attention_batch_invariant


register_attention_backend("batch-invariant", _batch_invariant_factory)


def _triton_factory() -> AttentionBackend:
    from engine.kernels.triton_backend import paged_attention_triton

    return paged_attention_triton


register_attention_backend("triton", _triton_factory)

"""Attention backends over the paged KV cache, chosen by name from a registry."""

from engine.attention.metadata import AttentionMetadata, SeqSlice, build_attention_metadata
from engine.attention.registry import get_attention_backend, register_attention_backend

__all__ = [
    "AttentionMetadata",
    "SeqSlice",
    "build_attention_metadata",
    "get_attention_backend",
    "register_attention_backend",
]

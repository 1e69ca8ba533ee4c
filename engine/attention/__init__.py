"""Attention backends over the paged KV cache, chosen by name from a registry."""

from engine.attention.metadata import AttentionMetadata, SeqSlice, build_attention_metadata
from engine.attention.registry import attention_backend_names, get_attention_backend, register_attention_backend

__all__ = [
    "AttentionMetadata",
    "SeqSlice",
    "attention_backend_names",
    "build_attention_metadata",
    "get_attention_backend",
    "register_attention_backend",
]

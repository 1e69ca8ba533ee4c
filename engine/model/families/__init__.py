"""Model families by HF ``model_type``: import this package to have them all registered.

Adding a family = one module here declaring its config mapping (see
:mod:`engine.model.families.registry`) plus its import below.
"""

from engine.model.families import gemma3, llama, qwen2, qwen3  # noqa: F401  (each registers itself)
from engine.model.families.registry import (
    Family,
    families,
    family_for,
    load_arch,
    register_family,
    supported_architectures,
)

__all__ = ["Family", "families", "family_for", "load_arch", "register_family", "supported_architectures"]

"""Tensor parallelism inside one worker: ``size`` processes on one node, each holding a
shard of every weight and its own share of the paged KV cache.

Layout (Megatron-style, as vLLM): q/k/v and gate/up are column-parallel (each rank
holds a slice of the output features: its attention heads, its MLP columns), o and down
are row-parallel (a slice of the input features, the partial outputs summed by an
all-reduce), the embedding and LM head are vocab-parallel (rows split; the embedding's
partial lookups summed, the LM head's partial logits all-gathered before sampling).
With fewer KV heads than ranks each KV head is replicated on ``size / num_kv_heads``
ranks. Rank 0 is the worker: its scheduler plans every step and hands the plan to the
other ranks (:mod:`engine.tp.runner`), which run the same step on their shard
(:mod:`engine.tp.executor`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.model_config import ConfigError, ModelConfig


@dataclass(frozen=True)
class TpLayout:
    """How a model splits over ``size`` ranks.

    Attributes:
        size: ranks (1 = no tensor parallelism).
        num_heads / num_kv_heads / intermediate_size / vocab_size: the whole model's.

    Raises:
        ConfigError: ``size`` < 1, heads or MLP width not divisible by ``size``, or KV
            heads neither a multiple nor a divisor of ``size``.
    """

    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {self.size}")
        if self.num_heads % self.size:
            raise ConfigError(f"tensor-parallel size {self.size} must divide num_attention_heads ({self.num_heads})")
        if self.num_kv_heads % self.size and self.size % self.num_kv_heads:
            raise ConfigError(f"tensor-parallel size {self.size} and num_key_value_heads ({self.num_kv_heads}) "
                              "must divide one another")
        if self.intermediate_size % self.size:
            raise ConfigError(f"tensor-parallel size {self.size} must divide intermediate_size "
                              f"({self.intermediate_size})")

    @classmethod
    def of(cls, cfg: ModelConfig, size: int) -> "TpLayout":
        """The layout of ``cfg`` over ``size`` ranks (validated)."""
        return cls(size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def local_vocab(self) -> int:
        """Rows of the embedding / LM head per rank (the last rank's tail is zero padding)."""
        return -(-self.vocab_size // self.size)

    def kv_heads(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the model's KV heads rank ``rank`` holds (replicated heads
        appear on several ranks)."""
        if self.num_kv_heads >= self.size:
            return rank * self.local_kv_heads, (rank + 1) * self.local_kv_heads
        h = rank // (self.size // self.num_kv_heads)
        return h, h + 1

    def owners(self) -> list[int]:
        """One rank per distinct KV head range, in head order (the ranks a full-head copy
        of the cache is gathered from)."""
        seen: dict[tuple[int, int], int] = {}
        for r in range(self.size):
            seen.setdefault(self.kv_heads(r), r)
        return list(seen.values())

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with one rank's dimensions (heads, KV heads, MLP width, vocab rows)."""
        return replace(cfg, num_heads=self.local_heads, num_kv_heads=self.local_kv_heads,
                       intermediate_size=self.intermediate_size // self.size, vocab_size=self.local_vocab)


__all__ = ["TpLayout"]

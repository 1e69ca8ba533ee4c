"""A tensor-parallel decoder: the shared :class:`~engine.model.decoder.CausalLM` built with
one rank's dimensions, its checkpoint sliced per rank, and the collectives that join
the shards (row-parallel all-reduce, vocab-parallel embedding and LM head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model_arch import DecoderArch
from common.model_config import ModelConfig
from engine.attention import get_attention_backend
from engine.model import build_unloaded, default_attention_backend, read_state
from engine.model.decoder import CausalLM
from engine.model.fuse import merge_projections
from engine.model.linear import apply_linear_backend, default_linear_backend
from engine.tp import TpLayout
from engine.tp.group import TpGroup

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


class RowParallel(nn.Module):
    """``inner(x)`` summed over the ranks: ``inner`` holds this rank's input-feature slice
    (and the bias on rank 0 only)."""

    def __init__(self, inner: nn.Module, group: TpGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * n, (rank + 1) * n)`` of the embedding (``weight``: ``[n, hidden]``);
    ids outside them look up zeros, and the ranks' lookups are summed."""

    def __init__(self, weight: torch.Tensor, start: int, group: TpGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce_(x)


class TpCausalLM(CausalLM):
    """One rank of a tensor-parallel :class:`CausalLM`: :meth:`head_logits` gathers every
    rank's vocab slice and returns ``[N, vocab_size]`` on every rank."""

    def __init__(self, cfg: ModelConfig, layout: TpLayout, group: TpGroup, arch, backend) -> None:
        super().__init__(layout.local_config(cfg), arch, backend)
        self.full_vocab, self.group = cfg.vocab_size, group

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(super().head_logits(hidden).contiguous())
        return torch.cat(parts, dim=-1)[..., : self.full_vocab]


def _kv_rows(layout: TpLayout, rank: int, head_dim: int) -> slice:
    lo, hi = layout.kv_heads(rank)
    return slice(lo * head_dim, hi * head_dim)


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, layout: TpLayout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of an HF state dict (names unchanged).

    q/gate/up rows and k/v rows (its KV heads) are column slices; o/down take the input
    columns (bias kept on rank 0 only, zeros elsewhere); embedding and LM head take
    ``layout.local_vocab`` rows (zero-padded at the end); norms are replicated.
    """
    n, d = layout.size, cfg.head_dim
    v0 = rank * layout.local_vocab
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        kind = name.split(".")[-2] if "." in name else ""
        if kind in ("k_proj", "v_proj"):
            w = w[_kv_rows(layout, rank, d)]
        elif kind in _COLUMN:
            w = w.chunk(n, dim=0)[rank]
        elif kind in _ROW:
            w = w.chunk(n, dim=-1)[rank] if name.endswith("weight") else (w if rank == 0 else torch.zeros_like(w))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = w[v0: v0 + layout.local_vocab]
            if w.shape[0] < layout.local_vocab:
                w = torch.cat([w, w.new_zeros(layout.local_vocab - w.shape[0], w.shape[1])])
        out[name] = w.contiguous()
    return out


def load_tp_model(cfg: ModelConfig, layout: TpLayout, group: TpGroup, device: torch.device, dtype: torch.dtype,
                  arch: DecoderArch, attention_backend: str | None = None,
                  linear_backend: str | None = None) -> TpCausalLM:
    """Build rank ``group.rank``'s shard of the model in ``cfg.path`` on ``device``.

    ``arch``: the family's layer differences, read once by rank 0
    (:func:`engine.tp.runner.start_tp_runner`) for every rank.

    Raises:
        FileNotFoundError / KeyError / ConfigError: as :func:`engine.model.load_model`.
    """
    state = shard_state(read_state(cfg.path), cfg, layout, group.rank)
    backend = get_attention_backend(attention_backend or default_attention_backend(device))
    model = build_unloaded(lambda: TpCausalLM(cfg, layout, group, arch, backend), device, dtype)
    model.load_weights(state)
    model.eval()
    emb = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(emb.weight.data, group.rank * layout.local_vocab, group)
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    merge_projections(model)  # this rank's q/k/v heads and gate/up columns: column-parallel parts merge locally
    apply_linear_backend(model, linear_backend or default_linear_backend(device, dtype))
    return model

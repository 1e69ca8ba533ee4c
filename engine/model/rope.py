"""Rotary position embeddings (rotate-half), computed as HF ``transformers`` does.

The inverse frequencies follow ``transformers.modeling_rope_utils`` for each
:data:`~common.model_arch.ROPE_KINDS` (default, linear, dynamic NTK, Llama 3.1,
YaRN), in float32, so greedy outputs match HF token for token. Static kinds use a
cos/sin table ``[max_position, head_dim]`` looked up once per step. ``dynamic``
grows the NTK base with the sequence past ``max_position`` the way HF's
``dynamic_rope_update`` does for one sequence: every token of a step is rotated with
the base of its sequence's length at that step (so a prompt prefilled in one step
matches HF exactly; chunking or prefix reuse past ``max_position`` changes the
rotation, as it would in HF).
"""

from __future__ import annotations

import math

import torch

from common.model_arch import RopeSpec
from engine.attention import AttentionMetadata
from engine.kernels.cpu.rope_cache import rope_store_cpu, rope_store_reference, supports


def inv_freq(spec: RopeSpec, dim: int, seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """``([dim // 2] float32 inverse frequencies, cos/sin scale)`` of ``spec`` for ``head_dim`` ``dim``.

    ``seq_len`` (``dynamic`` only): ``[N]`` int64 sequence lengths past ``max_position``;
    the result is then ``[N, dim // 2]``.
    """
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = 1.0 / (spec.theta ** exps)
    if spec.kind == "linear":
        return base / spec.factor, 1.0
    if spec.kind == "llama3":
        return _llama3(spec, base), 1.0
    if spec.kind == "yarn":
        return _yarn(spec, dim)
    if spec.kind == "dynamic" and seq_len is not None:
        f, m = spec.factor, spec.max_position
        theta = spec.theta * ((f * seq_len.float() / m) - (f - 1)) ** (dim / (dim - 2))  # float32, as HF
        return 1.0 / (theta[:, None] ** exps[None, :]), 1.0
    return base, 1.0


def _llama3(spec: RopeSpec, freq: torch.Tensor) -> torch.Tensor:
    old = spec.original_max_position
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / spec.factor, freq)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    factor = spec.factor or spec.max_position / spec.original_max_position
    scale = spec.attention_factor

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if scale is None:
        scale = (mscale(factor, spec.mscale) / mscale(factor, spec.mscale_all_dim)
                 if spec.mscale and spec.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freq, float(scale)


class RotaryEmbedding:
    """cos/sin table ``[max_position, head_dim]`` (float32) of one :class:`RopeSpec`.

    A plain object, not a module: the table stays float32 whatever dtype the model is
    cast to (the step's rows are cast when looked up).

    Args:
        spec: the embedding.
        head_dim: rotated dimension (the whole head).
        max_position: table length in positions.
        device: where the table lives.
    """

    def __init__(self, spec: RopeSpec, head_dim: int, max_position: int,
                 device: torch.device | str | None = None) -> None:
        self.spec, self.head_dim = spec, head_dim
        freq, self.scale = inv_freq(spec, head_dim)
        self.cos, self.sin = (t.to(device) for t in _cos_sin(
            torch.arange(max_position, dtype=torch.float32)[:, None] * freq[None, :], self.scale))

    def for_step(self, meta: AttentionMetadata, dtype: torch.dtype) -> "RopeStep":
        """The rotation of one step's tokens (``meta.positions``), looked up once for all layers."""
        pos = meta.positions
        if self.spec.kind == "dynamic" and meta.max_seq_len > self.spec.max_position:
            return self._dynamic_step(meta, dtype)
        return RopeStep(self.cos[pos][:, None, :].to(dtype), self.sin[pos][:, None, :].to(dtype))

    def _dynamic_step(self, meta: AttentionMetadata, dtype: torch.dtype) -> "RopeStep":
        """``dynamic`` past ``max_position``: the tokens of a sequence longer than it get the
        NTK base of its length (HF ``dynamic_rope_update``), the others the table's rows."""
        pos = meta.positions
        cos, sin = self.cos[pos.clamp(max=self.cos.shape[0] - 1)], self.sin[pos.clamp(max=self.sin.shape[0] - 1)]
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        seq_len = meta.seq_lens.long().repeat_interleave(q_lens)  # [T] this step's length of each token's sequence
        grown = seq_len > self.spec.max_position
        freq, _ = inv_freq(self.spec, self.head_dim, seq_len[grown].cpu())
        cos[grown], sin[grown] = _cos_sin(pos[grown].float()[:, None] * freq.to(pos.device), self.scale)
        return RopeStep(cos[:, None, :].to(dtype), sin[:, None, :].to(dtype))


def _cos_sin(freqs: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RopeStep:
    """cos/sin ``[T, 1, D]`` of one step's positions; rotates ``q``/``k`` of every layer and stores
    its K/V (:meth:`rotate_and_store`)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                         layer: int, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotate ``q`` ``[T, H, D]`` and ``k`` ``[T, KH, D]``, write the rotated K and ``v`` into
        ``kv_cache[layer]`` (``[num_layers, 2, num_blocks, block_size, KH, D]``) at ``slot_mapping``
        (``[T]`` int64 flat slots), and return the rotated queries. The C++ kernel
        (:mod:`engine.kernels.cpu.rope_cache`: one call, bit-identical) where it takes the inputs
        (CPU float32, ``q`` may then be rotated in place), else the same torch expression.

        Raises:
            RuntimeError / IndexError: a slot outside the cache (from the kernel / ``index_copy_``).
        """
        if supports(q, kv_cache):
            return rope_store_cpu(q, k, v, self.cos, self.sin, kv_cache, layer, slot_mapping)
        return rope_store_reference(q, k, v, self.cos, self.sin, kv_cache, layer, slot_mapping)

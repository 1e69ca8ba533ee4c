"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

One :class:`Sampler` call turns the last-position logits of a decode batch into
one token per sequence. All arithmetic is vectorized over the batch; the only
per-row Python work is drawing one uniform from each seeded row's own
``torch.Generator``.

Algorithm (after vLLM ``vllm/v1/sample/sampler.py`` and
``vllm/v1/sample/ops/topk_topp_sampler.py``, ``apply_top_k_top_p``):

1. rows with temperature 0 take ``argmax`` of the raw logits;
2. other rows divide by their temperature, sort descending (stable, so ties
   rank by lower token id), mask ranks ``>= top_k`` and then every token whose
   preceding cumulative probability already reaches ``top_p`` (the top token
   always stays), renormalize with softmax;
3. each row draws one uniform ``u`` in [0, 1) and takes the first sorted token
   whose cumulative probability exceeds ``u`` (inverse-CDF sampling; vLLM uses
   the equivalent exponential race, which needs a vocab-sized draw per row).

Every row always goes through the same sorted path, so a seeded row's token is
a function of its own logits, options and generator state only, whatever the
batch composition or the row's slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_UINT64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingOptions:
    """Per-sequence sampling settings (semantics of ``pdcluster.v1.SamplingParams``).

    Attributes:
        temperature: softmax temperature, ``>= 0``; ``0`` means greedy.
        top_p: nucleus mass in ``(0, 1]``; ``1`` disables.
        top_k: keep the ``k`` most likely tokens; ``0`` disables.
        seed: per-request RNG seed (the caller owns the matching generator,
            see :func:`make_generator`), or ``None``.
        logprobs: number of top logprobs to return per token; ``0`` = none.

    Raises:
        ValueError: a field is out of range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed <= _UINT64_MAX:
            raise ValueError(f"seed must be a uint64, got {self.seed}")


@dataclass
class SamplerOutput:
    """Result of :meth:`Sampler.sample` for a batch of ``num_seqs`` rows.

    Attributes:
        token_ids: ``[num_seqs]`` int64, the chosen token of each row.
        logprobs: ``[num_seqs]`` float32, log-probability of each chosen token
            under the raw ``log_softmax`` of the logits (before temperature,
            top-k, top-p); ``None`` when no row asked for logprobs.
        top_ids: ``[num_seqs, max_n]`` int64, the ``max_n`` most likely token
            ids of each row, most likely first (``max_n`` = largest
            ``logprobs`` in the batch; a row asking for ``n`` uses the first
            ``n`` columns); ``None`` when no row asked.
        top_logprobs: ``[num_seqs, max_n]`` float32, raw log-probabilities of
            ``top_ids``; ``None`` when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a ``torch.Generator`` on ``device`` seeded with ``seed``.

    Keep one per seeded request for its whole life and pass it to every
    :meth:`Sampler.sample` call of that request.

    Raises:
        ValueError: ``seed`` is not a uint64.
    """
    if not 0 <= seed <= _UINT64_MAX:
        raise ValueError(f"seed must be a uint64, got {seed}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        seed: seed of the sampler-wide generators used by rows without their own
            generator (one generator per device, created on first use); ``None``
            seeds them non-deterministically.
        device: if given, create that device's sampler-wide generator now.

    RNG contract: each row with temperature > 0 consumes exactly one
    ``torch.rand(1, generator=g, device=g.device)`` from its own generator per
    call; greedy rows consume nothing. A worker that must skip a draw made
    elsewhere (e.g. the first token sampled by a prefill worker) repeats that
    call.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        if device is not None:
            # Resolve a bare "cuda" to its index so it keys like ``logits.device``.
            self._shared_generator(torch.empty(0, device=device).device)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        options: list[SamplingOptions],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        """Pick one token per row.

        Args:
            logits: ``[num_seqs, vocab]`` float32 (other float dtypes are
                upcast), on any device; not modified.
            options: ``num_seqs`` per-row settings.
            generators: ``num_seqs`` entries; a row with a generator draws its
                uniform from it (on the generator's device), a row with
                ``None`` from the sampler-wide generator. Greedy rows draw
                nothing.

        Returns:
            :class:`SamplerOutput` with tensors on ``logits.device``.

        Raises:
            ValueError: ``logits`` is not 2-D, list lengths differ from
                ``num_seqs``, or a row has a ``seed`` but no generator.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_seqs, vocab], got shape {tuple(logits.shape)}")
        num_seqs, vocab = logits.shape
        if len(options) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"got {len(options)} options and {len(generators)} generators for {num_seqs} rows"
            )
        for i, (opt, gen) in enumerate(zip(options, generators)):
            if opt.seed is not None and gen is None:
                raise ValueError(f"row {i} has seed {opt.seed} but no generator")
        device = logits.device
        logits = logits.float()

        token_ids = logits.argmax(dim=-1)
        rows = [i for i, opt in enumerate(options) if opt.temperature > 0.0]
        if rows:
            picked = self._sample_rows(logits, rows, options, generators)
            if len(rows) == num_seqs:
                token_ids = picked
            else:
                token_ids[torch.tensor(rows, device=device)] = picked

        max_n = max((opt.logprobs for opt in options), default=0)
        if max_n == 0:
            return SamplerOutput(token_ids=token_ids)
        logp = torch.log_softmax(logits, dim=-1)
        top_logprobs, top_ids = logp.topk(min(max_n, vocab), dim=-1)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=logp.gather(1, token_ids.unsqueeze(1)).squeeze(1),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
        )

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: list[int],
        options: list[SamplingOptions],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Random-sample ``rows`` (temperature > 0) of float32 ``logits``; returns ``[len(rows)]`` int64."""
        device = logits.device
        vocab = logits.shape[1]
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=device)]
        temp = torch.tensor([options[i].temperature for i in rows], device=device)
        top_p = torch.tensor([options[i].top_p for i in rows], device=device)
        top_k = torch.tensor([options[i].top_k for i in rows], device=device)
        uniforms = self._uniforms(rows, generators, device)

        sorted_logits, sorted_ids = torch.sort(
            logits / temp.unsqueeze(1), dim=-1, descending=True, stable=True
        )
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        k_eff = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        sorted_logits = sorted_logits.masked_fill(ranks >= k_eff.unsqueeze(1), float("-inf"))

        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        outside[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))

        cdf = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        pos = torch.searchsorted(cdf, uniforms.unsqueeze(1), right=True)
        last_kept = (sorted_logits > float("-inf")).sum(dim=-1, keepdim=True) - 1
        pos = torch.minimum(pos, last_kept.clamp(min=0))
        return sorted_ids.gather(1, pos).squeeze(1)

    def _uniforms(
        self,
        rows: list[int],
        generators: list[torch.Generator | None],
        device: torch.device,
    ) -> torch.Tensor:
        """One U[0, 1) float32 per row in ``rows``, on ``device``: ``[len(rows)]``."""
        shared = [j for j, i in enumerate(rows) if generators[i] is None]
        own = [j for j, i in enumerate(rows) if generators[i] is not None]
        if not own:
            return torch.rand(len(rows), generator=self._shared_generator(device), device=device)
        draws = [
            torch.rand(1, generator=generators[rows[j]], device=generators[rows[j]].device).to(device)
            for j in own
        ]
        uniforms = torch.empty(len(rows), device=device)
        uniforms[torch.tensor(own, device=device)] = torch.cat(draws)
        if shared:
            uniforms[torch.tensor(shared, device=device)] = torch.rand(
                len(shared), generator=self._shared_generator(device), device=device
            )
        return uniforms

"""Batched token sampling: logit bias, repetition / presence / frequency
penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One :class:`Sampler` call turns the last-position logits of a batch into one
token per sequence, vectorized over the batch on the logits' device; the only
per-row Python work is one uniform draw from each seeded row's own generator
and flattening the histories of rows with a penalty.

Order (vLLM's: ``vllm/v1/sample/sampler.py`` for bias then penalties then
greedy/temperature, ``vllm/model_executor/layers/sampler.py`` (v0) for
top-k/top-p then min-p; penalty formulas from ``vllm/model_executor/layers/
utils.py`` ``apply_penalties`` and HF ``RepetitionPenaltyLogitsProcessor``):

0. **allowed token ids** (vLLM's ``allowed_token_ids``): on a row that gives any, every
   other id gets ``-inf``;
1. **logit bias**: ``logits[t] += bias[t]``;
2. **repetition penalty** ``r`` over every token in prompt + output (HF
   semantics): a seen token's logit ``x`` becomes ``x / r`` if ``x > 0`` else
   ``x * r``;
3. **frequency / presence penalties** over output tokens only (OpenAI
   semantics): ``x -= frequency * count(t) + presence * (count(t) > 0)``;
   then **min_tokens** (vLLM's; HF's ``MinNewTokensLengthLogitsProcessor``): while
   a row's request has generated fewer than ``min_tokens`` tokens, the ids that would
   end it (EOS unless ``ignore_eos``, its stop token ids) get ``-inf``; then **bad words**
   (:mod:`engine.bad_words`); then a structured output's grammar mask (:mod:`engine.token_bitmask`);
4. rows with temperature 0 take ``argmax`` of these processed logits (bias and
   penalties apply to greedy rows too; lowest id wins a tie);
5. other rows divide by their temperature, sort descending (stable, so ties
   rank by lower token id), mask ranks ``>= top_k``, then every token whose
   preceding cumulative probability already reaches ``top_p``, then every
   token whose probability is below ``min_p`` times the top token's (the ratio
   is the same before and after renormalizing; the top token always stays);
6. each row draws one uniform ``u`` in [0, 1) and takes the first sorted token
   whose cumulative renormalized probability exceeds ``u`` (inverse-CDF
   sampling; vLLM uses the equivalent exponential race, which needs a
   vocab-sized draw per row).

Rows with no allowed ids, bias or penalty skip steps 0-3 (no history read); a batch with none never copies the logits.

Batch composition: every step above is row-local, and every row always goes
through the same sorted path, so a seeded row's token is a function of its own
logits, options, history and generator state only, whatever the batch
composition or the row's slot (``tests/test_sampling*.py``).

Greedy across batch sizes (measured and explained in ``docs/sampling.md``,
tested in ``tests/test_sampling_batch.py``): the sampler is row-local and
deterministic, so a greedy token is a function of its row's logits. The model
is not batch-invariant: on CPU float32 its batched GEMMs round differently for
different batch sizes and slots, so one request's logits move by float
rounding (at most 1.1e-4 absolute measured on SmolLM2-135M, 8 prompts x 32
steps in batches of 1, 8 and 16; no greedy token changed). Promise: the same
batch (same requests in the same slots) gives bit-identical tokens run after
run (same thread count); across batch sizes or slots a greedy token can differ only where the
request's top-2 logits are within 2e-3 (twice the tested logit tolerance of
1e-3), and after such a flip the continuations are different sequences.
Nothing stronger is promised on CUDA / bfloat16, where the rounding is larger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from common.sampling_params import Target, sampling_param, sampling_params
from engine.kernels.cpu.argmax import argmax_rows
from engine.logits_processors import History, apply_logits_processors, ban_early_stops, ban_ids
from engine.token_bitmask import apply_token_bitmasks


def _default(name: str):
    return sampling_param(name).default


GREEDY_BELOW = 1e-5
"""A temperature below this is greedy (``SamplingOptions`` stores it as 0): dividing the logits
by it would overflow float32 to infinities and the softmax to NaN (a temperature of 1e-40 gave
garbage tokens). vLLM's ``_SAMPLING_EPS`` (``vllm/sampling_params.py``), same value and rule."""


@dataclass(frozen=True)
class SamplingOptions:
    """Per-sequence sampling settings (semantics of ``pdcluster.v1.SamplingParams``).

    Attributes:
        temperature: softmax temperature, ``>= 0``; ``0`` (or below :data:`GREEDY_BELOW`) means greedy.
        top_p: nucleus mass in ``(0, 1]``; ``1`` disables.
        top_k: keep the ``k`` most likely tokens; ``0`` or ``-1`` (vLLM's) disables.
        seed: per-request RNG seed (the caller owns the matching generator,
            see :func:`make_generator`), or ``None``.
        logprobs: number of top logprobs to return per token; ``0`` = none.
        min_p: in ``[0, 1]``; keep tokens whose probability (after
            temperature) is ``>= min_p`` times the top token's; ``0`` disables.
        repetition_penalty: ``> 0`` (HF semantics) over prompt + output
            tokens; ``1`` disables.
        presence_penalty: in ``[-2, 2]`` (OpenAI semantics) over output
            tokens; ``0`` disables.
        frequency_penalty: in ``[-2, 2]`` (OpenAI semantics) over output
            tokens; ``0`` disables.
        logit_bias: ``(token_id, bias)`` pairs, bias in ``[-100, 100]``, added
            to the raw logits; a mapping is accepted and normalized to pairs
            sorted by token id. Ids are checked against the vocabulary by
            :meth:`Sampler.sample`.
        min_tokens: ``>= 0``; while the request has generated fewer tokens, the ids that
            would end it cannot be sampled (:func:`engine.logits_processors.ban_early_stops`);
            ``0`` disables.
        allowed_token_ids: when not empty, the only ids that can be sampled (sorted, unique;
            checked against the vocabulary by :meth:`Sampler.sample`); empty: every id.

    Defaults and ranges come from :mod:`common.sampling_params` (every parameter
    declared there with target ``SAMPLER`` is a field here).

    Raises:
        ValueError: a field is out of range or not finite, or ``logit_bias`` has
            a token id twice.
    """

    temperature: float = _default("temperature")
    top_p: float = _default("top_p")
    top_k: int = _default("top_k")
    seed: int | None = _default("seed")
    logprobs: int = _default("logprobs")
    min_p: float = _default("min_p")
    repetition_penalty: float = _default("repetition_penalty")
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    logit_bias: tuple[tuple[int, float], ...] = _default("logit_bias")
    min_tokens: int = _default("min_tokens")
    allowed_token_ids: tuple[int, ...] = _default("allowed_token_ids")

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in self.allowed_token_ids})))
        # built once per request, not per step (a 16384-id list rebuilt every step cost ~26 ms a row)
        object.__setattr__(self, "allowed_index", torch.tensor(self.allowed_token_ids, dtype=torch.int64)
                           if self.allowed_token_ids else None)
        if 0.0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs = tuple(sorted((int(t), float(b)) for t, b in pairs))
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias has a token id twice")
        object.__setattr__(self, "logit_bias", pairs)
        for param in sampling_params(Target.SAMPLER):
            problem = param.problem(getattr(self, param.name))
            if problem is not None:
                raise ValueError(problem)


@dataclass
class SamplerOutput:
    """Result of :meth:`Sampler.sample` for a batch of ``num_seqs`` rows.

    Attributes:
        token_ids: ``[num_seqs]`` int64, the chosen token of each row.
        logprobs: ``[num_seqs]`` float32, log-probability of each chosen token
            under the raw ``log_softmax`` of the model's logits (before logit
            bias, penalties, temperature, top-k, top-p, min-p: vLLM's default
            ``raw_logprobs``); ``None`` when no row asked for logprobs.
        top_ids: ``[num_seqs, max_n]`` int64, the ``max_n`` most likely token
            ids of each row under that raw distribution, most likely first
            (``max_n`` = largest ``logprobs`` in the batch; a row asking for
            ``n`` uses the first ``n`` columns); ``None`` when no row asked.
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
    :meth:`Sampler.sample` call of that request. torch's CPU generator (mt19937) keeps only
    the low 32 bits of its seed, so on CPU a seed of 2**32 or more is folded first (its low
    and high 32 bits xor-ed): seeds that differ only above bit 32 then give different streams,
    and a seed below 2**32 is used as it is.

    Raises:
        ValueError: ``seed`` is not a uint64.
    """
    problem = sampling_param("seed").problem(seed)
    if problem is not None:
        raise ValueError(problem)
    gen = torch.Generator(device=device)
    gen.manual_seed(_fold_to_32_bits(seed) if gen.device.type == "cpu" else seed)
    return gen


def _fold_to_32_bits(seed: int) -> int:
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def skip_draw(generator: torch.Generator | None, options: SamplingOptions, n: int = 1) -> None:
    """Consume from ``generator`` the draws ``n`` :meth:`Sampler.sample` calls make for a
    row with ``options``, without sampling anything.

    For tokens of this request that were sampled elsewhere from the same seed: a
    decode worker receives the first token from the prefill worker, which drew its
    uniform from its own generator built from the request's seed; skipping that draw
    here keeps the decode side's stream of draws (and so every later token) equal to
    a colocated run's. A migrated request (``WorkerRequest.output_token_ids``: ``n``
    tokens generated by an earlier worker) skips one draw per such token. Exactly the
    calls of the RNG contract (see :class:`Sampler`): ``n`` times one ``torch.rand(1)``
    on the generator's device when ``options.temperature > 0``; nothing for a greedy
    row or without a generator (an unseeded row draws from the sampler-wide
    generator, whose stream no request relies on).
    """
    if generator is not None and options.temperature > 0.0:
        for _ in range(n):
            torch.rand(1, generator=generator, device=generator.device)


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
        options: Sequence[SamplingOptions],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[History] | None = None,
        stop_ids: Sequence[Sequence[int]] | None = None,
        bitmasks: Sequence[torch.Tensor | None] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """Pick one token per row (steps 1-6 of the module docstring).

        Args:
            logits: ``[num_seqs, vocab]`` float32 (other float dtypes are
                upcast), on any device; not modified.
            options: ``num_seqs`` per-row settings.
            generators: ``num_seqs`` entries; a row with a generator draws its
                uniform from it (on the generator's device), a row with
                ``None`` from the sampler-wide generator. Greedy rows draw
                nothing.
            histories: ``num_seqs`` ``(prompt_token_ids, output_token_ids)``
                pairs (the request's own lists, by reference; output excludes
                the token being sampled), read only for rows with a repetition,
                presence or frequency penalty or ``min_tokens``. ``None`` is allowed
                when no row has one.
            stop_ids: ``num_seqs`` lists of the ids that would end each row's
                request (EOS unless ``ignore_eos``, its stop token ids), banned while
                it has generated fewer than ``min_tokens`` tokens; ``None`` when no
                row has ``min_tokens``.
            bitmasks: ``num_seqs`` token bitmasks of structured outputs (None: unconstrained row).
            banned: ``num_seqs`` lists of ids a row may not sample (its bad words), or None.

        Returns:
            :class:`SamplerOutput` with tensors on ``logits.device``.

        Raises:
            ValueError: ``logits`` is not 2-D, list lengths differ from ``num_seqs``,
                a seeded row has no generator, or see :func:`apply_logits_processors`.
        """
        _check_batch(logits, options, generators)
        raw = logits.float()
        processed = apply_logits_processors(raw, options, histories)
        if any(o.min_tokens for o in options):
            processed = ban_early_stops(processed if processed is not raw else raw.clone(), options, histories,
                                        stop_ids)
        processed = apply_token_bitmasks(ban_ids(processed, raw, banned), raw, bitmasks)

        token_ids = argmax_rows(processed)  # processed.argmax(dim=-1), by the C++ kernel on CPU
        rows = [i for i, opt in enumerate(options) if opt.temperature > 0.0]
        if rows:
            picked = self._sample_rows(processed, rows, options, generators)
            if len(rows) == len(options):
                token_ids = picked
            else:
                token_ids[torch.tensor(rows, device=logits.device)] = picked
        return _with_logprobs(raw, token_ids, max((opt.logprobs for opt in options), default=0))

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: list[int],
        options: Sequence[SamplingOptions],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Random-sample ``rows`` (temperature > 0) of float32 ``logits``; returns ``[len(rows)]`` int64."""
        device = logits.device
        vocab = logits.shape[1]
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=device)]
        temp = torch.tensor([options[i].temperature for i in rows], device=device)
        top_p = torch.tensor([options[i].top_p for i in rows], device=device)
        top_k = torch.tensor([options[i].top_k for i in rows], device=device)
        min_p = torch.tensor([options[i].min_p for i in rows], device=device)
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
        # min-p after top-k/top-p: p / p_max is unchanged by renormalization, so the
        # pre-top-p probabilities give the same mask.
        outside |= probs < min_p.unsqueeze(1) * probs[:, :1]
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
        generators: Sequence[torch.Generator | None],
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


def _check_batch(logits: torch.Tensor, options: Sequence[SamplingOptions],
                 generators: Sequence[torch.Generator | None]) -> None:
    """Raises ValueError: ``logits`` is not 2-D, list lengths differ from ``num_seqs``, or a seeded row has no generator."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_seqs, vocab], got shape {tuple(logits.shape)}")
    num_seqs = logits.shape[0]
    if len(options) != num_seqs or len(generators) != num_seqs:
        raise ValueError(f"got {len(options)} options and {len(generators)} generators for {num_seqs} rows")
    for i, (opt, gen) in enumerate(zip(options, generators)):
        if opt.seed is not None and gen is None:
            raise ValueError(f"row {i} has seed {opt.seed} but no generator")


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, max_n: int) -> SamplerOutput:
    """The output of ``token_ids`` (``[num_seqs]`` int64), with the raw-distribution
    logprobs of the chosen tokens and the ``max_n`` top ones when ``max_n > 0``
    (``raw``: ``[num_seqs, vocab]`` float32 model logits)."""
    if max_n == 0:
        return SamplerOutput(token_ids=token_ids)
    logp = torch.log_softmax(raw, dim=-1)
    top_logprobs, top_ids = logp.topk(min(max_n, raw.shape[1]), dim=-1)
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=logp.gather(1, token_ids.unsqueeze(1)).squeeze(1),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )

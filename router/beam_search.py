"""Beam search over any next-token source: the algorithm of vLLM's ``beam_search`` (its OpenAI
server's ``use_beam_search``), which runs beams as one-token requests.

Each step asks, for every live beam, the ``2 x width`` most likely next tokens with their
log-probabilities (the model's own distribution: temperature, penalties and the other sampling
knobs do not enter); every beam x candidate is a new beam whose score is its summed log-probability
over ``len(tokens) ** length_penalty`` (prompt tokens included, an EOS at the end not: vLLM's
``get_beam_search_score``); the ``width`` best continue. A candidate that is an EOS token (unless
``ignore_eos``) completes its beam instead. After ``max_tokens`` steps, or when no beam is left or
the context is full, the ``width`` best of the completed and live beams are the answers, best first.
Beams of one request share their prompt and earlier tokens, so on workers with a prefix cache each
step recomputes only a beam's last, partial block.

The step source is a function, so the same search runs over the cluster
(:mod:`router.openai.beam`) and over HF ``transformers`` in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: ``step(sequences, k) -> per sequence, (token id, logprob) of its k most likely next tokens``.
StepFn = Callable[[list[list[int]], int], list[list[tuple[int, float]]]]


@dataclass(frozen=True)
class Beam:
    """A beam: ``tokens`` (prompt + generated, an ending EOS included), the summed log-probability
    of the generated ones, and ``finish_reason`` (``stop``: ended by EOS; ``length``: by the limits)."""

    tokens: tuple[int, ...]
    cum_logprob: float
    finish_reason: str = "length"

    def length(self, eos_ids: frozenset[int]) -> int:
        """The scored length: the prompt counted, an ending EOS not."""
        return len(self.tokens) - (1 if self.finish_reason == "stop" and self.tokens[-1] in eos_ids else 0)

    def score(self, length_penalty: float, eos_ids: frozenset[int]) -> float:
        """vLLM's ``get_beam_search_score``: ``cum_logprob / length ** length_penalty`` (it may round
        to 0 or -inf for an extreme penalty: beams are ranked by :meth:`rank`, which does not)."""
        try:
            return self.cum_logprob / (self.length(eos_ids) ** length_penalty)
        except (OverflowError, ZeroDivisionError):
            return -math.inf if length_penalty < 0 and self.cum_logprob < 0 else -0.0

    def rank(self, length_penalty: float, eos_ids: frozenset[int]) -> tuple[int, float]:
        """A key ordering beams as :meth:`score` does, computed in log space so that no penalty
        overflows: a log-probability of 0 scores 0 (the best), else ``-(log|cum| - p log length)``."""
        if self.cum_logprob >= 0:
            return (1, 0.0)
        return (0, length_penalty * math.log(self.length(eos_ids)) - math.log(-self.cum_logprob))


@dataclass(frozen=True)
class BeamSearch:
    """One search's settings.

    Attributes:
        width: beams kept per step and answers returned (OpenAI's ``n``).
        max_tokens: generated tokens per beam at most.
        eos_ids: the model's end-of-sequence token ids.
        ignore_eos: EOS candidates continue like any token.
        length_penalty: exponent of the length in the score (1.0: mean log-probability).
        max_len: prompt + generated tokens at most (the model's context).

    Raises:
        ValueError: ``width`` or ``max_tokens`` < 1, or ``max_len`` < 2.
    """

    width: int
    max_tokens: int
    eos_ids: frozenset[int]
    ignore_eos: bool = False
    length_penalty: float = 1.0
    max_len: int = 1 << 30

    def __post_init__(self) -> None:
        if self.width < 1 or self.max_tokens < 1 or self.max_len < 2:
            raise ValueError(f"width ({self.width}) and max_tokens ({self.max_tokens}) must be >= 1, "
                             f"max_len ({self.max_len}) >= 2")

    def run(self, prompt: Sequence[int], step: StepFn) -> list[Beam]:
        """The ``width`` best beams for ``prompt``, best first.

        Raises:
            whatever ``step`` raises (the search stops there).
        """
        live = [Beam(tuple(prompt), 0.0)]
        done: list[Beam] = []
        for _ in range(self.max_tokens):
            if not live or len(live[0].tokens) >= self.max_len:
                break
            grown: list[Beam] = []
            for beam, candidates in zip(live, step([list(b.tokens) for b in live], 2 * self.width)):
                for token, logprob in candidates:
                    child = Beam(beam.tokens + (token,), beam.cum_logprob + logprob)
                    if token in self.eos_ids and not self.ignore_eos:
                        done.append(Beam(child.tokens, child.cum_logprob, "stop"))
                    else:
                        grown.append(child)
            live = self._best(grown)
        return self._best(done + live)

    def _best(self, beams: list[Beam]) -> list[Beam]:
        return sorted(beams, key=lambda b: b.rank(self.length_penalty, self.eos_ids), reverse=True)[:self.width]

"""The router's half of reasoning-aware structured outputs: the gate a constrained request carries.

With ``pdcluster up --reasoning-parser NAME``, a structured output (``structured_outputs``,
``response_format``, a forced tool choice) constrains the answer after the model's thinking, not
the thinking itself, as vLLM's does by default (``enable_in_reasoning`` off). The router tells the
workers where the thinking stands when the output starts (``WorkerRequest.reasoning_gate``); the
workers' :mod:`engine.reasoning_gate` follows it from there.

The gate reads the output as the parser splits it (:mod:`router.reasoning_parsers`), so the text
the constraint holds for is the text the answer returns as ``content`` (or as tool calls):

* ``deepseek_r1``: the output starts thinking (its template opened it); the constraint starts after
  ``</think>``, and an output that never writes it is all thinking, unconstrained;
* ``qwen3``: the output starts with the answer, constrained from its first token, unless that token
  is ``<think>`` (where the vocabulary has it as one token, as Qwen3's has), which opens a thinking.

The prompt is not read (vLLM reads its last marker): a user's text that mentions ``<think>`` must not
switch the constraint off, and the answer's split does not read the prompt either. ``</think>`` is
matched as the tokenizer writes it, as written and after a space.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.v1 import common_pb2, worker_pb2
from router.reasoning_parsers import END, REASONING_PARSERS, START


@dataclass(frozen=True)
class GateTokens:
    """A reasoning parser's markers in the served tokenizer.

    Attributes:
        ends: the tokenizer's encodings of ``</think>`` (as written; after a space where that differs).
        opener: ``<think>``'s id where it is one token, else None.
        thinking: the output starts thinking (``deepseek_r1``).
    """

    ends: tuple[tuple[int, ...], ...]
    opener: int | None
    thinking: bool

    @classmethod
    def of(cls, parser: str, tokenizer) -> GateTokens:
        """The markers of the registered ``parser`` in ``tokenizer`` (an HF tokenizer)."""
        start = tokenizer.encode(START, add_special_tokens=False)
        ends = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (END, " " + END)]
        if ends[1] == (*tokenizer.encode(" ", add_special_tokens=False), *ends[0]):
            del ends[1]  # the space is a token of its own: the marker's own encoding follows it
        return cls(tuple(ends), start[0] if len(start) == 1 else None, REASONING_PARSERS[parser].implicit_start)

    def gate(self) -> worker_pb2.ReasoningGate:
        """The gate of a constrained request."""
        return worker_pb2.ReasoningGate(end_token_ids=[common_pb2.TokenSequence(ids=e) for e in self.ends],
                                        thinking=self.thinking,
                                        opener_token_id=None if self.thinking else self.opener)

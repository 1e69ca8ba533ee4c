"""The router's half of reasoning-aware structured outputs: the gate a constrained request carries.

With ``pdcluster up --reasoning-parser NAME``, a structured output (``structured_outputs``,
``response_format``, a forced tool choice) constrains the answer after the model's thinking, not
the thinking itself, as vLLM's does by default (``enable_in_reasoning`` off). The router tells the
workers where the thinking stands when the output starts (``WorkerRequest.reasoning_gate``); the
workers' :mod:`engine.reasoning_gate` follows it from there.

Where the thinking stands, from the prompt (as vLLM's ``is_reasoning_end`` reads the prompt ids): the
last ``<think>`` or ``</think>`` in the prompt's text decides (an open ``<think>``: thinking; a
``</think>``: not, e.g. Qwen3's template with ``enable_thinking: false``); a prompt with neither is
thinking for ``deepseek_r1`` (its template opens it) and not for ``qwen3``. When not thinking and
the vocabulary has ``<think>`` as one token, the first output may still be ``<think>`` (it opens a
thinking, as :class:`router.reasoning_parsers.ThinkParser` reads an answer that begins with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.v1 import worker_pb2
from router.reasoning_parsers import END, REASONING_PARSERS, START


@dataclass(frozen=True)
class GateTokens:
    """A reasoning parser's markers in the served tokenizer.

    Attributes:
        end_ids: the tokenizer's encoding of ``</think>``.
        opener: ``<think>``'s id where it is one token, else None.
        implicit_start: a prompt without markers leaves the thinking open (``deepseek_r1``).
    """

    end_ids: tuple[int, ...]
    opener: int | None
    implicit_start: bool

    @classmethod
    def of(cls, parser: str, tokenizer) -> GateTokens:
        """The markers of the registered ``parser`` in ``tokenizer`` (an HF tokenizer)."""
        start = tokenizer.encode(START, add_special_tokens=False)
        return cls(tuple(tokenizer.encode(END, add_special_tokens=False)), start[0] if len(start) == 1 else None,
                   REASONING_PARSERS[parser].implicit_start)

    def gate(self, prompt_text: str) -> worker_pb2.ReasoningGate:
        """The gate of a constrained request whose prompt, decoded with its special tokens, is
        ``prompt_text``."""
        opened, closed = prompt_text.rfind(START), prompt_text.rfind(END)
        thinking = opened > closed if opened != closed else self.implicit_start
        return worker_pb2.ReasoningGate(end_token_ids=self.end_ids, thinking=thinking,
                                        opener_token_id=None if thinking else self.opener)

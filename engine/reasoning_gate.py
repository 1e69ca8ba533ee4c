"""Where a reasoning model's structured output starts: after its thinking.

A reasoning model writes its thinking first (``<think> ... </think>``), then the answer. With a
reasoning parser (``pdcluster up --reasoning-parser``), the router sends a constrained request a
gate (``WorkerRequest.reasoning_gate``), and the constraint holds for the answer only, as in
vLLM's reasoning-aware structured outputs (``StructuredOutputManager.should_fill_bitmask`` /
``should_advance`` with ``enable_in_reasoning`` off, vllm/v1/structured_output/__init__.py).

Lifecycle of one request's gate, driven by its own ``output_token_ids`` (whoever appended them:
the prefill worker's first token, a migrated request's earlier outputs, this worker's samples):

1. **thinking** (the template opened it: ``deepseek_r1``): nothing is masked; the gate watches the
   outputs for the end tokens (:attr:`ends`, the ways the tokenizer writes ``</think>``);
2. **undecided** (not thinking, with an :attr:`opener`): the first output may be the opener
   (``<think>`` where it is one token) besides what the constraint allows; if it is, the gate
   goes to 1, else the constraint starts at output 0;
3. **answering**: the constraint holds from :meth:`start` on, for good (a later ``<think>`` is
   the answer's text, as vLLM's ``reasoning_ended`` never resets).

Without an opener and not thinking, the gate starts at 3 with :meth:`start` 0: the same as no gate.
The end tokens are matched as ids: a model whose vocabulary has ``</think>`` as one token (Qwen3,
DeepSeek-R1) always writes it so; where it is several, the model must write one of the encodings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_GATE_ENDS = 8
"""Most end sequences a gate takes (each is compared after every output token)."""
MAX_GATE_END_TOKENS = 16
"""Longest end sequence a gate takes (tokens)."""


@dataclass
class ReasoningGate:
    """One request's gate; only the request's scheduler thread uses it.

    Attributes:
        ends: the token-id sequences that end the thinking (at least one, none empty).
        thinking: the thinking is open (step 1).
        opener: the token that opens a thinking as the first output, or None.

    Raises:
        ValueError: no ``ends``, or an empty one.
    """

    ends: tuple[tuple[int, ...], ...]
    thinking: bool
    opener: int | None = None
    _start: int | None = field(default=None, init=False)
    _seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.ends or not all(self.ends):
            raise ValueError("reasoning_gate.end_token_ids must hold at least one sequence, none empty")
        if not self.thinking and self.opener is None:
            self._start = 0

    def start(self, output_token_ids: list[int]) -> int | None:
        """The output index the constraint starts at, or None: not yet (thinking, or undecided
        before the first output)."""
        while self._start is None and self._seen < len(output_token_ids):
            i = self._seen
            self._seen += 1
            if not self.thinking:  # undecided: this is output 0
                if output_token_ids[i] == self.opener:
                    self.thinking = True
                else:
                    self._start = i
            elif any(i + 1 >= len(end) and tuple(output_token_ids[i + 1 - len(end):i + 1]) == end
                     for end in self.ends):
                self._start = i + 1
        return self._start

    def may_open(self, output_token_ids: list[int]) -> bool:
        """Whether the next output may be the opener (step 2)."""
        return self.start(output_token_ids) is None and not self.thinking

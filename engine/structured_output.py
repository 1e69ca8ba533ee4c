"""Structured outputs on a worker: compile a request's constraint, follow its tokens, mask its next token.

Lifecycle (the worker-side half of :mod:`common.structured_outputs`; vLLM v1's
``StructuredOutputManager`` split, with xgrammar, https://github.com/mlc-ai/xgrammar, as the backend):

1. **compile** (:meth:`GrammarCompiler.compile`, on the gRPC handler thread that builds the request):
   the constraint becomes an xgrammar ``CompiledGrammar`` (cached by its text) and a fresh
   :class:`GrammarState`; a constraint xgrammar refuses is a ``ValueError`` naming the field, which the
   servers return as INVALID_ARGUMENT;
2. **follow**: the state accepts the request's output tokens lazily, from the request's own
   ``output_token_ids`` (:meth:`GrammarState.advance`): the first token the prefill worker sampled, a
   migrated request's earlier outputs, each token this worker sampled: whoever appended it;
3. **mask** (:func:`next_token_bitmask`, by the scheduler when it plans a sampling step): the
   bitmask of the tokens that can come next, ``[ceil(vocab / 32)]`` int32 (bit ``j`` of word ``i``:
   token ``32 i + j``), applied by the sampler (:mod:`engine.token_bitmask`);
4. **end** (:func:`engine.stop_check.check_finish`): a state that accepted a stop token (EOS) is
   terminated and the request stops, ``ignore_eos`` or not; where the grammar is complete, only
   stop tokens are allowed, so the model ends the request.

xgrammar is imported on the first compile, so a worker that never sees a constraint never loads it.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from common.model_config import ModelConfig
from common.structured_outputs import StructuredOutput

if TYPE_CHECKING:
    from engine.request import Request

log = logging.getLogger(__name__)
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


class GrammarState:
    """One request's position in its grammar (an xgrammar ``GrammarMatcher``). Only the request's
    scheduler thread uses it.

    Attributes:
        num_accepted: output tokens the matcher has accepted.
        rejected: the output token the grammar could not accept, or None (then the request ends).
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self.num_accepted = 0
        self.rejected: int | None = None

    def advance(self, output_token_ids: list[int]) -> bool:
        """Accept the outputs not accepted yet; False once one was refused (it stays refused)."""
        while self.rejected is None and self.num_accepted < len(output_token_ids):
            token = output_token_ids[self.num_accepted]
            if not self._matcher.accept_token(token):
                self.rejected = token
                log.warning("structured output: token %d at output %d does not continue the grammar", token,
                            self.num_accepted)
                break
            self.num_accepted += 1
        return self.rejected is None

    def ended(self, output_token_ids: list[int]) -> bool:
        """Whether the outputs ended the grammar (a stop token accepted) or broke it."""
        return not self.advance(output_token_ids) or self._matcher.is_terminated()

    def bitmask(self, output_token_ids: list[int]) -> torch.Tensor:
        """``[ceil(vocab / 32)]`` int32: the tokens that may follow ``output_token_ids``."""
        import xgrammar as xgr

        self.advance(output_token_ids)
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]


def next_token_bitmask(req: Request) -> torch.Tensor | None:
    """The bitmask of ``req``'s next token (:meth:`GrammarState.bitmask`), or None: unconstrained."""
    return None if req.grammar is None else req.grammar.bitmask(req.output_token_ids)


class GrammarCompiler:
    """Compiles constraints for one model (its tokenizer's vocabulary and stop tokens); thread-safe.

    Args:
        tokenizer_folder: the HF model folder holding the tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary: padding ids
            are never allowed).
        stop_token_ids: the model's EOS ids: what a complete grammar allows next.
        max_threads: xgrammar's compile threads.
    """

    def __init__(self, tokenizer_folder: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_threads: int = 1) -> None:
        self._folder, self._vocab_size, self._stops = tokenizer_folder, vocab_size, list(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                from common.tokenizer import load_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self._folder), vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stops or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def compile(self, spec: StructuredOutput, field: str = "structured_outputs") -> GrammarState:
        """A fresh state at the start of ``spec``'s language.

        Raises:
            ValueError: xgrammar refuses the constraint; the message names ``field.<kind>`` and says why.
        """
        import xgrammar as xgr

        compiler = self._get()
        try:
            if spec.kind in ("json", "json_object"):
                compiled = compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.text)
            else:  # grammar, choice
                compiled = compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            why = _LOCATION.sub("", str(e).strip()) or type(e).__name__
            raise ValueError(f"{field}.{spec.kind} does not compile: {why}") from None
        return GrammarState(xgr.GrammarMatcher(compiled), self._vocab_size)


def grammar_compiler(model: ModelConfig) -> GrammarCompiler:
    """The compiler of ``model`` (its folder's tokenizer, vocabulary size and EOS ids); nothing is
    loaded before the first constraint."""
    return GrammarCompiler(model.path, model.vocab_size, model.eos_token_ids)

"""Structured outputs on a worker: compile a request's constraint, follow its tokens, mask its next token.

Lifecycle (the worker-side half of :mod:`common.structured_outputs`; vLLM v1's
``StructuredOutputManager`` split, with xgrammar, https://github.com/mlc-ai/xgrammar, as the backend):

1. **compile** (:meth:`GrammarCompiler.compile`, for the gRPC handler thread that builds the request):
   the constraint becomes an xgrammar ``CompiledGrammar`` (cached by its text, the cache bounded to
   :data:`CACHE_BYTES`) and a fresh :class:`GrammarState`; a constraint xgrammar refuses is a
   ``ValueError`` naming the field, which the servers return as INVALID_ARGUMENT. A worker compiles one
   constraint at a time, on a thread of its own, for at most :data:`COMPILE_TIMEOUT_S`: a constraint that
   takes longer is refused as too complex (and refused at once when asked again), and while it still
   compiles (xgrammar cannot stop it: it holds one core until it ends) the worker refuses other new
   constraints with :class:`GrammarBusy` (RESOURCE_EXHAUSTED, retry later) instead of starting more;
2. **follow**: the state accepts the request's output tokens lazily, from the request's own
   ``output_token_ids`` (:meth:`GrammarState.advance`): the first token the prefill worker sampled, a
   migrated request's earlier outputs, each token this worker sampled: whoever appended it. For a
   reasoning model, from the output after its thinking (:mod:`engine.reasoning_gate`); nothing is
   masked before;
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
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from common.model_config import ModelConfig
from common.structured_outputs import StructuredOutput
from engine.reasoning_gate import ReasoningGate

if TYPE_CHECKING:
    from engine.request import Request

log = logging.getLogger(__name__)
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix
COMPILE_TIMEOUT_S = 10.0
"""Longest a constraint may compile (seconds); also the longest a request waits for another's compile."""
CACHE_BYTES = 256 * 2**20
"""Bytes of compiled constraints a worker keeps for reuse (xgrammar's LRU cache; a 256-choice constraint
takes ~12 MiB). vLLM's default is 512 MiB, for machines with more memory."""
_SLOW_KEPT = 256  # constraints remembered as too slow to compile


class GrammarBusy(RuntimeError):
    """The worker is still compiling another constraint, past :data:`COMPILE_TIMEOUT_S`: retry later."""


class GrammarState:
    """One request's position in its grammar (an xgrammar ``GrammarMatcher``), and, for a reasoning
    model, where the grammar starts in its outputs (:class:`engine.reasoning_gate.ReasoningGate`;
    None: at output 0). Only the request's scheduler thread uses it.

    Attributes:
        num_accepted: output tokens the matcher has accepted.
        rejected: the output token the grammar could not accept, or None (then the request ends).
        rejected_at: that token's index in the outputs, or None.
    """

    def __init__(self, matcher: Any, vocab_size: int, gate: ReasoningGate | None = None) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._gate = gate
        self.num_accepted = 0
        self.rejected: int | None = None
        self.rejected_at: int | None = None

    def _start(self, output_token_ids: list[int]) -> int | None:
        return 0 if self._gate is None else self._gate.start(output_token_ids)

    def advance(self, output_token_ids: list[int]) -> bool:
        """Accept the outputs from the grammar's start not accepted yet; False once one was refused
        (it stays refused)."""
        start = self._start(output_token_ids)
        if start is None:
            return True
        while self.rejected is None and start + self.num_accepted < len(output_token_ids):
            at = start + self.num_accepted
            if not self._matcher.accept_token(output_token_ids[at]):
                self.rejected, self.rejected_at = output_token_ids[at], at
                log.warning("structured output: token %d at output %d does not continue the grammar",
                            self.rejected, at)
                break
            self.num_accepted += 1
        return self.rejected is None

    def ended(self, output_token_ids: list[int]) -> bool:
        """Whether the outputs ended the grammar (a stop token accepted) or broke it."""
        if not self.advance(output_token_ids):
            return True
        return self._start(output_token_ids) is not None and self._matcher.is_terminated()

    def bitmask(self, output_token_ids: list[int]) -> torch.Tensor | None:
        """``[ceil(vocab / 32)]`` int32: the tokens that may follow ``output_token_ids``; None while a
        reasoning model thinks (anything may follow). Where the first output may open a thinking,
        the gate's opener is allowed too."""
        import xgrammar as xgr

        self.advance(output_token_ids)
        may_open = self._gate is not None and self._gate.may_open(output_token_ids)
        if self._start(output_token_ids) is None and not may_open:
            return None
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        if may_open:
            _allow(mask[0], self._gate.opener)
        return mask[0]


def _allow(mask: torch.Tensor, token: int) -> None:
    """Set ``token``'s bit in ``mask`` (``[ceil(vocab / 32)]`` int32)."""
    word = (int(mask[token // 32]) & 0xFFFFFFFF) | (1 << (token % 32))
    mask[token // 32] = word - (1 << 32) if word >= 1 << 31 else word


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
                 max_threads: int = 1, timeout_s: float = COMPILE_TIMEOUT_S, cache_bytes: int = CACHE_BYTES) -> None:
        self._folder, self._vocab_size, self._stops = tokenizer_folder, vocab_size, list(stop_token_ids)
        self._max_threads, self._timeout_s, self._cache_bytes = max_threads, timeout_s, cache_bytes
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._slot = threading.Semaphore(1)  # one compile at a time
        self._too_slow: OrderedDict[tuple, None] = OrderedDict()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                from common.tokenizer import load_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self._folder), vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stops or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads,
                                                     cache_limit_bytes=self._cache_bytes)
            return self._compiler

    def compile(self, spec: StructuredOutput, field: str = "structured_outputs",
                gate: ReasoningGate | None = None) -> GrammarState:
        """A fresh state at the start of ``spec``'s language (module docstring, step 1), starting
        after the thinking ``gate`` watches for (None: at output 0).

        Raises:
            ValueError: xgrammar refuses the constraint, or it did not compile within the timeout; the
                message names ``field.<kind>`` and says why.
            GrammarBusy: another constraint has been compiling for longer than the timeout.
        """
        import xgrammar as xgr

        key = (spec.kind, spec.text, spec.any_whitespace)
        too_complex = f"{field}.{spec.kind} is too complex: it did not compile within {self._timeout_s:g} s"
        if key in self._too_slow:
            raise ValueError(too_complex)
        compiler = self._get()
        if not self._slot.acquire(timeout=self._timeout_s):
            raise GrammarBusy(f"{field}: this worker is still compiling another constraint after "
                              f"{self._timeout_s:g} s; retry later")
        done: dict[str, Any] = {}
        worker = threading.Thread(target=self._run, args=(compiler, spec, done), daemon=True, name="grammar-compile")
        worker.start()
        worker.join(self._timeout_s)
        if worker.is_alive():
            with self._lock:
                self._too_slow[key] = None
                while len(self._too_slow) > _SLOW_KEPT:
                    self._too_slow.popitem(last=False)
            log.warning("a %s constraint of %d characters did not compile within %g s; it holds one compile "
                        "thread until it ends", spec.kind, len(spec.text), self._timeout_s)
            raise ValueError(too_complex)
        if "error" in done:
            e = done["error"]
            why = _LOCATION.sub("", str(e).strip()) or type(e).__name__
            raise ValueError(f"{field}.{spec.kind} does not compile: {why}") from None
        return GrammarState(xgr.GrammarMatcher(done["compiled"]), self._vocab_size, gate)

    def _run(self, compiler: Any, spec: StructuredOutput, done: dict[str, Any]) -> None:
        """Compile thread: ``done["compiled"]`` or ``done["error"]``; frees the compile slot at the end."""
        try:
            if spec.kind in ("json", "json_object"):
                done["compiled"] = compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
            elif spec.kind == "regex":
                done["compiled"] = compiler.compile_regex(spec.text)
            else:  # grammar, choice
                done["compiled"] = compiler.compile_grammar(spec.text)
        except Exception as e:  # noqa: BLE001 - the caller reports it
            done["error"] = e
        finally:
            self._slot.release()


def grammar_compiler(model: ModelConfig) -> GrammarCompiler:
    """The compiler of ``model`` (its folder's tokenizer, vocabulary size and EOS ids); nothing is
    loaded before the first constraint."""
    return GrammarCompiler(model.path, model.vocab_size, model.eos_token_ids)

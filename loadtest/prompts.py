"""Exact-length prompts (token ids) cut from real text.

The corpus is the real prompt text in ``loadtest/data/prompts`` (MT-Bench turns,
Vicuna-Bench questions, Shakespeare's sonnets), tokenized once with the served model's
tokenizer. A plain request of ``n`` tokens takes ``n`` consecutive corpus tokens from a
seeded random offset (wrapping around). A Mooncake request is the concatenation of its
``hash_ids`` blocks, each a fixed ``block_tokens``-token span of the corpus chosen from the
hash id, cut to the request's length: equal hash ids give equal token blocks, so the
trace's prefix sharing becomes real prefix sharing in the prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadtest.workload import PlannedRequest

PROMPT_FILES = ("prompts/mt_bench_question.jsonl", "prompts/vicuna_bench_question.jsonl", "prompts/sonnet.txt")


def corpus_text(traces_dir: Path | str) -> str:
    """All real prompt text of ``traces_dir/prompts`` joined by blank lines.

    Raises:
        FileNotFoundError: a prompt file is missing.
    """
    parts: list[str] = []
    for rel in PROMPT_FILES:
        path = Path(traces_dir) / rel
        if path.suffix == ".jsonl":
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    parts.extend(json.loads(line)["turns"])
        else:
            parts.append(path.read_text(encoding="utf-8"))
    return "\n\n".join(parts)


def load_tokenizer(model: str):
    """The HF tokenizer of ``model`` (a pdcluster model name, ``.gguf`` path or HF folder).

    Raises:
        engine.model_loader.ModelNotFoundError: ``model`` names nothing loadable.
    """
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


class PromptFactory:
    """Builds each planned request's prompt token ids from ``corpus_ids``.

    Raises:
        ValueError: from ``__init__`` when ``corpus_ids`` is empty.
    """

    def __init__(self, corpus_ids: Sequence[int], seed: int = 0):
        if not len(corpus_ids):
            raise ValueError("the prompt corpus has no tokens")
        self._corpus = np.asarray(corpus_ids, dtype=np.int64)
        self._seed = seed
        self._blocks: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer, traces_dir: Path | str, seed: int = 0) -> PromptFactory:
        """Tokenize the real prompt corpus of ``traces_dir`` with ``tokenizer``."""
        return cls(tokenizer.encode(corpus_text(traces_dir), add_special_tokens=False), seed)

    @property
    def corpus_tokens(self) -> int:
        """Corpus length in tokens."""
        return len(self._corpus)

    def _span(self, start: int, n: int) -> np.ndarray:
        return np.take(self._corpus, np.arange(start, start + n), mode="wrap")

    def _block(self, hash_id: int, size: int) -> np.ndarray:
        key = (hash_id, size)
        if key not in self._blocks:
            start = int(np.random.default_rng([self._seed, 1, hash_id]).integers(len(self._corpus)))
            self._blocks[key] = self._span(start, size)
        return self._blocks[key]

    def prompt(self, req: PlannedRequest) -> list[int]:
        """Exactly ``req.input_tokens`` token ids for ``req``."""
        n = req.input_tokens
        if req.hash_ids:
            need = -(-n // req.block_tokens)
            ids = np.concatenate([self._block(h, req.block_tokens) for h in req.hash_ids[:need]])
            if len(ids) < n:  # more tokens than hash blocks (not in the real traces): pad from the text
                ids = np.concatenate([ids, self._span(int(ids[-1]), n - len(ids))])
            return ids[:n].tolist()
        start = int(np.random.default_rng([self._seed, 0, req.index]).integers(len(self._corpus)))
        return self._span(start, n).tolist()

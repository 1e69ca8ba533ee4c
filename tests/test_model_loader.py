"""Unit tests of ``engine.model_loader``'s GGUF dequantization helpers and model cache folder."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from deploy.spec import spec_from_args
from engine.model_loader import MODEL_CACHE_ENV, _one_gguf_parse, default_cache_dir
from pdcluster.cli import build_parser


def _tiny_gguf(path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_one_gguf_parse_shares_one_reader_per_file_and_puts_the_class_back(tmp_path):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _tiny_gguf(first)
    _tiny_gguf(second)
    real = gguf.GGUFReader
    with _one_gguf_parse():
        from gguf import GGUFReader  # as transformers' load_gguf_checkpoint imports it

        reader = GGUFReader(first)
        assert GGUFReader(str(first)) is reader  # the config, tokenizer and weights passes share it
        assert GGUFReader(second) is not reader
        assert reader.get_tensor(0).data.tolist() == np.arange(8, dtype=np.float32).reshape(2, 4).tolist()
    assert gguf.GGUFReader is real
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)


def test_the_model_cache_is_the_environments_else_the_users(tmp_path, monkeypatch):
    assert default_cache_dir({MODEL_CACHE_ENV: str(tmp_path)}) == tmp_path
    assert default_cache_dir({}) == Path.home() / ".cache" / "pdcluster" / "models"
    monkeypatch.setenv(MODEL_CACHE_ENV, "~/elsewhere")
    assert default_cache_dir() == Path.home() / "elsewhere"


def test_up_hands_its_model_cache_dir_to_the_workers(tmp_path, model_dir):
    def worker(*flags):
        args = build_parser().parse_args(["up", "--local", "--model", str(model_dir), *flags])
        return spec_from_args(args, "redis://127.0.0.1:1").worker

    assert worker("--model-cache-dir", str(tmp_path)).model_cache_dir == str(tmp_path)
    assert worker().model_cache_dir is None  # each node's own default

"""Unit tests of ``engine.model_loader``'s GGUF dequantization helpers."""

from __future__ import annotations

import gguf
import numpy as np

from engine.model_loader import _one_gguf_parse


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

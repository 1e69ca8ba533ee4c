"""Smoke test of bench/layerwise.py: a tiny prompt through both modes of a real prefill
scheduler into a real receiver process, over every registered transport; and the report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.append(str(BENCH))

import layerwise  # noqa: E402
from _kv_measure import Receiver  # noqa: E402

from engine.model import load_model  # noqa: E402


@pytest.mark.parametrize("transport", ["grpc", "torch_dist"])
def test_one_point_per_transport_and_report(model_config, text_ids_40, transport):
    model = load_model(model_config, torch.device("cpu"), torch.float32)
    nb = 8
    shape = (model_config.num_layers, 2, nb * 4, layerwise.BLOCK_SIZE, model_config.num_kv_heads,
             model_config.head_dim)
    with Receiver(shape, 4 << 20) as receiver:
        bench = layerwise.Bench(model, model_config, receiver, transport, 3, nb)
        try:
            p = layerwise.point(bench, text_ids_40, reps=1)
        finally:
            bench.close()
    assert p["prompt_tokens"] == 40 and p["kv_bytes"] == 3 * model_config.kv_bytes_per_token(4) * 16
    for mode in layerwise.MODES:
        m = p["median"][mode]
        assert m["prefill_s"] > 0 and 0 <= m["exposed_s"] <= m["transfer_total_s"] + 1e-9
    # streamed: the transfer started with the step, so it lasted at least most of the compute
    assert p["median"]["layerwise"]["transfer_total_s"] >= p["median"]["layerwise"]["exposed_s"]
    res = {"started_at": "t", "duration_s": 60.0, "cpu": "c", "cpu_count": 2, "torch": "t", "threads": 2,
           "layers_per_chunk": 3, "load_avg_1m_start": 1.0, "points": [{"transport": transport, **p}],
           "errors": []}
    md = layerwise.markdown(res)
    assert f"| {transport} | 40 |" in md


@pytest.fixture(scope="module")
def text_ids_40(tokenizer):
    ids = tokenizer.encode("Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 6)
    return ids[:40]

"""Smoke test of bench/quant_decode.py: one point (batch 2, context 32, 4 new tokens) for float32 and int8 in
one process through the decode scheduler, and the report (which names how decode steps ran)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _common  # noqa: E402
import quant_decode  # noqa: E402

from engine.model import load_model  # noqa: E402


def test_one_point_both_models_and_the_report(model_config, tokenizer):
    models = {q: load_model(model_config, torch.device("cpu"), torch.float32, quantization=q)
              for q in ("none", "int8")}
    prompts = _common.sonnet_prompts(tokenizer, 2, 32)
    point = quant_decode.run_point(models, model_config, prompts, 4, rounds=2)
    assert set(point) == {"none", "int8"} and point["none"]["speedup_vs_fp32"] == 1.0
    assert point["none"]["paired_speedup_vs_fp32"] == 1.0 and point["int8"]["paired_speedup_vs_fp32"] > 0
    for v in point.values():
        assert len(v["tpot_ms_runs"]) == 2 and v["tpot_ms"] == min(v["tpot_ms_runs"]) > 0
        assert 0 <= v["identical_to_fp32"] <= 2 and v["median_ms"]["forward"] > 0
    assert point["none"]["identical_to_fp32"] == 2
    res = {"model": "m", "started_at": "t", "duration_s": 1.0, "cpu": "c", "threads": 2, "torch": "x",
           "context": 32, "new_tokens": 4, "rounds": 2, "copy_GBps_start": 1.0, "load_avg_1m_start": 0.1,
           "load_avg_1m_end": 0.2, "quantizations": ["none", "int8"],
           "points": [{"batch_size": 2, "load_avg_1m_before": 0.1, "models": point}]}
    md = quant_decode.markdown(res)
    assert "| batch | load 1m | fp32 TPOT ms (runs) | int8 TPOT ms (runs) | int8 / fp32 speed (paired) |" in md
    assert "| 2 | int8 |" in md
    assert "the runner's decode plan" in md
    assert "`--no-decode-plan`" in quant_decode.markdown({**res, "decode_plan": False})
    assert "layer loop in Python (`--python-layer-loop`)" in quant_decode.markdown({**res, "layer_loop": "python"})
    python_loop = quant_decode.run_point(models, model_config, prompts, 4, rounds=1, layer_loop="python")
    assert python_loop["int8"]["identical_to_fp32"] == point["int8"]["identical_to_fp32"]

"""Quantized weights (``--quantization int8|q4``): formats, kernels vs reference, GGUF blocks, the engine.

The format tests need no model; the GGUF and engine tests use the bundled SmolLM2 Q4_1 GGUF (the
float HF folder the engine serves by default is that file dequantized by transformers).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.model_config import ConfigError
from engine.config import QUANTIZATIONS, CacheConfig
from engine.gguf_blocks import matching_blocks, read_q4_1_blocks
from engine.kernels.cpu import quant_ops
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model, read_state
from engine.model.quant import PROJECTIONS, Int8Linear, Q4Linear
from engine.model_loader import DEFAULT_MODEL, resolve_model_source
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan
from pdcluster.cli import build_parser
from serving.worker_config import WorkerConfig

CPU = torch.device("cpu")
GREEDY = SamplingOptions(temperature=0.0)


def _q4_1_row_ref(x: list[float]) -> tuple[float, float, list[int]]:
    """llama.cpp's ``quantize_row_q4_1_ref`` for one block of 32, scalar, as written in ggml-quants.c."""
    lo, hi = min(x), max(x)
    d = (hi - lo) / 15
    inv = 1.0 / d if d else 0.0
    codes = [min(15, int((v - lo) * inv + 0.5)) for v in x]
    return d, lo, codes


def test_q4_1_quantize_matches_llama_cpp_reference():
    torch.manual_seed(0)
    w = torch.randn(3, 64)
    w[1, :32] = 0.5  # a constant block: d = 0, every code 0
    qs, d, m = quant_ops.quantize_q4_1(w)
    assert qs.shape == (3, 2, 16) and qs.dtype == torch.uint8 and d.shape == m.shape == (3, 2)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=2)
    for n in range(3):
        for b in range(2):
            rd, rm, rcodes = _q4_1_row_ref(w[n, 32 * b:32 * (b + 1)].tolist())
            assert codes[n, b].tolist() == rcodes
            assert float(d[n, b]) == float(torch.tensor(rd).half()) and float(m[n, b]) == float(torch.tensor(rm).half())


def test_round_trips_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(40, 96) * 0.05
    for group, groups in ((32, 3), (64, 1), (1000, 1)):  # 64 does not divide 96: one scale per row
        q, s = quant_ops.quantize_int8(w, group)
        assert q.dtype == torch.int8 and s.shape == (40, groups) and int(q.abs().max()) == 127
        step = s.repeat_interleave(96 // groups, dim=1)
        assert ((quant_ops.dequantize_int8(q, s) - w).abs() <= step / 2 + 1e-7).all()
        assert torch.equal(q.abs().reshape(40, groups, -1).amax(dim=2), torch.full((40, groups), 127, dtype=torch.int8))
    assert quant_ops.quantize_int8(torch.randn(3, 576))[1].shape == (3, 576 // quant_ops.INT8_GROUP_SIZE)
    qs, d, m = quant_ops.quantize_q4_1(w)
    back = quant_ops.dequantize_q4_1(qs, d, m)
    step = d.repeat_interleave(32, dim=1)
    fp16_slack = (w.abs() * 2e-3).max()  # d and m are stored as float16, as in a GGUF file
    assert ((back - w).abs() <= step / 2 + fp16_slack).all()
    # quantizing what Q4_1 can represent gives it back exactly
    assert torch.equal(quant_ops.dequantize_q4_1(*quant_ops.quantize_q4_1(back)), back)
    zero = torch.zeros(2, 32)
    assert torch.equal(quant_ops.dequantize_int8(*quant_ops.quantize_int8(zero)), zero)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_ops_match_dense_matmul(rows, bias):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 128), torch.randn(72, 128) * 0.1
    b = torch.randn(72) if bias else None
    q, s = quant_ops.quantize_int8(w)
    xq = quant_ops.dequantize_int8(*quant_ops.quantize_activations_int8(x, quant_ops.INT8_GROUP_SIZE))
    dense = torch.nn.functional.linear(xq, quant_ops.dequantize_int8(q, s), b)  # int8 activations too
    packed = (*quant_ops.pack_int8(q, s), 72)
    torch.testing.assert_close(quant_ops.linear_int8(x, *packed, b), dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(quant_ops.linear_int8_reference(x, *packed, b), dense)
    qs, d, m = quant_ops.quantize_q4_1(w)
    xq = quant_ops.dequantize_int8(*quant_ops.quantize_activations_int8(x, quant_ops.QK4_1))
    dense = torch.nn.functional.linear(xq, quant_ops.dequantize_q4_1(qs, d, m), b)  # int8 activations too
    packed = (*quant_ops.pack_q4_1(qs, d, m), 72)
    torch.testing.assert_close(quant_ops.linear_q4_1(x, *packed, b), dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(quant_ops.linear_q4_1_reference(x, *packed, b), dense)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_ops.quantize_q4_1(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="2-D"):
        quant_ops.quantize_int8(torch.zeros(4))
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        quant_ops.quantize_int8(torch.zeros(4, 64), group_size=0)
    with pytest.raises(ValueError, match="uint8"):
        quant_ops.q4_1_from_gguf(torch.zeros(2, 21, dtype=torch.uint8))


@pytest.fixture(scope="module")
def source():
    return resolve_model_source(DEFAULT_MODEL)


def test_gguf_q4_1_blocks_equal_transformers_dequantized_weights(source):
    """Every decoder projection of the bundled file is Q4_1; read directly (fp16 d/m widened, Q/K rows
    un-permuted) it dequantizes bit for bit to the float weights transformers wrote."""
    folder, gguf = source
    blocks = read_q4_1_blocks(gguf)
    state = read_state(folder)
    names = [n for n in state if n.split(".")[-2] in sum(PROJECTIONS.values(), ())]
    assert sorted(blocks) == sorted(names) and len(names) == 30 * 7
    for name in (names[0], "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"):
        assert torch.equal(quant_ops.dequantize_q4_1(*blocks[name]), state[name]), name
    assert len(matching_blocks(blocks, state)) == len(names)
    wrong = {"model.layers.0.self_attn.q_proj.weight": blocks["model.layers.0.self_attn.k_proj.weight"]}
    assert matching_blocks(wrong, state) == {}  # a block that does not dequantize to the weight is dropped


def _greedy(model, cfg, prompt: list[int], n: int) -> list[int]:
    """Prefill then ``n - 1`` decode steps through :class:`ModelRunner` (the engine's step path)."""
    runner = ModelRunner(model, allocate_kv_cache(cfg, CacheConfig(block_size=16, num_blocks=16), CPU), 16)
    table = list(range(8))
    toks = runner.execute(StepPlan([ScheduledSeq("r", prompt, 0, table, True, GREEDY)])).token_ids
    while len(toks) < n:
        pos = len(prompt) + len(toks) - 1
        toks += runner.execute(StepPlan([ScheduledSeq("r", [toks[-1]], pos, table, True, GREEDY)])).token_ids
    return toks


PROMPT = "The capital of France is"
STEPS = 6


@pytest.fixture(scope="module")
def fp32_tokens(model_config, tokenizer):
    return _greedy(load_model(model_config, CPU, torch.float32), model_config,
                   tokenizer(PROMPT)["input_ids"], STEPS)


@pytest.mark.parametrize("method", ["int8", "q4"])
def test_engine_generates_with_quantized_weights(method, source, model_config, tokenizer, fp32_tokens):
    folder, gguf = source
    model = load_model(model_config, CPU, torch.float32, quantization=method, gguf_path=gguf)
    layer = model.model.layers[0]
    cls = Int8Linear if method == "int8" else Q4Linear
    # quantized, then merged (engine.model.fuse): q/k/v and gate/up are one quantized layer each
    assert all(isinstance(m, cls) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert type(model.lm_head) is Int8Linear  # both quantize the LM head to int8
    assert model.model.embed_tokens.weight.dtype == torch.float32
    ours = _greedy(model, model_config, tokenizer(PROMPT)["input_ids"], STEPS)
    assert len(ours) == STEPS and ours[0] == fp32_tokens[0]
    if method == "q4":  # the GGUF's own blocks: the very weights the float model was dequantized to
        w = read_state(folder)["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(layer.self_attn.qkv_proj.dense_weight()[:w.shape[0]], w)


def test_q4_from_floats_without_a_gguf(model_config):
    """An HF folder (no GGUF): the projections are quantized from the floats."""
    model = load_model(model_config, CPU, torch.float32, quantization="q4")
    w = read_state(model_config.path)["model.layers.1.mlp.down_proj.weight"]
    down = model.model.layers[1].mlp.down_proj
    assert (down.dense_weight() - w).abs().max() <= down.blocks()[1].max()  # within one step


def test_config_validation_names_field_and_choices(model_config):
    with pytest.raises(ConfigError, match=r"quantization must be one of \('none', 'int8', 'q4'\), got 'fp8'"):
        WorkerConfig(role="decode", worker_id="w", model="m", redis_url="redis://x:1", quantization="fp8")
    with pytest.raises(ConfigError, match="quantization 'int8' needs tensor parallelism off"):
        WorkerConfig(role="decode", worker_id="w", model="m", redis_url="redis://x:1", quantization="int8",
                     decode_tp=2)
    cfg = WorkerConfig(role="decode", worker_id="w", model="m", redis_url="redis://x:1", quantization="q4")
    assert WorkerConfig.from_dict(dataclasses.asdict(cfg)).quantization == "q4"
    with pytest.raises(ConfigError, match="quantization must be one of"):
        load_model(model_config, CPU, torch.float32, quantization="int4")
    args = build_parser().parse_args(["up", "--local", "--quantization", "int8"])
    assert args.quantization == "int8" and build_parser().parse_args(["up", "--local"]).quantization == "none"
    assert QUANTIZATIONS[0] == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--local", "--quantization", "fp8"])


def test_build_runner_refuses_quantized_tensor_parallel():
    from engine.builder import build_runner
    with pytest.raises(ConfigError, match="not supported with tp=2"):
        build_runner(DEFAULT_MODEL, CacheConfig(num_blocks=4), tp=2, quantization="q4")



def test_workers_load_their_model_with_every_option_of_the_config():
    """``WorkerConfig.runner_options`` names every keyword of ``build_runner`` (a new one cannot be
    left out of the three workers), quantization included."""
    import inspect

    from engine.builder import build_runner
    cfg = WorkerConfig(role="decode", worker_id="w", model="m", redis_url="redis://x:1", quantization="int8")
    kw = {n for n, p in inspect.signature(build_runner).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(cfg.runner_options()) == kw and cfg.runner_options()["quantization"] == "int8"

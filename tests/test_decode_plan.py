"""Decode plans (:mod:`engine.model.decode_plan`): a decode step run as bound calls gives the model's own
forward bit for bit (hidden states and the K/V it writes), for every family (Llama with llama3 and dynamic
RoPE, Mistral's sliding window, Qwen2's biases and windowed layers, Qwen3's q/k norms, Gemma 3's sandwich
norms, GELU, embedding scale and two RoPEs), with float32, int8 and Q4_1 projections, at one and several
sequences, through the paged decode kernel or through the ``sdpa`` backend; it is not built where it
does not apply (unmerged projections, another cache dtype or layout), and the model runner uses it for
decode steps only. Where the kernels are built the plan runs its layer loop in C++
(:mod:`engine.kernels.cpu.decode_step`): both loops are checked, and the C++ one's argument errors."""

from __future__ import annotations

import pytest
import torch

from common.model_config import ModelConfig
from engine.attention import SeqSlice, build_attention_metadata
from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model
from engine.model.decode_plan import DecodePlan, build_decode_plan
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan

GREEDY = SamplingOptions(temperature=0.0)

BLOCK = 4


def _model(family: str, tmp_path, quantization: str = "none", attention_backend: str | None = None):
    from family_models import build_tiny

    folder = build_tiny(family, tmp_path / family, vocab_size=128)
    cfg = ModelConfig.from_hf_folder(folder)
    return cfg, load_model(cfg, torch.device("cpu"), torch.float32, quantization=quantization,
                           attention_backend=attention_backend)


def _tables(lens: list[int], room: int) -> list[list[int]]:
    """Disjoint block tables with room for ``room`` more tokens each (block 0 left unused)."""
    tables, at = [], 1
    for n in lens:
        k = -(-(n + room) // BLOCK)
        tables.append(list(range(at, at + k)))
        at += k
    return tables


def _prefilled(model, cfg, prompts: list[list[int]], tables) -> torch.Tensor:
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=64), torch.device("cpu"))
    meta = build_attention_metadata([SeqSlice(0, len(p), t) for p, t in zip(prompts, tables)], BLOCK,
                                    sliding_windows=model.sliding_windows)
    model(torch.tensor([t for p in prompts for t in p]), meta, kv)
    return kv


@pytest.mark.parametrize("family,quantization,backend,native", [
    *((f, q, None, native) for f in ("llama3", "llama_dynamic", "mistral", "qwen2", "qwen3", "gemma3")
      for q in ("none", "int8", "q4") for native in (True, False)),
    # attention through the backend, windows masked (the layer loop then stays in Python)
    ("mistral", "none", "sdpa", False), ("gemma3", "none", "sdpa", False),
])
def test_plan_equals_the_model_bit_for_bit(family, quantization, backend, native, tmp_path):
    """native: the layer loop in C++ (engine.kernels.cpu.decode_step), else the plan's Python loop."""
    cfg, model = _model(family, tmp_path, quantization, backend)
    g = torch.Generator().manual_seed(3)
    # lengths past the sliding windows (8) and, for llama_dynamic, past max_position_embeddings (32)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 13, 30)]
    tables = _tables([len(p) for p in prompts], room=8)
    for batch in (prompts[:1], prompts):
        kv_model = _prefilled(model, cfg, batch, tables)
        kv_plan = kv_model.clone()
        plan = build_decode_plan(model, kv_plan)
        assert isinstance(plan, DecodePlan) and (plan._decode_kernel is None) == (backend == "sdpa")
        assert (plan.native is not None) == (backend is None)
        if not native:
            plan.native = None
        lens = [len(p) for p in batch]
        for step in range(4):  # several steps: the plan's writes feed its next step's attention
            ids = torch.randint(3, 128, (len(batch),), generator=g)
            meta = build_attention_metadata([SeqSlice(n + step, 1, t) for n, t in zip(lens, tables)],
                                            BLOCK, sliding_windows=model.sliding_windows)
            want = model(ids, meta, kv_model)
            got = plan(ids, meta)
            assert torch.equal(got, want), (family, quantization, len(batch), step)
            assert torch.equal(kv_plan, kv_model)


def test_no_plan_for_unmerged_projections(tmp_path):
    from family_models import build_tiny

    from engine.attention import get_attention_backend
    from engine.model import read_state
    from engine.model.decoder import CausalLM
    from engine.model.families import load_arch

    folder = build_tiny("llama3", tmp_path / "llama3", vocab_size=128)
    cfg = ModelConfig.from_hf_folder(folder)
    model = CausalLM(cfg, load_arch(folder), get_attention_backend("torch")).requires_grad_(False)
    model.load_weights(read_state(folder))  # built by hand: q/k/v and gate/up stay separate
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=8), torch.device("cpu"))
    assert build_decode_plan(model, kv) is None
    assert ModelRunner(model, kv, BLOCK).decode_plan is None


def test_no_plan_for_another_cache(tmp_path):
    cfg, model = _model("llama3", tmp_path)
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=8), torch.device("cpu"))
    assert build_decode_plan(model, kv.double()) is None
    assert build_decode_plan(model, kv.transpose(2, 3)) is None  # not contiguous
    with pytest.raises(ValueError, match="one new token"):
        meta = build_attention_metadata([SeqSlice(0, 3, [1])], BLOCK)
        build_decode_plan(model, kv)(torch.tensor([5, 6, 7]), meta)


def test_runner_uses_the_plan_for_decode_steps_only(tmp_path):
    cfg, model = _model("llama3", tmp_path)
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), torch.device("cpu"))
    runner = ModelRunner(model, kv, BLOCK)
    assert runner.decode_plan is not None
    calls = []
    plan = runner.decode_plan
    runner.decode_plan = lambda ids, meta: calls.append(len(ids)) or plan(ids, meta)
    prompt = [5, 9, 17, 33, 4, 8]
    table = [1, 2, 3]
    out = runner.execute(StepPlan([ScheduledSeq("r", prompt, 0, table, True, GREEDY)]))  # prefill: the modules
    assert calls == []
    tokens = prompt + out.token_ids
    for _ in range(3):
        out = runner.execute(StepPlan([ScheduledSeq("r", tokens[-1:], len(tokens) - 1, table, True, GREEDY)]))
        tokens += out.token_ids
    assert calls == [1, 1, 1]
    # the same continuation as the model's own forward gives
    kv2 = allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), torch.device("cpu"))
    plain = ModelRunner(model, kv2, BLOCK)
    plain.decode_plan = None
    ref = prompt + plain.execute(StepPlan([ScheduledSeq("r", prompt, 0, table, True, GREEDY)])).token_ids
    for _ in range(3):
        ref += plain.execute(StepPlan([ScheduledSeq("r", ref[-1:], len(ref) - 1, table, True, GREEDY)])).token_ids
    assert ref == tokens


def test_native_step_names_what_is_wrong():
    from engine.kernels.cpu import decode_step
    from engine.kernels.cpu.build import load

    ext, capsules = load(decode_step.NAME), decode_step.entry_points()
    if ext is None or capsules is None:
        pytest.skip("the C++ decode step or a kernel it calls is not built here")
    with pytest.raises(RuntimeError, match="capsule 'pdcluster.rms_norm', got 'pdcluster.rope_store'"):
        ext.DecodeStep({**capsules, "rms_norm": capsules["rope_store"]})
    with pytest.raises(RuntimeError, match="no kernel 'linear_w8a8' given"):
        ext.DecodeStep({k: v for k, v in capsules.items() if k != "linear_w8a8"})
    step = ext.DecodeStep(capsules)
    with pytest.raises(RuntimeError, match="no layers added"):
        step.run(torch.zeros(1, 8), [], torch.zeros(1, 2, 1, 4, 1, 8), torch.zeros(1, dtype=torch.long),
                 torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    norm, w = (torch.ones(8), 1e-6, 0.0), torch.zeros(1, 8, 32)
    panels = decode_step.ProjSpec("f32_panels", (w,), 8, None)
    projs = [panels._replace(n=24), panels, panels._replace(n=16), panels]  # qkv, o, gate_up, down: 8 wide
    good = dict(in_norm=norm, post_norm=norm, qk_norms=[], ffn_norms=[], projs=projs,
                dims=[8, 8, 8, 1, 1, 8, 0, 0], scale=1.0, act="silu", k_cache=torch.zeros(1, 4, 1, 8),
                v_cache=torch.zeros(1, 4, 1, 8))
    for bad, match in ((dict(projs=[panels._replace(kind="fp8")] * 4), "unknown projection kind 'fp8'"),
                       (dict(projs=[panels._replace(tensors=(w, w))] * 4), "a f32_panels projection takes 1 tensors"),
                       (dict(projs=[panels] * 3), r"projs must be \(qkv, o, gate_up, down\)"),
                       (dict(dims=[8, 8]), "dims must hold 8 numbers"),
                       (dict(act="relu"), "unknown activation 'relu'"),
                       (dict(qk_norms=[norm]), r"qk_norms must be \(\) or 2 norms")):
        with pytest.raises(RuntimeError, match=match):
            step.add_layer(**{**good, **bad})
    step.add_layer(**good)
    assert step.num_layers == 1
    kv = torch.zeros(1, 2, 1, 4, 1, 8)
    step.run(torch.ones(1, 8), [(torch.ones(1, 1, 8), torch.zeros(1, 1, 8))], kv, torch.zeros(1, dtype=torch.long),
             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="layers are added before the first run"):
        step.add_layer(**good)


def test_a_projection_without_a_kernel_keeps_the_layer_loop_in_python(tmp_path):
    """A projection the C++ loop cannot call (here a plain nn.Linear; a tensor-parallel one alike): the plan still
    runs, bit-identical, with its Python loop."""
    cfg, model = _model("llama3", tmp_path)
    layer = model.model.layers[1].self_attn
    dense = torch.nn.Linear(layer.o_proj.in_features, layer.o_proj.out_features, bias=False)
    dense.weight.data.copy_(layer.o_proj.dense_weight())
    layer.o_proj = dense.requires_grad_(False)
    prompt = [5, 9, 17, 33, 4]
    tables = _tables([len(prompt)], room=4)
    kv_model = _prefilled(model, cfg, [prompt], tables)
    kv_plan = kv_model.clone()
    plan = build_decode_plan(model, kv_plan)
    assert plan is not None and plan.native is None
    meta = build_attention_metadata([SeqSlice(len(prompt), 1, tables[0])], BLOCK, sliding_windows=model.sliding_windows)
    assert torch.equal(plan(torch.tensor([7]), meta), model(torch.tensor([7]), meta, kv_model))
    assert torch.equal(kv_plan, kv_model)

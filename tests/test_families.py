"""Every served model family against HF ``transformers`` on the same weights, token for token.

Tiny random-initialised models (``tests/family_models.py``: HF configs, a few layers,
hidden 64, saved with ``save_pretrained`` as safetensors folders) run through the engine
(paged KV cache in 4-token blocks, batched varlen prefill, batched decode) and through HF
``generate`` (float32 greedy); a divergence is accepted only at a near tie (HF top-2
logits < 1e-2 apart, ``assert_greedy_matches``). Llama 3.x RoPE (``llama3``), YaRN and
dynamic NTK (prompts past ``max_position_embeddings``), Mistral's and Qwen2's sliding
windows, Qwen3's q/k norm, Gemma 3 (8-token windows on its local layers: prompts and
decodes well past the window). Plus the registry's refusal of other architectures at
``pdcluster up``, and ``--model Org/Name`` from a fake local Hugging Face cache.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.model_config import ConfigError, ModelConfig
from deploy import local
from deploy.cluster import worker_config_from_dict, worker_config_to_dict
from deploy.spec import spec_from_args
from engine.attention import SeqSlice, build_attention_metadata
from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model import load_model
from engine.model.families import family_for, load_arch, supported_architectures
from engine.model_loader import ModelNotFoundError, hf_hub_cache, resolve_model
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan
from family_models import FAMILIES, build_tiny, hf_model
from pdcluster.cli import build_parser

from cli_helpers import parse_up
from cluster_utils import assert_greedy_matches, hf_greedy

CPU = torch.device("cpu")
BLOCK = 4
GREEDY = SamplingOptions(temperature=0.0)
PROMPT_LENS = (5, 23, 37)  # shorter than, and 3x / 4.6x past, the 8-token windows
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_tiny(name, root / name) for name in FAMILIES}


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _engine_greedy(model, cfg, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Batched prefill of ``prompts`` then ``n_new - 1`` batched decode steps, greedy."""
    kv = allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=64), CPU)
    runner = ModelRunner(model, kv, BLOCK)
    per_seq = 63 // len(prompts)
    tables = [list(range(1 + per_seq * i, 1 + per_seq * (i + 1)))[::-1] for i in range(len(prompts))]  # out of order
    outs = [[t] for t in runner.execute(StepPlan([
        ScheduledSeq(f"r{i}", p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)])).token_ids]
    for _ in range(n_new - 1):
        step = runner.execute(StepPlan([ScheduledSeq(f"r{i}", [o[-1]], len(p) + len(o) - 1, tables[i], True, GREEDY)
                                        for i, (p, o) in enumerate(zip(prompts, outs))]))
        for o, t in zip(outs, step.token_ids):
            o.append(t)
    return outs


def _assert_matches_hf(folder: Path, prompts, ours, label: str) -> None:
    for i, (p, o) in enumerate(zip(prompts, ours)):
        ref, gaps = hf_greedy(hf_model(folder), p, len(o))  # fresh HF model: dynamic RoPE keeps state
        assert_greedy_matches(o[:len(ref)], ref, gaps, label=f"{label} prompt {i}")  # HF stops at EOS


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_hf(tiny_models, family):
    folder = tiny_models[family]
    cfg = ModelConfig.from_hf_folder(folder)
    model = load_model(cfg, CPU, torch.float32, attention_backend="torch")  # the CPU serving path
    prompts = _prompts(cfg.vocab_size)
    ours = _engine_greedy(model, cfg, prompts, NEW_TOKENS)
    _assert_matches_hf(folder, prompts, ours, family)


def test_family_configs_reach_the_decoder(tiny_models):
    arch = {name: load_arch(folder) for name, folder in tiny_models.items()}
    assert arch["llama3"].rope.kind == "llama3" and arch["llama_yarn"].rope.kind == "yarn"
    assert arch["llama_dynamic"].rope.kind == "dynamic"
    assert ModelConfig.from_hf_folder(tiny_models["llama_dynamic"]).context_len == 64  # 2 x 32 positions
    assert arch["mistral"].layer_windows == (8, 8)
    assert arch["qwen2"].layer_windows == (None, 8, 8) and arch["qwen2"].qkv_bias and not arch["qwen2"].o_bias
    assert arch["qwen3"].qk_norm and not arch["qwen3"].qkv_bias and arch["qwen3"].layer_windows == ()
    g = arch["gemma3"]
    assert g.layer_windows == (8, None, 8, None) and g.sandwich_norm and g.qk_norm and g.norm_offset == 1.0
    assert (g.rope.theta, g.local_rope.theta) == (1e6, 1e4) and g.rope_for(0) is g.local_rope
    assert g.activation == "gelu_pytorch_tanh" and g.embed_scale == 8.0 and g.attn_scale == 0.25


def test_up_ships_each_familys_arch_to_its_workers(tiny_models):
    """``pdcluster up`` reads the arch once and puts it in the worker template: a worker builds
    its model from it without importing ``transformers``. It survives the state file's JSON
    round trip (kept for ``scale`` and the controller's restarts) unchanged, tuples and nested
    RoPE specs included, and a model loaded from it runs as one loaded from the folder."""
    for name, folder in tiny_models.items():
        spec = spec_from_args(parse_up("--model", str(folder)), "redis://127.0.0.1:1")
        assert spec.worker.arch == load_arch(folder), name
        assert worker_config_from_dict(json.loads(json.dumps(worker_config_to_dict(spec.worker)))) == spec.worker, name
    folder = tiny_models["gemma3"]  # two RoPEs, windows, sandwich norms
    cfg, arch = ModelConfig.from_hf_folder(folder), spec.worker.arch
    prompts = _prompts(cfg.vocab_size, lens=(23,))
    assert (_engine_greedy(load_model(cfg, CPU, torch.float32, arch=arch), cfg, prompts, 4)
            == _engine_greedy(load_model(cfg, CPU, torch.float32), cfg, prompts, 4))


def test_gemma3_window_changes_the_output(tiny_models):
    """The tests above exercise the window: without it the same weights give other logits."""
    folder = tiny_models["gemma3"]
    cfg = ModelConfig.from_hf_folder(folder)
    arch = load_arch(folder)
    windowed = load_model(cfg, CPU, torch.float32, attention_backend="torch", arch=arch)
    unwindowed = load_model(cfg, CPU, torch.float32, attention_backend="torch", arch=replace(arch, layer_windows=()))
    ids = _prompts(cfg.vocab_size, (30,))[0]
    outs = []
    for model in (windowed, unwindowed):
        kv = allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), CPU)
        meta = build_attention_metadata([SeqSlice(0, 30, list(range(1, 9)))], BLOCK,
                                        sliding_windows=model.sliding_windows)
        outs.append(model.compute_logits(model(torch.tensor(ids), meta, kv)))
    torch.testing.assert_close(outs[0][:8], outs[1][:8], atol=1e-5, rtol=0)  # inside the window: equal
    assert (outs[0][8:] - outs[1][8:]).abs().max() > 1e-2


def test_gemma3_chunked_prefill_across_the_window(tiny_models):
    """A 37-token prompt prefilled in chunks of 5, 11 and 21 tokens (each attending to the
    cached earlier ones through the window) gives the unchunked step's tokens and KV."""
    folder = tiny_models["gemma3"]
    cfg = ModelConfig.from_hf_folder(folder)
    model = load_model(cfg, CPU, torch.float32, attention_backend="torch")
    ids = _prompts(cfg.vocab_size, (37,))[0]
    whole = ModelRunner(model, allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), CPU), BLOCK)
    chunked = ModelRunner(model, allocate_kv_cache(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), CPU), BLOCK)
    table = list(range(1, 11))
    ref = whole.execute(StepPlan([ScheduledSeq("a", ids, 0, table, True, GREEDY)]))
    for lo, hi in ((0, 5), (5, 16), (16, 37)):
        out = chunked.execute(StepPlan([ScheduledSeq("b", ids[lo:hi], lo, table, hi == 37, GREEDY)]))
    assert out.token_ids == ref.token_ids
    torch.testing.assert_close(chunked.kv_cache[:, :, table], whole.kv_cache[:, :, table], atol=1e-4, rtol=0)


# ---- refusing what the engine does not serve ------------------------------------------------

def _config_folder(tmp_path: Path, **config) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_unsupported_architecture_named_with_the_supported_list(tmp_path):
    folder = _config_folder(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64)
    with pytest.raises(ConfigError) as err:
        load_arch(folder)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "'gpt2'" in msg
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert name in msg and name in supported_architectures()
    # a served model_type with another head (e.g. a classifier) is refused too
    with pytest.raises(ConfigError, match="LlamaForSequenceClassification"):
        family_for({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]})
    assert family_for({"model_type": "gemma3_text"}).name == "gemma3"


def test_up_refuses_unsupported_architecture_before_starting(tmp_path, capsys):
    folder = _config_folder(tmp_path / "model", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    state_dir = tmp_path / "state"
    args = build_parser().parse_args(["up", "--local", "--model", str(folder), "--state-dir", str(state_dir)])
    assert local.cmd_up(args) == 2
    err = capsys.readouterr().err
    assert "unsupported model architecture GPT2LMHeadModel" in err and "Gemma3ForCausalLM" in err
    assert not state_dir.exists()  # refused before anything started


@pytest.mark.parametrize(("family", "overrides", "match"), [
    ("llama3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                                 "original_max_position_embeddings": 64}}, "rope scaling 'longrope'"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("llama3", {"hidden_act": "relu"}, "activation 'relu'"),
])
def test_unsupported_feature_refused(tmp_path, family, overrides, match):
    folder = build_tiny(family, tmp_path / family, vocab_size=32, num_hidden_layers=1 if family != "gemma3" else 2,
                        **({"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3" else {}),
                        **overrides)
    with pytest.raises(ConfigError, match=match):
        load_arch(folder)


# ---- model ids from the local Hugging Face cache -------------------------------------------

def _fake_hub(hub: Path, model_id: str, folder: Path, revision: str = "0123abcd", ref: bool = True) -> Path:
    """``folder`` laid out as ``huggingface_hub`` caches ``model_id`` at ``revision``."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    shutil.copytree(folder, snap)
    if ref:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return snap


def test_model_id_resolves_from_the_hub_cache(tiny_models, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = _fake_hub(hub, "TinyOrg/tiny-qwen3", tiny_models["qwen3"])
    _fake_hub(hub, "TinyOrg/tiny-qwen3", tiny_models["llama3"], revision="older", ref=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_model("TinyOrg/tiny-qwen3") == snap  # refs/main wins over the other snapshot
    assert ModelConfig.from_hf_folder(resolve_model("TinyOrg/tiny-qwen3")).model_type == "qwen3"
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("TinyOrg/absent")
    assert str(hub / "models--TinyOrg--absent" / "snapshots") in str(err.value)
    # no refs/main: the newest snapshot
    only = _fake_hub(tmp_path / "hub2", "A/b", tiny_models["qwen3"], revision="r1", ref=False)
    assert resolve_model("A/b", hub_cache=tmp_path / "hub2") == only


def test_hub_cache_location_from_the_environment(tmp_path):
    assert hf_hub_cache({"HF_HUB_CACHE": str(tmp_path / "x"), "HF_HOME": "/elsewhere"}) == tmp_path / "x"
    assert hf_hub_cache({"HF_HOME": str(tmp_path)}) == tmp_path / "hub"
    assert hf_hub_cache({}) == Path.home() / ".cache" / "huggingface" / "hub"

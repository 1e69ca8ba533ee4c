"""Tensor parallelism inside a worker, through the engine (CPU, gloo, ranks as processes).

Tiny random models by HF's method (``tests/family_models.py``) with 4 attention heads: 2 KV
heads (split, one per rank) and 1 KV head (replicated on both ranks), tied and untied
embeddings, a vocabulary that does not divide by 2 (the last rank's LM-head rows padded).
A TP=2 runner's greedy continuation equals the TP=1 runner's and HF's (a near tie allowed
by the margin rule). The KV re-sharding of the transfer: a TP=2 cache read through
:class:`kvtransfer.HeadShards` equals the TP=1 cache of the same prompt, and a TP=1 cache
written into TP=2 shards (and back) lets the other side decode on exactly.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from common.model_config import ConfigError, ModelConfig
from engine.builder import build_runner
from engine.config import CacheConfig
from engine.model_runner import ModelRunner
from engine.sampling import SamplingOptions
from engine.step import ScheduledSeq, StepPlan
from engine.tp import TpLayout
from engine.tp.runner import STEP_TIMEOUT_S, start_tp_runner
from family_models import build_tiny, hf_model
from kvtransfer import HeadShards, gather_blocks, scatter_tokens

from cluster_utils import assert_greedy_matches, hf_greedy

GREEDY = SamplingOptions(temperature=0.0)
CACHE = CacheConfig(block_size=4, num_blocks=48, enable_prefix_caching=False)
NEW = 12
# name -> (family, build_tiny overrides)
MODELS = {
    "llama3-kv2": ("llama3", dict(vocab_size=256)),
    "qwen2-kv1-tied-odd-vocab": ("qwen2", dict(vocab_size=255, num_key_value_heads=1)),
    "gemma3-kv1": ("gemma3", dict(vocab_size=256, num_key_value_heads=1)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: build_tiny(fam, root / name, **kw) for name, (fam, kw) in MODELS.items()}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 19)]


def _tables(n: int) -> list[list[int]]:
    return [list(range(1 + 20 * i, 21 + 20 * i))[::-1] for i in range(n)]


def _prefill(runner, prompts) -> list[list[int]]:
    tables = _tables(len(prompts))
    out = runner.execute(StepPlan([ScheduledSeq(f"r{i}", p, 0, tables[i], True, GREEDY)
                                   for i, p in enumerate(prompts)]))
    return [[t] for t in out.token_ids]


def _decode(runner, prompts, outs, n: int) -> list[list[int]]:
    tables = _tables(len(prompts))
    for _ in range(n):
        step = runner.execute(StepPlan([ScheduledSeq(f"r{i}", [o[-1]], len(p) + len(o) - 1, tables[i], True, GREEDY)
                                        for i, (p, o) in enumerate(zip(prompts, outs))]))
        for o, t in zip(outs, step.token_ids):
            o.append(t)
    return outs


def _blocks(prompts) -> list[list[int]]:
    return [t[: -(-len(p) // CACHE.block_size)] for p, t in zip(prompts, _tables(len(prompts)))]


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_matches_tp1_and_hf(folders, name):
    folder = folders[name]
    prompts = _prompts(ModelConfig.from_hf_folder(folder).vocab_size)
    _, one = build_runner(str(folder), CACHE, device="cpu")
    _, two = build_runner(str(folder), CACHE, device="cpu", tp=2)
    try:
        assert len(two.procs) == 1 and all(p.is_alive() for p in two.procs)
        ours1, ours2 = _prefill(one, prompts), _prefill(two, prompts)
        # re-sharding: the TP=2 shards read as whole heads equal the TP=1 cache
        view = HeadShards.of(two.kv_parts)
        assert tuple(view.shape) == tuple(one.kv_cache.shape)
        for b in _blocks(prompts):
            torch.testing.assert_close(gather_blocks(view, 0, view.shape[0], b),
                                       gather_blocks(one.kv_cache, 0, view.shape[0], b), atol=1e-4, rtol=1e-4)
        ours1, ours2 = _decode(one, prompts, ours1, NEW - 1), _decode(two, prompts, ours2, NEW - 1)
        for i, p in enumerate(prompts):
            ref, gaps = hf_greedy(hf_model(folder), p, NEW)
            assert_greedy_matches(ours1[i], ref, gaps, f"{name} TP=1 prompt {i}")
            assert_greedy_matches(ours2[i], ref, gaps, f"{name} TP=2 prompt {i}")
    finally:
        two.close()
    assert not any(p.is_alive() for p in two.procs)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1)])
def test_kv_reshards_between_tp_sizes(folders, src_tp, dst_tp):
    """The KV of a prefill at ``src_tp`` written (token-wise, as the receiver does, into
    other blocks) into a fresh ``dst_tp`` cache: the destination decodes what the source would."""
    folder = folders["qwen2-kv1-tied-odd-vocab" if src_tp == 2 else "llama3-kv2"]
    prompts = _prompts(ModelConfig.from_hf_folder(folder).vocab_size)
    _, src = build_runner(str(folder), CACHE, device="cpu", tp=src_tp)
    _, dst = build_runner(str(folder), CACHE, device="cpu", tp=dst_tp)
    try:
        firsts = _prefill(src, prompts)
        src_view, dst_view = HeadShards.of(src.kv_parts), HeadShards.of(dst.kv_parts)
        for b in _blocks(prompts):
            kv = gather_blocks(src_view, 0, src_view.shape[0], b)
            scatter_tokens(dst_view, 0, dst_view.shape[0], b, 0, kv)
        ref = _decode(src, prompts, [list(f) for f in firsts], NEW - 1)
        got = _decode(dst, prompts, [list(f) for f in firsts], NEW - 1)
        for i, p in enumerate(prompts):
            want, gaps = hf_greedy(hf_model(folder), p, NEW)
            assert_greedy_matches(ref[i], want, gaps, f"source prompt {i}")
            assert_greedy_matches(got[i], want, gaps, f"TP {src_tp} -> {dst_tp} prompt {i}")
    finally:
        src.close()
        dst.close()


def test_layout_splits_heads_and_refuses_what_does_not_split():
    two_kv = TpLayout(2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=255)
    assert [two_kv.kv_heads(r) for r in range(2)] == [(0, 1), (1, 2)] and two_kv.owners() == [0, 1]
    assert two_kv.local_vocab == 128 and two_kv.local_heads == 2
    one_kv = TpLayout(4, num_heads=8, num_kv_heads=2, intermediate_size=128, vocab_size=256)
    assert [one_kv.kv_heads(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)] and one_kv.owners() == [0, 2]
    with pytest.raises(ConfigError, match="num_attention_heads"):
        TpLayout(3, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        TpLayout(4, num_heads=12, num_kv_heads=6, intermediate_size=128, vocab_size=256)
    with pytest.raises(ConfigError, match="intermediate_size"):
        TpLayout(2, num_heads=4, num_kv_heads=2, intermediate_size=127, vocab_size=256)


def test_head_shards_validate_and_replicated_heads_are_read_once():
    a, b = torch.randn(2, 2, 3, 4, 1, 8), torch.randn(2, 2, 3, 4, 1, 8)
    with pytest.raises(ValueError, match="gap"):
        HeadShards(((a, 0, 1), (b, 2, 3)))
    replicated = HeadShards(((a, 0, 1), (b, 0, 1)))
    assert replicated.shape[4] == 1
    torch.testing.assert_close(gather_blocks(replicated, 0, 2, [2, 0]), gather_blocks(a, 0, 2, [2, 0]))
    with pytest.raises(ValueError, match="heads"):
        scatter_tokens(HeadShards(((a, 0, 1), (b, 1, 2))), 0, 2, [0], 0, torch.randn(2, 2, 1, 4, 1, 8))


def test_tp_flags_reach_each_role_and_size_its_bundle(folders):
    from deploy.placement import PlacementConfig, WorkerShape
    from deploy.spec import spec_from_args
    from pdcluster.cli import build_parser

    def spec(*flags):
        args = build_parser().parse_args(["up", "--local", "--model", str(folders["llama3-kv2"]), *flags])
        return spec_from_args(args, "redis://127.0.0.1:1")

    worker = spec("--prefill-tp", "2").worker
    assert worker.for_role("prefill", "p0").tp == 2 and worker.for_role("decode", "d0").tp == 1
    assert WorkerShape(1.0, 1.0, 1, "cuda").bundle("prefill", PlacementConfig(), tp=2) == {"CPU": 2.0, "GPU": 2.0}
    with pytest.raises(ConfigError, match=r"--decode-tp 3: .*num_attention_heads \(4\)"):
        spec("--decode-tp", "3")
    with pytest.raises(ConfigError, match=r"--prefill-tp must be in \[1, 64\]"):
        spec("--prefill-tp", "0")
    with pytest.raises(ConfigError, match="colocated"):
        spec("--colocated", "--decode-tp", "2")


def test_the_prefill_token_budget_reaches_prefill_workers_only(folders):
    from deploy.spec import spec_from_args
    from pdcluster.cli import build_parser
    from serving.worker_config import WorkerConfig

    def spec(*flags):
        args = build_parser().parse_args(["up", "--local", "--model", str(folders["llama3-kv2"]), *flags])
        return spec_from_args(args, "redis://127.0.0.1:1")

    worker = spec("--prefill-max-num-batched-tokens", "512", "--max-num-batched-tokens", "4096").worker
    budgets = {role: worker.for_role(role, "w").scheduler.max_num_batched_tokens
               for role in ("prefill", "decode", "colocated")}
    assert budgets == {"prefill": 512, "decode": 4096, "colocated": 4096}
    assert worker.for_role("prefill", "w").prefill_scheduler is None
    # a worker's config travels as a dict (to its Ray actor): the prefill budget survives the trip
    back = WorkerConfig.from_dict(dataclasses.asdict(worker))
    assert back.for_role("prefill", "w").scheduler.max_num_batched_tokens == 512
    assert spec("--prefill-max-num-batched-tokens", "2048").worker.prefill_scheduler is None  # the default budget
    with pytest.raises(ConfigError, match=r"--prefill-max-num-batched-tokens must be >= 1 \(tokens\), got 0"):
        spec("--prefill-max-num-batched-tokens", "0")
    for flag in ("--max-num-batched-tokens", "--max-num-seqs", "--max-model-len"):  # the flag named, not the field
        with pytest.raises(ConfigError, match=f"^{flag} must be >= 1, got 0$"):
            spec(flag, "0")


def test_a_dead_rank_fails_the_step_instead_of_hanging(folders):
    _, two = build_runner(str(folders["llama3-kv2"]), CACHE, device="cpu", tp=2)
    try:
        assert two.broken() == ""
        two.procs[0].kill()
        two.procs[0].join(5)
        with pytest.raises(RuntimeError, match=r"ranks \[1\] of this worker are gone"):
            _prefill(two, [[5, 6, 7]])
        assert two.broken() == "tensor-parallel ranks [1] of this worker are gone"  # the worker host leaves on it
    finally:
        two.close()


def test_a_failed_forward_on_rank_0_breaks_the_group_for_good(folders, monkeypatch):
    """Rank 0's forward failing (e.g. a collective that timed out: a rank hung) leaves the other ranks out
    of step: the runner says it is broken, so its worker is started again (deploy.actors)."""
    _, two = build_runner(str(folders["llama3-kv2"]), CACHE, device="cpu", tp=2)
    try:
        def timed_out(self, plan):
            raise RuntimeError("Connection closed by peer / timed out")

        monkeypatch.setattr(ModelRunner, "forward_logits", timed_out)  # the base class: the TP override wraps it
        with pytest.raises(RuntimeError, match="timed out"):
            _prefill(two, [[5, 6, 7]])
        assert two.broken().startswith("a tensor-parallel step failed on rank 0 (RuntimeError")
        with pytest.raises(RuntimeError, match="cannot run steps"):
            _prefill(two, [[5, 6, 7]])
    finally:
        two.close()


def test_a_hung_rank_fails_the_step_after_the_step_timeout(folders):
    """A rank that stops answering (SIGSTOP: alive, so not "gone") fails rank 0's step once a collective
    has waited ``step_timeout_s`` (not the 300 s the ranks' start may take), and the runner is broken
    from then on, so its worker leaves and is started again."""
    assert STEP_TIMEOUT_S <= 60
    cfg = ModelConfig.from_hf_folder(str(folders["llama3-kv2"]))
    two = start_tp_runner(cfg, CACHE, 2, torch.device("cpu"), torch.float32, 1, step_timeout_s=2.0)
    try:
        assert len(_prefill(two, [[5, 6, 7]])) == 1  # serves while every rank answers
        os.kill(two.procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            _prefill(two, [[5, 6, 7]])
        assert 1.5 < time.monotonic() - t0 < 30
        assert two.broken().startswith("a tensor-parallel step failed on rank 0")
    finally:
        os.kill(two.procs[0].pid, signal.SIGCONT)
        two.close()

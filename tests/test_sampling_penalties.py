"""Logit bias, repetition / presence / frequency penalties and min-p in engine.sampling,
each against a plain-torch per-row reference (HF / vLLM / OpenAI semantics), plus a real
short generation through :class:`ModelRunner` with a repetition penalty."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.logits_processors import apply_logits_processors, token_counts
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.sampling import Sampler, SamplingOptions, make_generator
from engine.step import ScheduledSeq, StepPlan
from pdcluster.client import build_request
from router.limits import Limits
from router.validation import InvalidRequest, RequestValidator
from serving.convert import request_from_proto

VOCAB = 64


def _logits(num_seqs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_seqs, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def _history(seed: int, n_prompt: int, n_out: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    # a small id range so that tokens repeat
    return (torch.randint(0, 12, (n_prompt,), generator=g).tolist(),
            torch.randint(0, 12, (n_out,), generator=g).tolist())


def ref_process(x: torch.Tensor, opt: SamplingOptions, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, one token at a time: bias, HF repetition penalty, OpenAI frequency/presence."""
    x = x.clone()
    for t, b in opt.logit_bias:
        x[t] += b
    r = opt.repetition_penalty
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= opt.frequency_penalty * output.count(t) + opt.presence_penalty
    return x


def ref_probs(x: torch.Tensor, opt: SamplingOptions) -> torch.Tensor:
    """Final distribution of one sampled row: temperature, top-k, top-p, min-p, renormalize."""
    p = torch.softmax(x / opt.temperature, dim=-1)
    order = sorted(range(len(p)), key=lambda t: (-p[t].item(), t))
    kept, mass = [], 0.0
    for rank, t in enumerate(order):
        if opt.top_k and rank >= opt.top_k:
            break
        if rank > 0 and opt.top_p < 1.0 and mass >= opt.top_p * sum(p[s].item() for s in order[:opt.top_k or None]):
            break
        kept.append(t)
        mass += p[t].item()
    q = p[kept] / p[kept].sum()  # renormalized after top-k / top-p, then min-p on it
    kept = [t for t, qt in zip(kept, q.tolist()) if qt >= opt.min_p * q.max().item()]
    out = torch.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


def ref_token(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF over tokens sorted by probability descending (lower id first on ties)."""
    order = sorted((t for t in range(len(probs)) if probs[t] > 0), key=lambda t: (-probs[t].item(), t))
    cdf = 0.0
    for t in order:
        cdf += probs[t].item()
        if cdf > u:
            return t
    return order[-1]


MIXED = [
    SamplingOptions(temperature=0.0),                                              # plain greedy: fast path
    SamplingOptions(temperature=0.0, repetition_penalty=1.3, logit_bias={3: 2.5}),
    SamplingOptions(temperature=0.9, top_k=20, seed=11),                           # plain sampled: fast path
    SamplingOptions(temperature=1.1, repetition_penalty=0.7, seed=12),             # < 1 favours repeats
    SamplingOptions(temperature=0.8, presence_penalty=1.5, frequency_penalty=-0.5, min_p=0.05, seed=13),
    SamplingOptions(temperature=1.0, frequency_penalty=2.0, top_p=0.8, seed=14),
    SamplingOptions(temperature=1.3, logit_bias={0: -100.0, 7: 4.0, 63: 1.5}, min_p=0.2, top_k=10, seed=15),
    SamplingOptions(temperature=0.7, repetition_penalty=1.8, presence_penalty=-2.0, logit_bias={5: -3.0},
                    top_k=30, top_p=0.9, min_p=0.1, seed=16),
]


def _mixed_histories() -> list[tuple[list[int], list[int]]]:
    return [_history(i, n_prompt=3 + 2 * i, n_out=(0 if i == 5 else i * 3)) for i in range(len(MIXED))]


def test_processors_match_reference_and_fast_path_rows_untouched():
    logits = _logits(len(MIXED), seed=1)
    histories = _mixed_histories()
    before = [(list(p), list(o)) for p, o in histories]
    out = apply_logits_processors(logits, MIXED, histories)
    assert out is not logits and out.dtype == torch.float32 and out.shape == logits.shape
    for i, (opt, (p, o)) in enumerate(zip(MIXED, histories)):
        torch.testing.assert_close(out[i], ref_process(logits[i], opt, p, o), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])          # no bias / penalty: bit-identical
    assert histories == before                                 # read, never modified
    # no row with a bias or penalty: the input itself, no history needed
    plain = [SamplingOptions(temperature=0.0), SamplingOptions(top_k=3, min_p=0.5)]
    head = logits[:2]
    assert apply_logits_processors(head, plain, None) is head


def test_sampler_tokens_match_reference_over_steps():
    """Greedy rows take argmax of the processed logits; seeded rows the reference inverse-CDF
    token for the same uniform; logprobs stay those of the raw logits."""
    histories = _mixed_histories()
    gens = [make_generator(o.seed) if o.seed is not None else None for o in MIXED]
    ref_gens = [make_generator(o.seed) if o.seed is not None else None for o in MIXED]
    sampler = Sampler(seed=0)
    opts = [replace(o, logprobs=2) for o in MIXED]
    for step in range(4):
        logits = _logits(len(MIXED), seed=10 + step)
        out = sampler.sample(logits, opts, gens, histories)
        for i, (opt, (p, o)) in enumerate(zip(MIXED, histories)):
            x = ref_process(logits[i], opt, p, o)
            if opt.temperature == 0.0:
                assert out.token_ids[i].item() == int(x.argmax())
            elif opt.seed is not None:
                u = torch.rand(1, generator=ref_gens[i]).item()
                assert out.token_ids[i].item() == ref_token(ref_probs(x, opt), u), (step, i)
        raw = torch.log_softmax(logits, dim=-1)
        torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
        torch.testing.assert_close(out.top_logprobs, raw.topk(2, dim=-1).values)
        for (_, o), t in zip(histories, out.token_ids.tolist()):
            o.append(t)


def test_seeded_row_with_penalties_ignores_companions_and_slot():
    target = SamplingOptions(temperature=1.0, top_p=0.95, min_p=0.02, repetition_penalty=1.4,
                             presence_penalty=0.8, frequency_penalty=0.6, logit_bias={9: 2.0}, seed=777)

    def run(slot: int, companions: list[SamplingOptions]) -> list[int]:
        sampler, gen = Sampler(seed=slot), make_generator(target.seed)
        gens = [make_generator(o.seed) if o.seed is not None else None for o in companions]
        gens.insert(slot, gen)
        opts = list(companions)
        opts.insert(slot, target)
        hists = [_history(50 + j, 4 + j, j) for j in range(len(companions))]
        mine = _history(99, 6, 2)
        hists.insert(slot, mine)
        tokens = []
        for s in range(6):
            batch = _logits(len(opts), seed=300 + s + 7 * slot)
            batch[slot] = _logits(1, seed=200 + s)[0]
            tokens.append(sampler.sample(batch, opts, gens, hists).token_ids[slot].item())
            mine[1].append(tokens[-1])
        return tokens

    alone = run(0, [])
    assert run(3, MIXED[:6]) == alone
    assert run(1, [MIXED[7], MIXED[1]]) == alone
    assert run(8, MIXED) == alone


@pytest.mark.parametrize(
    ("opts", "expected"),
    [
        (SamplingOptions(min_p=0.45), [0.0, 2 / 9, 3 / 9, 4 / 9]),                # keep p >= 0.18
        (SamplingOptions(min_p=0.6), [0.0, 0.0, 3 / 7, 4 / 7]),                   # keep p >= 0.24
        (SamplingOptions(temperature=0.5, min_p=0.5), [0.0, 0.0, 9 / 25, 16 / 25]),  # after temperature
        (SamplingOptions(min_p=0.3, top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
)
def test_min_p_distribution(opts, expected):
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    n = 20000
    out = Sampler(seed=3).sample(logits.expand(n, -1).contiguous(), [opts] * n, [None] * n)
    counts = torch.bincount(out.token_ids, minlength=4).float()
    expected = torch.tensor(expected)
    assert torch.all(counts[expected == 0] == 0)
    kept = expected > 0
    chi2 = float(((counts[kept] - expected[kept] * n) ** 2 / (expected[kept] * n)).sum())
    assert chi2 < 16.27  # 99.9% quantile of chi-square, <= 3 degrees of freedom


def test_min_p_edges():
    logits = _logits(16, seed=4)
    sampler = Sampler(seed=4)
    # min_p = 1 keeps only the top token(s): greedy without ties ...
    out = sampler.sample(logits, [SamplingOptions(temperature=1.7, min_p=1.0)] * 16, [None] * 16)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    # ... and exactly the tied top tokens with ties
    tied = torch.full((4000, VOCAB), -5.0)
    tied[:, [6, 40]] = 3.0
    out = sampler.sample(tied, [SamplingOptions(min_p=1.0)] * 4000, [None] * 4000)
    assert set(out.token_ids.tolist()) == {6, 40}
    # min_p = 0 is off: same tokens as without it for the same seed
    a = Sampler(seed=0).sample(logits, [SamplingOptions(min_p=0.0, seed=5)] * 16,
                               [make_generator(5 + i) for i in range(16)])
    b = Sampler(seed=0).sample(logits, [SamplingOptions(seed=5)] * 16, [make_generator(5 + i) for i in range(16)])
    assert torch.equal(a.token_ids, b.token_ids)


def test_logit_bias_forces_and_bans_tokens():
    logits = _logits(6, seed=6)
    force = {17: 100.0}
    opts = [SamplingOptions(temperature=0.0, logit_bias=force), SamplingOptions(temperature=1.5, logit_bias=force),
            SamplingOptions(temperature=1.0, top_k=3, logit_bias=force, seed=1)]
    out = Sampler(seed=6).sample(logits[:3], opts, [None, None, make_generator(1)])
    assert out.token_ids.tolist() == [17, 17, 17]
    top = logits[3:].argmax(dim=-1).tolist()
    banned = [SamplingOptions(temperature=0.0, logit_bias={t: -100.0}) for t in top]
    out = Sampler(seed=6).sample(logits[3:], banned, [None] * 3)
    assert all(a != b for a, b in zip(out.token_ids.tolist(), top))
    with pytest.raises(ValueError, match="logit_bias token id 64 >= vocab 64"):
        Sampler(seed=0).sample(logits[:1], [SamplingOptions(logit_bias={64: 1.0})], [None])


def test_token_counts_and_errors():
    rows = [([1, 2, 2], [5]), ([], []), ([3], [3, 3, 0])]
    counts = token_counts(rows, 8, torch.device("cpu"))
    ref = torch.stack([torch.bincount(torch.tensor(p + o, dtype=torch.long), minlength=8) for p, o in rows]).float()
    assert counts.dtype == torch.float32 and torch.equal(counts, ref)
    assert torch.equal(token_counts([((),)], 8, torch.device("cpu")), torch.zeros(1, 8))
    with pytest.raises(ValueError, match="outside"):
        token_counts([([8],)], 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="histories"):
        Sampler(seed=0).sample(_logits(1), [SamplingOptions(presence_penalty=1.0)], [None])


@pytest.mark.parametrize("kwargs", [
    dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=float("nan")), dict(repetition_penalty=0.0),
    dict(repetition_penalty=-1.0), dict(repetition_penalty=float("inf")), dict(presence_penalty=2.5),
    dict(frequency_penalty=-2.01), dict(logit_bias={1: 101.0}), dict(logit_bias={-1: 1.0}),
    dict(logit_bias={2: float("nan")}), dict(logit_bias=((1, 1.0), (1, 2.0))),
])
def test_options_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingOptions(**kwargs)


def test_logit_bias_normalized_to_sorted_pairs():
    opts = SamplingOptions(logit_bias={9: 1, 2: -3.5})
    assert opts.logit_bias == ((2, -3.5), (9, 1.0))
    assert hash(opts) == hash(SamplingOptions(logit_bias=((9, 1.0), (2, -3.5))))


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(min_p=float("nan")), "sampling.min_p"), (dict(min_p=1.01), "sampling.min_p"),
    (dict(repetition_penalty=float("inf")), "sampling.repetition_penalty"),
    (dict(repetition_penalty=-0.5), "sampling.repetition_penalty"),
    (dict(presence_penalty=float("nan")), "sampling.presence_penalty"),
    (dict(frequency_penalty=2.5), "sampling.frequency_penalty"),
    (dict(logit_bias={1000: 1.0}), "sampling.logit_bias: token id 1000 >= vocab_size 1000"),
    (dict(logit_bias={3: -101.0}), "sampling.logit_bias[3]"),
])
def test_router_rejects_new_fields_naming_them(kwargs, needle):
    validator = RequestValidator(tokenizer=None, limits=Limits(max_model_len=64, vocab_size=1000))
    with pytest.raises(InvalidRequest, match=re.escape(needle)):
        validator.prepare(build_request([1, 2, 3], **kwargs))


def test_router_resolves_fields_and_worker_maps_them():
    """router -> WorkerRequest -> worker SamplingOptions keeps every new field (unset = off)."""
    validator = RequestValidator(tokenizer=None, limits=Limits(max_model_len=64, vocab_size=1000))
    full = validator.prepare(build_request([1, 2, 3], temperature=0.5, min_p=0.25, repetition_penalty=1.25,
                                           presence_penalty=-1.5, frequency_penalty=2.0,
                                           logit_bias={999: 100.0, 4: -0.5}))
    opts = request_from_proto(full.worker_request, "t", torch.device("cpu")).params.sampling
    assert (opts.min_p, opts.repetition_penalty, opts.presence_penalty, opts.frequency_penalty) == (
        0.25, 1.25, -1.5, 2.0)
    assert opts.logit_bias == ((4, -0.5), (999, 100.0))
    plain = validator.prepare(build_request([1, 2, 3]))
    assert plain.worker_request.sampling.HasField("repetition_penalty")  # resolved default
    opts = request_from_proto(plain.worker_request, "t", torch.device("cpu")).params.sampling
    assert (opts.min_p, opts.repetition_penalty, opts.presence_penalty, opts.frequency_penalty,
            opts.logit_bias) == (0.0, 1.0, 0.0, 0.0, ())


@pytest.fixture(scope="module")
def runner(model_config):
    model = load_model(model_config, torch.device("cpu"), torch.float32)
    kv = allocate_kv_cache(model_config, CacheConfig(block_size=16, num_blocks=16), torch.device("cpu"))
    return ModelRunner(model, kv, 16)


def _generate(runner: ModelRunner, prompts: list[list[int]], opts: list[SamplingOptions], steps: int) -> list[list[int]]:
    """Greedy/sampled continuation of a batch, histories passed as the live lists."""
    outs: list[list[int]] = [[] for _ in prompts]
    tables = [list(range(4 * j, 4 * j + 4)) for j in range(len(prompts))]
    gens = [make_generator(o.seed) if o.seed is not None else None for o in opts]
    seqs = [ScheduledSeq(str(j), p, 0, tables[j], True, o, g, p, outs[j])
            for j, (p, o, g) in enumerate(zip(prompts, opts, gens))]
    for step in range(steps):
        res = runner.execute(StepPlan(seqs))
        for j, t in enumerate(res.token_ids):
            outs[j].append(t)
        seqs = [ScheduledSeq(str(j), [outs[j][-1]], len(p) + step, tables[j], True, o, g, p, outs[j])
                for j, (p, o, g) in enumerate(zip(prompts, opts, gens))]
    return outs


def test_penalties_reduce_repeats_in_real_generation(runner, tokenizer):
    """SmolLM2 loops on a list prompt under greedy; a repetition penalty (HF semantics) and a
    frequency penalty (OpenAI semantics) make it repeat fewer tokens (one mixed batch)."""
    prompt = tokenizer.encode("one two three one two three one two three one two three")
    greedy = SamplingOptions(temperature=0.0)
    opts = [greedy, SamplingOptions(temperature=0.0, repetition_penalty=1.5),
            SamplingOptions(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)]
    plain, rep, freq = _generate(runner, [prompt] * 3, opts, steps=16)

    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))

    assert repeats(plain) >= 6, tokenizer.decode(plain)  # the premise: plain greedy loops
    assert repeats(rep) < repeats(plain) and repeats(freq) < repeats(plain)
    seen = set(prompt)
    assert sum(t in seen for t in rep) < sum(t in seen for t in plain)

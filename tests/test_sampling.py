"""Tests for engine.sampling: greedy, top-k/top-p, seeds, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import Sampler, SamplingOptions, make_generator

VOCAB = 64


def _logits(num_seqs: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, vocab, generator=gen) * 3.0


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _empirical(opts: SamplingOptions, logits_row: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    out = Sampler(seed=seed).sample(logits_row.expand(n, -1).contiguous(), [opts] * n, [None] * n)
    return torch.bincount(out.token_ids, minlength=logits_row.numel()).float()


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = _logits(8)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1.0
    out = Sampler(seed=0).sample(logits, [SamplingOptions(temperature=0.0)] * 8, [None] * 8)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[3].item() == 5
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-30, 9.9e-6])
def test_temperature_below_greedy_below_is_greedy_and_draws_nothing(temperature):
    """A positive temperature too small to divide by (the logits would overflow to inf, the softmax
    to NaN) is greedy, as in vLLM; a seeded row's generator is not advanced."""
    from engine.sampling import GREEDY_BELOW
    logits = _logits(4, seed=7) * 100.0
    opts = SamplingOptions(temperature=temperature, seed=3)
    assert opts.temperature == 0.0 and temperature < GREEDY_BELOW
    gens = [make_generator(3) for _ in range(4)]
    out = Sampler(seed=0).sample(logits, [opts] * 4, gens)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert all(torch.equal(g.get_state(), make_generator(3).get_state()) for g in gens)
    assert SamplingOptions(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW  # the bound itself samples


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(16, seed=1)
    logits[0, 7] = logits[0, 2] = logits[0].max() + 1.0  # tie: lowest id wins
    sampler = Sampler(seed=1)
    for opts in (SamplingOptions(temperature=1.5, top_k=1), SamplingOptions(temperature=2.0, top_p=1e-6)):
        for _ in range(5):
            out = sampler.sample(logits, [opts] * 16, [None] * 16)
            assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM's clients send ``top_k: -1`` for "no top-k" (helper finding: it was refused): the same
    draws as 0."""
    logits = _logits(8, seed=5)
    draws = [Sampler(seed=0).sample(logits, [SamplingOptions(temperature=1.0, top_k=k, seed=9)] * 8,
                                    [make_generator(9) for _ in range(8)]).token_ids for k in (0, -1)]
    assert torch.equal(draws[0], draws[1])


def test_seeded_rows_reproducible_and_batch_independent():
    target = SamplingOptions(temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    steps = [_logits(1, seed=100 + s)[0] for s in range(6)]

    def run(slot: int, companions: list[SamplingOptions], sampler_seed: int) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        gen = make_generator(target.seed)
        tokens = []
        for s, row in enumerate(steps):
            batch = _logits(len(companions) + 1, seed=200 + s)
            batch[slot] = row
            opts = list(companions)
            opts.insert(slot, target)
            gens = [make_generator(o.seed) if o.seed is not None else None for o in companions]
            gens.insert(slot, gen)
            tokens.append(sampler.sample(batch, opts, gens).token_ids[slot].item())
        return tokens

    alone = run(0, [], sampler_seed=0)
    assert run(0, [], sampler_seed=0) == alone
    others = [
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=0.7, top_k=3),
        SamplingOptions(temperature=1.0, seed=99),
        SamplingOptions(temperature=1.3, top_p=0.5, logprobs=2),
    ]
    assert run(3, others, sampler_seed=7) == alone
    assert run(1, others[:2], sampler_seed=8) == alone
    # A different seed gives a different stream on flat logits.
    flat = torch.zeros(1, 1000)
    opts_a = [SamplingOptions(seed=1)]
    opts_b = [SamplingOptions(seed=2)]
    ga, gb, sampler = make_generator(1), make_generator(2), Sampler(seed=0)
    a = [sampler.sample(flat, opts_a, [ga]).token_ids.item() for _ in range(4)]
    b = [sampler.sample(flat, opts_b, [gb]).token_ids.item() for _ in range(4)]
    assert a != b


def test_one_draw_per_sampled_row_contract():
    logits = _logits(1, seed=9, vocab=1000)
    opts = [SamplingOptions(seed=21)]
    continued, skipped = make_generator(21), make_generator(21)
    sampler = Sampler(seed=0, device="cpu")
    sampler.sample(logits, opts, [continued])
    sampler.sample(logits, [SamplingOptions(temperature=0.0, seed=21)], [continued])  # greedy: no draw
    torch.rand(1, generator=skipped, device=skipped.device)
    flat = torch.zeros(1, 1000)
    a = sampler.sample(flat, opts, [continued]).token_ids.item()
    b = sampler.sample(flat, opts, [skipped]).token_ids.item()
    fresh = sampler.sample(flat, opts, [make_generator(21)]).token_ids.item()
    assert a == b != fresh


@pytest.mark.parametrize(
    ("opts", "expected"),
    [
        (SamplingOptions(temperature=1.0), [0.1, 0.2, 0.3, 0.4]),
        (SamplingOptions(temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30]),
        (SamplingOptions(temperature=1.0, top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
        (SamplingOptions(temperature=1.0, top_p=0.5), [0.0, 0.0, 3 / 7, 4 / 7]),
        (SamplingOptions(temperature=1.0, top_p=0.75), [0.0, 2 / 9, 3 / 9, 4 / 9]),
        (SamplingOptions(temperature=1.0, top_k=3, top_p=0.6), [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
)
def test_empirical_distribution(opts, expected):
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    counts = _empirical(opts, logits, n=20000, seed=3)
    expected = torch.tensor(expected)
    assert torch.all(counts[expected == 0] == 0)
    kept = expected > 0
    # 99.9% quantile of chi-square with <= 3 degrees of freedom is 16.27.
    assert _chi_square(counts[kept], expected[kept]) < 16.27


def test_logprobs_match_log_softmax():
    logits = _logits(5, seed=4)
    opts = [SamplingOptions(temperature=0.8, logprobs=n) for n in (0, 1, 3, 5, 2)]
    out = Sampler(seed=4).sample(logits, opts, [None] * 5)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (5,)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (5, 5) and out.top_ids.dtype == torch.int64
    ref_top, ref_ids = ref.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, ref_top)
    assert torch.equal(out.top_ids, ref_ids)


def test_mixed_batch():
    logits = _logits(6, seed=5)
    opts = [
        SamplingOptions(temperature=0.0, logprobs=1),
        SamplingOptions(temperature=1.0, top_k=1),
        SamplingOptions(temperature=0.9, seed=11),
        SamplingOptions(temperature=1.2, top_p=0.8, top_k=10),
        SamplingOptions(temperature=0.0, seed=12),
        SamplingOptions(temperature=0.5, top_p=1e-7),
    ]
    gens = [None, None, make_generator(11), None, make_generator(12), None]
    out = Sampler(seed=5).sample(logits, opts, gens)
    greedy = logits.argmax(dim=-1)
    for i in (0, 1, 4, 5):
        assert out.token_ids[i] == greedy[i]
    top10 = set(logits[3].topk(10).indices.tolist())
    assert out.token_ids[3].item() in top10
    alone = Sampler(seed=0).sample(logits[2:3], [opts[2]], [make_generator(11)])
    assert out.token_ids[2] == alone.token_ids[0]
    assert out.top_ids.shape == (6, 1)
    assert math.isclose(out.logprobs[0].item(), torch.log_softmax(logits[0], -1).max().item(), rel_tol=1e-6)


def test_validation_errors():
    with pytest.raises(ValueError):
        SamplingOptions(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingOptions(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingOptions(top_k=-2)
    sampler = Sampler(seed=0)
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(VOCAB), [SamplingOptions()], [None])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, VOCAB), [SamplingOptions()], [None])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(1, VOCAB), [SamplingOptions(seed=3)], [None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_with_cuda_and_cpu_generators():
    logits = _logits(4, seed=6).cuda()
    opts = [SamplingOptions(seed=5, top_k=8), SamplingOptions(seed=6), SamplingOptions(), SamplingOptions(logprobs=2)]
    gens = [make_generator(5, "cuda"), make_generator(6, "cpu"), None, None]
    out = Sampler(seed=6).sample(logits, opts, gens)
    assert out.token_ids.device.type == "cuda" and out.top_ids.device.type == "cuda"
    alone = Sampler(seed=0).sample(logits[:1], opts[:1], [make_generator(5, "cuda")])
    assert out.token_ids[0].item() == alone.token_ids[0].item()


def test_seeds_differing_above_32_bits_give_different_streams():
    """torch's CPU generator keeps 32 bits of a seed: make_generator folds the high half in, and
    leaves a seed below 2**32 as it is (earlier outputs of such seeds are unchanged)."""
    def draws(seed: int) -> torch.Tensor:
        return torch.rand(8, generator=make_generator(seed))

    assert torch.equal(draws(7), torch.rand(8, generator=torch.Generator().manual_seed(7)))
    streams = [draws(s) for s in (7, 7 + 2**32, 7 + 2**63, 2**64 - 1, 2**32 - 1)]
    assert all(not torch.equal(a, b) for i, a in enumerate(streams) for b in streams[i + 1:])


def test_min_tokens_bans_the_ids_that_would_end_the_request():
    """While fewer than ``min_tokens`` outputs exist, the row's stop ids get -inf (greedy and sampled
    rows alike); the raw logprobs are those of the model; from ``min_tokens`` on nothing is banned."""
    logits = torch.zeros(3, 10)
    logits[:, 3] = 5.0
    before = logits.clone()
    opts = [SamplingOptions(temperature=0, min_tokens=2, logprobs=1),
            SamplingOptions(temperature=1.0, seed=1, min_tokens=2), SamplingOptions(temperature=0)]
    gens = [None, make_generator(1), None]
    early = Sampler(seed=0).sample(logits, opts, gens, [((1,), (4,))] * 3, [(3,), (3, 5), ()])
    assert early.token_ids[0] != 3 and early.token_ids[1] not in (3, 5) and early.token_ids[2] == 3
    assert early.top_ids[0, 0] == 3 and torch.equal(logits, before)  # raw logprobs; the logits untouched
    late = Sampler(seed=0).sample(logits, opts, [None, make_generator(1), None], [((1,), (4, 4))] * 3,
                                  [(3,), (3, 5), ()])
    assert late.token_ids.tolist()[0] == 3 and late.token_ids.tolist()[2] == 3
    with pytest.raises(ValueError, match="min_tokens"):
        Sampler().sample(logits, opts, gens, [((1,), ())] * 3, None)

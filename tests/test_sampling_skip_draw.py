"""engine.sampling.skip_draw: consumes exactly the draw a Sampler call makes for the row."""

from __future__ import annotations

import torch

from engine.sampling import Sampler, SamplingOptions, make_generator, skip_draw


def _state(gen: torch.Generator) -> torch.Tensor:
    return gen.get_state()


def test_skip_draw_equals_one_sampled_token():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(3))
    opts = [SamplingOptions(temperature=0.8, seed=42)]
    sampled, skipped = make_generator(42), make_generator(42)
    sampler = Sampler(seed=0)
    sampler.sample(logits, opts, [sampled])  # the prefill worker's first token
    skip_draw(skipped, opts[0])  # the decode worker skips that draw
    assert torch.equal(_state(sampled), _state(skipped))
    a = [sampler.sample(logits, opts, [sampled]).token_ids.item() for _ in range(5)]
    b = [sampler.sample(logits, opts, [skipped]).token_ids.item() for _ in range(5)]
    assert a == b


def test_skip_draw_is_a_no_op_for_greedy_rows_and_without_a_generator():
    gen = make_generator(7)
    before = _state(gen).clone()
    skip_draw(gen, SamplingOptions(temperature=0.0, seed=7))
    assert torch.equal(_state(gen), before)
    skip_draw(None, SamplingOptions(temperature=1.0))  # unseeded: nothing to keep in step

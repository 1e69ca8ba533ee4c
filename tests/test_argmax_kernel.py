"""The C++ greedy pick (``engine/kernels/cpu/csrc/argmax.cpp``): ``argmax_rows`` gives ``torch.argmax(dim=-1)``'s
index for decode and batch row counts, vocabularies with and without elements after its vector loop, ties (the
first wins), -0.0 against 0.0, rows of -inf, NaN (the first NaN wins) and strided input; its argument check; the
sampler's greedy rows go through it.

Skipped, with the reason, where the extension cannot be built (no compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu.argmax import argmax_rows
from engine.kernels.cpu.build import load

pytestmark = pytest.mark.skipif(load("argmax") is None, reason="the argmax extension could not be built")


@pytest.mark.parametrize("shape", [(1, 49152), (32, 49152), (3, 7), (5, 8), (2, 17), (1, 1), (70, 1000)], ids=str)
def test_same_index_as_torch(shape, threads):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    ties = torch.randint(0, 3, shape, generator=g).float()  # many equal maxima: the first wins
    assert torch.equal(argmax_rows(ties), ties.argmax(dim=-1))
    strided = torch.randn(shape[1], shape[0], generator=g).T
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))


def test_special_values_as_torch():
    inf, nan = float("inf"), float("nan")
    rows = [[-inf] * 11, [-0.0, 0.0, -1.0] * 4, [0.0, -0.0] * 6, [1.0, nan, 3.0, nan] * 3, [nan] * 9,
            [1.0] * 20 + [nan], [-inf] * 10 + [inf] + [inf] * 3, [2.0] * 8 + [5.0] + [1.0] * 8,
            [nan] + [0.0] * 7 + [5.0] + [1.0] * 7, [0.0] * 7 + [-1.0] + [nan] * 8 + [3.0]]
    for row in rows:
        x = torch.tensor([row])
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), row


def test_other_inputs_fall_back_and_bad_ones_raise():
    x = torch.randn(3, 10, dtype=torch.float64)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    kernel = load("argmax").argmax_rows
    with pytest.raises(RuntimeError, match=r"logits must be a CPU float32 tensor \[B, V\] with V >= 1"):
        kernel(torch.zeros(2, 0))


def test_the_sampler_picks_greedy_rows_with_it(monkeypatch):
    from engine.sampling import Sampler, SamplingOptions

    calls = []
    monkeypatch.setattr("engine.sampling.argmax_rows", lambda t: calls.append(t.shape) or argmax_rows(t))
    logits = torch.randn(2, 50)
    out = Sampler().sample(logits, [SamplingOptions(temperature=0.0)] * 2, [None, None])
    assert calls == [(2, 50)] and torch.equal(out.token_ids, logits.argmax(dim=-1))

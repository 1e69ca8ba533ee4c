"""HF ``transformers`` ``generate`` decode on the same weights, batch and lengths.

The prompts' KV comes from our prefill (:func:`_decode_ours.prefill_kv`), laid out as
HF's ``DynamicCache`` (keys after RoPE, ``[batch, kv_heads, tokens, head_dim]``) for the
first ``context_len - 1`` prompt tokens, and ``generate`` gets the whole prompt: it runs
only the last prompt token (its first step, which yields the first new token) and then
decodes. So HF's prefill, which this benchmark does not compare, costs nothing here, and
every prompt has the same length (no padding). Greedy, ``new_tokens`` tokens, EOS ignored.

Timing: a ``StoppingCriteria`` records the wall clock after every generated token; HF's
decode steps are the ``new_tokens - 1`` intervals after the first token, ``tpot_ms`` their
median (``tpot_ms_mean`` their mean) and ``tokens_per_s`` = batch / that interval.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch


class _StepClock:
    """Stopping criterion that never stops and records ``time.perf_counter`` per call."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_cache(prefilled: list[tuple[torch.Tensor, int]], num_tokens: int, config):
    """A ``DynamicCache`` holding the first ``num_tokens`` tokens of each prompt's KV
    (``[layers, 2, blocks, block_size, kv_heads, head_dim]`` per prompt)."""
    from transformers import DynamicCache

    layers = prefilled[0][0].shape[0]
    data = []
    for layer in range(layers):
        kv = []
        for which in (0, 1):
            t = torch.stack([p[layer, which].flatten(0, 1)[:num_tokens] for p, _ in prefilled])
            kv.append(t.transpose(1, 2).contiguous())  # [B, kv_heads, tokens, head_dim]
        data.append(tuple(kv))
    return DynamicCache(ddp_cache_data=data, config=config)


def measure_hf(hf_model, prompts: list[list[int]], prefilled: list[tuple[torch.Tensor, int]],
               new_tokens: int, step_context=None) -> dict:
    """Greedy ``generate`` of ``new_tokens`` tokens for the batch; ``step_context`` (a
    context manager, e.g. a profiler) wraps the ``generate`` call only.

    Returns:
        ``tpot_ms`` (median decode step), ``tokens_per_s`` (batch / that), the same from the
        mean (``*_mean``), ``decode_steps``, ``token_ids`` (per sequence).

    Raises:
        RuntimeError: generate stopped early.
    """
    ctx = len(prompts[0])
    input_ids = torch.tensor(prompts, dtype=torch.int64)
    cache = hf_cache(prefilled, ctx - 1, hf_model.config)
    gen = copy.deepcopy(hf_model.generation_config)
    gen.do_sample, gen.max_new_tokens, gen.min_new_tokens = False, new_tokens, None
    gen.eos_token_id, gen.pad_token_id = None, hf_model.config.eos_token_id
    gen.temperature = gen.top_p = gen.top_k = None
    clock = _StepClock()
    with torch.inference_mode(), (step_context or contextlib.nullcontext()):
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                                generation_config=gen, stopping_criteria=[clock])
    del cache
    if len(clock.times) != new_tokens:
        raise RuntimeError(f"HF generate made {len(clock.times)} tokens, expected {new_tokens}")
    steps = len(clock.times) - 1
    mean_s = (clock.times[-1] - clock.times[0]) / steps
    median_s = statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))
    return {"tokens_per_s": len(prompts) / median_s, "tpot_ms": median_s * 1e3,
            "tokens_per_s_mean": len(prompts) / mean_s, "tpot_ms_mean": mean_s * 1e3,
            "decode_steps": steps, "token_ids": out[:, ctx:].tolist()}

"""Stateless executor: takes a :class:`StepPlan`, returns a :class:`StepOutput`.

It owns the model weights and the KV cache tensor but no request state; every
block id and position comes from the scheduler's plan (vLLM v1 ``GPUModelRunner``
/ nano-vllm ``ModelRunner`` split).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.attention import SeqSlice, build_attention_metadata
from engine.model.decode_plan import build_decode_plan
from engine.model.decoder import CausalLM
from engine.prompt_logprobs import compute_prompt_logprobs
from engine.sampling import Sampler
from engine.step import ScheduledSeq, StepOutput, StepPlan, TokenLogprobs


class ModelRunner:
    """Runs steps of ``model`` over ``kv_cache``: decode steps (one new token per sequence) through
    :attr:`decode_plan` where one could be built, every other step through the model's modules.

    Args:
        model: the loaded decoder (loaded, quantized, merged and packed: the plan binds it as it is).
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_size: tokens per KV block.

    Attributes:
        decode_plan: :class:`engine.model.decode_plan.DecodePlan` of the model over ``kv_cache``, or None
            (:func:`~engine.model.decode_plan.build_decode_plan`).
        on_broken: ``f(reason)``, called once from the stepping thread the moment the runner becomes
            :meth:`broken`, before the failing step's error propagates (the worker host withdraws the
            worker then); None: no one is told.
    """

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int,
                 seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.sampler = Sampler(seed=seed)
        # decode steps as bound calls (engine.model.decode_plan): the same kernels and results, without
        # the module tree's Python (~2 ms of a ~10 ms int8 batch-1 step)
        self.decode_plan = build_decode_plan(model, kv_cache)
        self.on_broken: Callable[[str], None] | None = None

    @property
    def kv_parts(self) -> list[tuple[torch.Tensor, int, int]]:
        """The worker's whole paged KV cache as ``(tensor, first KV head, end KV head)``
        parts (one part here; one per tensor-parallel rank in :class:`engine.tp.runner.TpModelRunner`)."""
        return [(self.kv_cache, 0, self.kv_cache.shape[4])]

    def close(self) -> None:
        """Release what the runner started (nothing here; a tensor-parallel runner stops its ranks)."""

    def broken(self) -> str:
        """Why this runner can no longer run any step, for good (``""`` while it can): never here; a
        tensor-parallel runner whose rank process is gone or whose forward failed (its ranks out of
        step). A failing step fails only its batch; this says that every later step would fail too,
        so the worker should be replaced."""
        return ""

    def forward_logits(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[ScheduledSeq],
                                                      dict[str, list[TokenLogprobs]]]:
        """Run the plan's tokens (K/V written into their slots) and compute the logits of
        the sequences that sample: ``([N, vocab] float32, those N seqs, prompt logprobs)``, or
        ``(None, [], prompt logprobs)`` when none samples; the prompt logprobs of the sequences
        that ask for them (:mod:`engine.prompt_logprobs`), by request id. What every
        tensor-parallel rank runs.

        Raises:
            ValueError: a malformed plan (empty, block table too short).
        """
        meta = build_attention_metadata(
            [SeqSlice(s.num_computed, len(s.token_ids), s.block_table) for s in plan.seqs],
            self.block_size, self.device, sliding_windows=self.model.sliding_windows,
        )
        flat = [t for s in plan.seqs for t in s.token_ids]
        input_ids = torch.tensor(flat, dtype=torch.int64, device=self.device)
        if self.decode_plan is not None and meta.max_query_len == 1 and plan.on_layer_done is None:
            hidden = self.decode_plan(input_ids, meta)
        else:
            hidden = self.model(input_ids, meta, self.kv_cache, on_layer_done=plan.on_layer_done)
        prompt_lps = self._prompt_logprobs(plan, hidden)
        rows = [i for i, s in enumerate(plan.seqs) if s.sample]
        if not rows:
            return None, [], prompt_lps
        idx = meta.logits_index[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(hidden[idx]), [plan.seqs[i] for i in rows], prompt_lps

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """The prompt logprobs of the plan's sequences that ask for them (``hidden``: ``[tokens,
        hidden_size]``, the plan's tokens in order)."""
        out, start = {}, 0
        for s in plan.seqs:
            if s.prompt_logprobs is not None and s.prompt_next_ids:
                rows = hidden[start:start + len(s.prompt_next_ids)]
                out[s.request_id] = compute_prompt_logprobs(self.model.compute_logits, rows, s.prompt_next_ids,
                                                            s.prompt_logprobs)
            start += len(s.token_ids)
        return out

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step: write the new tokens' K/V into their slots and sample.

        Raises:
            ValueError: a malformed plan (empty, block table too short).
        """
        t0 = time.perf_counter()
        logits, seqs, prompt_lps = self.forward_logits(plan)
        if logits is None:
            return StepOutput([], [], [], time.perf_counter() - t0, prompt_lps)
        out = self.sampler.sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs],
                                  [(s.prompt_token_ids, s.output_token_ids) for s in seqs],
                                  [s.stop_ids for s in seqs], [s.token_bitmask for s in seqs],
                                  [s.banned_ids for s in seqs])
        token_ids = out.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if out.logprobs is not None:
            lp = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for j, s in enumerate(seqs):
                n = s.sampling.logprobs
                if n > 0:
                    top = list(zip(top_ids[j][:n], top_lp[j][:n])) if top_ids is not None else []
                    logprobs[j] = TokenLogprobs(lp[j], top)
        return StepOutput([s.request_id for s in seqs], token_ids, logprobs, time.perf_counter() - t0, prompt_lps)

"""Prompt logprobs (vLLM's ``prompt_logprobs``): the log-probability of each prompt token given the
tokens before it, computed from the hidden states of a prefill step.

The hidden state at sequence position ``p`` gives the distribution of the token at ``p + 1``; a
prefill chunk covering positions ``[s, s + n)`` of a prompt of ``P`` tokens gives the logprobs of
prompt tokens ``s + 1 .. min(s + n, P - 1)`` (:func:`prompt_next_ids`); the first prompt token has
none. Logits are computed a slice of :data:`SLICE_ROWS` positions at a time, so a long chunk never
holds ``[chunk, vocab]`` float32 at once (2048 x 49152 would be 400 MB). Natural log of the raw
model distribution (as the sampled tokens' logprobs); ``rank`` as vLLM's: 1 + the tokens with a
strictly larger logprob.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.step import TokenLogprobs

SLICE_ROWS = 256
"""Prompt positions whose logits are held at once."""


def prompt_next_ids(prompt_token_ids: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """The prompt tokens whose logprobs a chunk of ``num_tokens`` tokens from position ``start``
    yields: those at ``start + 1 .. min(start + num_tokens, P - 1)`` (a migrated request's outputs,
    after the prompt, yield none)."""
    return list(prompt_token_ids[start + 1:min(start + num_tokens, len(prompt_token_ids) - 1) + 1])


@torch.inference_mode()
def compute_prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            next_ids: Sequence[int], top_n: int) -> list[TokenLogprobs]:
    """The logprobs of ``next_ids`` given the positions whose hidden states are ``hidden``.

    Args:
        logits_of: ``[N, hidden_size]`` -> ``[N, vocab]`` float32 logits (the model's LM head).
        hidden: ``[len(next_ids), hidden_size]``, row ``i`` the state before ``next_ids[i]``.
        next_ids: the prompt tokens.
        top_n: alternatives per token, most likely first.

    Returns:
        One :class:`TokenLogprobs` per token of ``next_ids`` (with ``rank``).
    """
    out: list[TokenLogprobs] = []
    for lo in range(0, len(next_ids), SLICE_ROWS):
        logp = torch.log_softmax(logits_of(hidden[lo:lo + SLICE_ROWS]).float(), dim=-1)
        ids = torch.tensor(next_ids[lo:lo + SLICE_ROWS], dtype=torch.int64, device=logp.device)
        chosen = logp.gather(1, ids.unsqueeze(1))
        ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
        tops = logp.topk(top_n, dim=-1) if top_n else None
        top_ids = tops.indices.tolist() if tops is not None else [[] for _ in ranks]
        top_lp = tops.values.tolist() if tops is not None else [[] for _ in ranks]
        out.extend(TokenLogprobs(lp, list(zip(i, v)), rank)
                   for lp, i, v, rank in zip(chosen.squeeze(1).tolist(), top_ids, top_lp, ranks))
    return out

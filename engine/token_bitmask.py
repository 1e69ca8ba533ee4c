"""The structured-output mask of the sampler (the last logits processor; :mod:`engine.sampling`).

A row with a token bitmask (:func:`engine.structured_output.next_token_bitmask`: ``[ceil(vocab / 32)]``
int32, bit ``j`` of word ``i`` is token ``32 i + j``, xgrammar's layout) keeps only the logits of the
tokens its grammar allows; every other gets ``-inf``. Pure torch (the same result as xgrammar's
``apply_token_bitmask_inplace``, tested), so the sampler does not load xgrammar.

The grammar is a hard constraint: where the other processors left none of the allowed tokens finite
(``allowed_token_ids`` disjoint from the grammar's tokens, or ``min_tokens`` banning the stop token a
complete grammar needs), the row is the raw logits under the grammar's mask alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., W]`` int32 bitmask words -> ``[..., vocab]`` bool (True: allowed); ``W * 32 >= vocab``."""
    bits = (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 1
    return bits.flatten(-2)[..., :vocab].bool()


def apply_token_bitmasks(processed: torch.Tensor, raw: torch.Tensor,
                         bitmasks: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
    """Mask the rows of ``processed`` that have a bitmask (module docstring).

    Args:
        processed: ``[num_seqs, vocab]`` float32, the other processors' output; modified in place
            unless it is ``raw``.
        raw: ``[num_seqs, vocab]`` float32 model logits; not modified.
        bitmasks: ``num_seqs`` entries (None: unconstrained row), or None: no row is.

    Returns:
        ``processed`` (or a masked copy of ``raw`` when ``processed`` is ``raw``).
    """
    rows = [i for i, m in enumerate(bitmasks or ()) if m is not None]
    if not rows:
        return processed
    out = raw.clone() if processed is raw else processed
    device = out.device
    idx = torch.tensor(rows, device=device)
    allowed = unpack_bitmask(torch.stack([bitmasks[i] for i in rows]).to(device), out.shape[1])
    masked = out[idx].masked_fill(~allowed, float("-inf"))
    dead = ~(masked > float("-inf")).any(dim=-1)
    if bool(dead.any()):
        masked[dead] = raw[idx][dead].masked_fill(~allowed[dead], float("-inf"))
    out[idx] = masked
    return out

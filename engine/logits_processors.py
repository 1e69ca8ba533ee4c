"""Logits processors applied before sampling: allowed token ids, logit bias, repetition
penalty, frequency / presence penalties (steps 0-3 of the order in :mod:`engine.sampling`),
the ``min_tokens`` ban of early stops and the ``bad_words`` bans.

:func:`apply_logits_processors` applies them, vectorized over the batch, only on
the rows whose :class:`~engine.sampling.SamplingOptions` ask for them;
:func:`token_counts` builds the per-row token histograms the penalties read.
Min-p filtering is not here: it runs inside the sampler, after top-k / top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sampling import SamplingOptions

#: One row's token history: ``(prompt_token_ids, output_token_ids)``, the request's
#: own lists passed by reference (read, never copied or modified).
History = tuple[Sequence[int], Sequence[int]]


def token_counts(rows: Sequence[Sequence[Sequence[int]]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token id in each row: ``[len(rows), vocab]`` float32 on ``device``.

    Each row is a tuple of id sequences counted together (e.g. a row's
    ``(prompt_token_ids, output_token_ids)``). Built with one ``scatter_add_``
    over all rows' ids flattened (one host-to-device copy), not a loop over rows.

    Raises:
        ValueError: an id is outside ``[0, vocab)``.
    """
    lengths = [sum(len(part) for part in row) for row in rows]
    counts = torch.zeros(len(rows), vocab, device=device)
    total = sum(lengths)
    if total == 0:
        return counts
    flat = torch.tensor(list(chain.from_iterable(chain.from_iterable(rows))), dtype=torch.int64)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        raise ValueError(f"a history token id is outside [0, {vocab})")
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    index = (row_of * vocab + flat).to(device, non_blocking=True)
    counts.view(-1).scatter_add_(0, index, torch.ones(total, device=device))
    return counts


def apply_logits_processors(
    logits: torch.Tensor,
    options: Sequence[SamplingOptions],
    histories: Sequence[History] | None,
) -> torch.Tensor:
    """Steps 0-3 of the :mod:`engine.sampling` docstring: allowed token ids, logit bias,
    repetition penalty, then frequency / presence penalties, each only on the rows that use it.

    Args:
        logits: ``[num_seqs, vocab]`` float32; not modified.
        options: ``num_seqs`` per-row settings.
        histories: ``num_seqs`` ``(prompt_token_ids, output_token_ids)`` pairs,
            read only for rows with a penalty; may be ``None`` when no row has one.

    Returns:
        ``[num_seqs, vocab]`` float32 on ``logits.device``: ``logits`` itself
        when no row has allowed ids, a bias or a penalty, else a processed copy.

    Raises:
        ValueError: a row has a penalty but ``histories`` is missing or of the
            wrong length, a ``logit_bias`` or allowed token id is ``>= vocab``, or a
            history token id is outside ``[0, vocab)``.
    """
    num_seqs, vocab = logits.shape
    device = logits.device
    allow_rows = [i for i, o in enumerate(options) if o.allowed_token_ids]
    bias_rows = [i for i, o in enumerate(options) if o.logit_bias]
    rep_rows = [i for i, o in enumerate(options) if o.repetition_penalty != 1.0]
    out_rows = [i for i, o in enumerate(options) if o.presence_penalty != 0.0 or o.frequency_penalty != 0.0]
    if not (allow_rows or bias_rows or rep_rows or out_rows):
        return logits
    if (rep_rows or out_rows) and (histories is None or len(histories) != num_seqs):
        raise ValueError(f"rows with penalties need {num_seqs} histories, got "
                         f"{None if histories is None else len(histories)}")
    logits = logits.clone()
    if allow_rows:
        _keep_allowed(logits, allow_rows, options)
    if bias_rows:
        pairs = [(i, t, b) for i in bias_rows for t, b in options[i].logit_bias]
        if max(t for _, t, _ in pairs) >= vocab:
            raise ValueError(f"logit_bias token id {max(t for _, t, _ in pairs)} >= vocab {vocab}")
        r, t, b = zip(*pairs)
        logits.index_put_((torch.tensor(r, device=device), torch.tensor(t, device=device)),
                          torch.tensor(b, device=device), accumulate=True)
    if rep_rows:
        idx = torch.tensor(rep_rows, device=device)
        seen = token_counts([histories[i] for i in rep_rows], vocab, device) > 0
        penalty = torch.tensor([options[i].repetition_penalty for i in rep_rows], device=device).unsqueeze(1)
        sub = logits[idx]
        logits[idx] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if out_rows:
        idx = torch.tensor(out_rows, device=device)
        counts = token_counts([(histories[i][1],) for i in out_rows], vocab, device)
        freq = torch.tensor([options[i].frequency_penalty for i in out_rows], device=device).unsqueeze(1)
        pres = torch.tensor([options[i].presence_penalty for i in out_rows], device=device).unsqueeze(1)
        logits[idx] = logits[idx] - freq * counts - pres * (counts > 0).float()
    return logits


def _keep_allowed(logits: torch.Tensor, rows: list[int], options: Sequence[SamplingOptions]) -> None:
    """Every id but a row's ``allowed_token_ids`` gets ``-inf`` (in place), on ``rows``; each row's
    ids come as the index tensor its options built once (``allowed_index``, sorted)."""
    vocab = logits.shape[1]
    for i in rows:
        if options[i].allowed_token_ids[-1] >= vocab:  # sorted: the host's copy, no device sync
            raise ValueError(f"allowed token id {options[i].allowed_token_ids[-1]} >= vocab {vocab}")
        keep = torch.full((vocab,), float("-inf"), device=logits.device)
        keep[options[i].allowed_index.to(logits.device, non_blocking=True)] = 0.0
        logits[i] += keep


def _ban(logits: torch.Tensor, pairs: Sequence[tuple[int, int]], what: str) -> None:
    """Give each ``(row, id)`` of ``pairs`` logit ``-inf`` in ``logits`` (in place), except on a row the
    bans would leave with no finite logit (every id its ``allowed_token_ids`` kept is banned): that
    row keeps its logits, so there is always a token to sample.

    Raises:
        ValueError: an id is outside ``[0, vocab)`` (the message calls it a ``what`` id).
    """
    vocab = logits.shape[1]
    if not all(0 <= t < vocab for _, t in pairs):
        raise ValueError(f"a {what} id is outside [0, {vocab})")
    rows, ids = (torch.tensor(x, device=logits.device) for x in zip(*pairs))
    kept = logits[rows, ids].clone()
    logits[rows, ids] = float("-inf")
    touched = rows.unique()
    dead = touched[~(logits[touched] > float("-inf")).any(dim=-1)]
    if len(dead):  # nothing left to sample: that row's bans are dropped
        back = torch.isin(rows, dead)
        logits[rows[back], ids[back]] = kept[back]


def ban_early_stops(
    logits: torch.Tensor,
    options: Sequence[SamplingOptions],
    histories: Sequence[History] | None,
    stop_ids: Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    """vLLM's ``min_tokens`` (HF's ``MinNewTokensLengthLogitsProcessor``): on a row whose request
    has generated fewer than ``min_tokens`` tokens, the ids that would end it (EOS unless
    ``ignore_eos``, its stop token ids: ``stop_ids``) get logit ``-inf``; except on a row whose
    ``allowed_token_ids`` are all such ids (the ban would leave nothing to sample: the request
    may only end; :func:`_ban`).

    Args:
        logits: ``[num_seqs, vocab]`` float32; modified in place where a row bans ids.
        options: ``num_seqs`` per-row settings.
        histories: ``num_seqs`` ``(prompt_token_ids, output_token_ids)`` pairs (output excludes the
            token being sampled), read for rows with ``min_tokens`` > 0.
        stop_ids: ``num_seqs`` id lists; ``None`` when no row has ``min_tokens`` > 0.

    Returns:
        ``logits``.

    Raises:
        ValueError: a row has ``min_tokens`` > 0 but ``histories`` or ``stop_ids`` is missing or
            of the wrong length, or a stop id is outside ``[0, vocab)``.
    """
    num_seqs = logits.shape[0]
    rows = [i for i, o in enumerate(options) if o.min_tokens > 0]
    if not rows:
        return logits
    if histories is None or stop_ids is None or len(histories) != num_seqs or len(stop_ids) != num_seqs:
        raise ValueError(f"rows with min_tokens need {num_seqs} histories and stop id lists")
    pairs = [(i, t) for i in rows if len(histories[i][1]) < options[i].min_tokens for t in stop_ids[i]]
    if pairs:
        _ban(logits, pairs, "stop")
    return logits


def ban_ids(logits: torch.Tensor, raw: torch.Tensor, banned: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """Give each row's ``banned`` ids ``-inf`` (vLLM's ``bad_words``, :mod:`engine.bad_words`), except on a
    row the bans would leave with no token (its ``allowed_token_ids`` all banned): it keeps its logits.

    Args:
        logits: ``[num_seqs, vocab]`` float32; modified in place unless it is ``raw``.
        raw: the model's logits; never modified (a copy is made when ``logits`` is ``raw``).
        banned: ``num_seqs`` id lists, or None: none.

    Returns:
        ``logits`` (or the banned copy of ``raw``).

    Raises:
        ValueError: an id is outside ``[0, vocab)``.
    """
    pairs = [(i, t) for i, ids in enumerate(banned or ()) for t in ids]
    if not pairs:
        return logits
    out = raw.clone() if logits is raw else logits
    _ban(out, pairs, "banned")
    return out

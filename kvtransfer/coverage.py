"""Receiver-side bookkeeping of which token ranges of which layers a transfer has delivered."""

from __future__ import annotations

import bisect


class TokenCoverage:
    """Token ranges ``[start, end)`` received per layer, each at most once.

    A destination block may be split across two chunks (sender blocks smaller
    than the receiver's), so coverage is tracked in tokens of the transfer, not
    in destination block ids.
    """

    def __init__(self) -> None:
        self._ranges: dict[int, list[tuple[int, int]]] = {}

    def overlap(self, layer_start: int, layer_end: int, token_start: int, token_end: int) -> int | None:
        """First layer of ``[layer_start, layer_end)`` that already holds a token of the range, else ``None``."""
        for layer in range(layer_start, layer_end):
            spans = self._ranges.get(layer, [])
            i = bisect.bisect_left(spans, (token_start, token_end))
            if i > 0 and spans[i - 1][1] > token_start:
                return layer
            if i < len(spans) and spans[i][0] < token_end:
                return layer
        return None

    def add(self, layer_start: int, layer_end: int, token_start: int, token_end: int) -> None:
        """Record the range for every layer (call after :meth:`overlap` returned ``None``)."""
        for layer in range(layer_start, layer_end):
            bisect.insort(self._ranges.setdefault(layer, []), (token_start, token_end))

    def missing(self, num_layers: int) -> str | None:
        """Why the coverage is not "every layer ``[0, num_layers)`` holds the same ``[0, T)``", or ``None``.

        Returns:
            ``None`` when complete, else a human-readable reason.
        """
        if set(self._ranges) != set(range(num_layers)):
            return f"layers received {sorted(self._ranges)} are not [0, {num_layers})"
        total: int | None = None
        for layer in range(num_layers):
            end = 0
            for start, stop in self._ranges[layer]:
                if start != end:
                    return f"layer {layer} misses tokens [{end}, {start})"
                end = stop
            if total is None:
                total = end
            elif end != total:
                return f"layer {layer} covers [0, {end}), layer 0 covers [0, {total})"
        return None

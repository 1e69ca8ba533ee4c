"""The valid values of a numeric sampling parameter (:class:`Range`), as
:mod:`common.sampling_params` declares them and describes them in messages."""

from __future__ import annotations

import math
from dataclasses import dataclass


def format_number(x: float) -> str:
    """``x`` as a range or default reads in a message: ``1``, ``0.5``, ``1e-06``."""
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """Valid numbers: ``low``/``high`` bounds (``None``: unbounded), inclusive
    unless ``*_open``; with ``finite`` a float must be finite (NaN and infinities
    are refused, NaN also by every bound)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = True

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and (math.isnan(value) or (self.finite and math.isinf(value))):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, floating: bool) -> str:
        """``"in (0, 1]"``, ``">= 0"``, ``"> 0 and finite"`` (the last for a float
        with an unbounded side)."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{format_number(self.low)}, {format_number(self.high)}{right}"
        if self.low is not None:
            text = f"{'>' if self.low_open else '>='} {format_number(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {format_number(self.high)}"
        else:
            text = "any number"
        return f"{text} and finite" if floating and self.finite else text

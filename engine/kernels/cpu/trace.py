"""Make the C++ CPU kernels visible in ``torch.profiler`` traces.

A pybind11 call is not a torch operator, so a profile would count a kernel's time as Python
outside operators. :func:`traced` wraps a kernel function so that, while a profiler runs, each
call is a ``record_function`` range named after the kernel (``pdcluster::panel_gemm``...); when
none runs the cost is one check of torch's own fast flag for this
(``torch.autograd.profiler._is_profiler_enabled``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import profiler as _autograd_profiler


def traced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, recorded as ``name`` in ``torch.profiler`` traces while a profiler runs."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if _autograd_profiler._is_profiler_enabled:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call

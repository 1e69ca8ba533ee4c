"""Every compute kernel of ``engine/kernels/cpu/csrc`` releases the GIL while it runs.

A worker's scheduler thread spends most of a decode step inside these kernels; its gRPC stream
threads (one per request, waking once per token) must be able to run then. A kernel that held the
GIL made each of them wait for the interpreter's switch interval and then preempt the step
(measured in a 1P+1D cluster: the decode step ~20% slower than the engine alone).

How it is checked: with the switch interval at 10 s, a thread holding the GIL is never forced to
hand it over within the test, so a second thread (time-stamping and yielding with ``time.sleep(0)``)
stamps a time inside a kernel call's window (taken just before the call, checked just after it)
only if that kernel released the GIL. Calls repeat for up to 2 s until one window has a stamp.

Skipped, with the reason, where the extensions cannot be built (no compiler).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from engine.kernels.cpu import panel_gemm, quant_ops
from engine.kernels.cpu.build import load


def _calls() -> dict[str, tuple[str, Callable[[object], object]]]:
    """Kernel name -> (extension, one call of it on SmolLM2-sized inputs: a millisecond or so, long
    enough for a waiting thread to wake). The inputs are built here: torch's own operators release
    the GIL, so a call runs nothing but the kernel."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=g), torch.randn(1536, 576, generator=g)
    panels = panel_gemm.pack(w)
    gate_up, residual = torch.randn(256, 3072, generator=g), torch.zeros(256, 3072)
    q4 = quant_ops.pack_q4_1(torch.randint(0, 256, (1536, 18, 16), generator=g, dtype=torch.uint8),
                             torch.rand(1536, 18, generator=g), torch.rand(1536, 18, generator=g))
    i8 = quant_ops.pack_int8(torch.randint(-127, 128, (1536, 576), generator=g, dtype=torch.int8),
                             torch.rand(1536, 1, generator=g))
    q, k, v = (torch.randn(1024, h, 64, generator=g) for h in (9, 3, 3))
    cache = torch.randn(3, 2, 64, 16, 3, 64, generator=g)  # [layers, K/V, blocks, block_size, kv heads, head_dim]
    tables, lens = torch.arange(64, dtype=torch.int32).repeat(4, 1), torch.full((4,), 1024, dtype=torch.int32)
    angle = torch.randn(1024, 1, 64, generator=g)
    cos, sin, slots = angle.cos(), angle.sin(), torch.arange(1024)
    logits = torch.randn(128, 49152, generator=g)
    return {
        "linear_f32": ("gemv", lambda e: e.linear_f32(x, w, None)),
        "linear": ("panel_gemm", lambda e: e.linear(x, panels, 1536, None)),
        "linear_w8a8": ("w8a8_gemm", lambda e: e.linear_w8a8(x, *i8, 1536, None)),
        "linear_w4a8": ("w4a8_gemm", lambda e: e.linear_w4a8(x, *q4, 1536, None)),
        "rms_norm": ("rms_norm", lambda e: e.rms_norm(gate_up, gate_up[0], 1e-5)),
        "add_rms_norm_": ("rms_norm", lambda e: e.add_rms_norm_(gate_up, residual, gate_up[0], 1e-5)),
        "silu_and_mul": ("activation", lambda e: e.silu_and_mul(gate_up)),
        "decode": ("paged_attention", lambda e: e.decode(q[:4], cache[0, 0], cache[0, 1], tables, lens, 0.125, 0)),
        "rope_store": ("rope_cache", lambda e: e.rope_store(q, k, v, cos, sin, cache, 1, slots)),
        "DecodeStep.run": ("decode_step", _decode_step_call(g)),
        "argmax_rows": ("argmax", lambda e: e.argmax_rows(logits)),
    }


def _decode_step_call(g: torch.Generator) -> Callable[[object], object] | None:
    """Two SmolLM2-shaped layers (float32 panels) over 4 sequences of 16 tokens, as the C++ decode step runs
    them (engine.kernels.cpu.decode_step)."""
    from engine.kernels.cpu.decode_step import ProjSpec, new_step

    step = new_step()
    if step is None:  # the extension or a kernel it calls is not built: the test skips
        return None

    def proj(n: int, k: int) -> ProjSpec:
        return ProjSpec("f32_panels", (panel_gemm.pack(torch.randn(n, k, generator=g) * 0.05),), n, None)

    norm, cache = (torch.ones(576), 1e-5, 0.0), torch.zeros(2, 2, 4, 16, 3, 64)
    for i in range(2):
        step.add_layer(norm, norm, [], [], [proj(960, 576), proj(576, 576), proj(3072, 576), proj(576, 1536)],
                       [576, 192, 192, 9, 3, 64, 0, 0], 0.125, "silu", cache[i, 0], cache[i, 1])
    x, angle = torch.randn(4, 576, generator=g), torch.randn(4, 1, 64, generator=g)
    tables, lens = torch.arange(4, dtype=torch.int32)[:, None], torch.full((4,), 16, dtype=torch.int32)
    ropes, slots = [(angle.cos(), angle.sin())], torch.arange(4) * 16 + 15
    return lambda e: step.run(x, ropes, cache, slots, tables, lens)


CALLS = _calls()


@pytest.fixture
def long_switch_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_kernel_lets_other_threads_run(kernel, long_switch_interval):
    ext_name, call = CALLS[kernel]
    ext = load(ext_name)
    if ext is None or call is None:
        pytest.skip(f"the {ext_name} extension (or one it calls) could not be built here (see log)")
    out = call(ext)  # first call outside the measured loop (lazy initialisation)
    stamps: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def other() -> None:
        started.set()
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0)  # hands the GIL back at once

    t = threading.Thread(target=other, daemon=True)
    t.start()
    started.wait(5)
    ran, calls, deadline = False, 0, time.monotonic() + 2.0
    while not ran and time.monotonic() < deadline:
        del out  # freeing a tensor may release the GIL: not inside the window below
        t0 = time.monotonic()
        out = call(ext)  # the only thing between t0 and the check: the kernel
        ran, calls = bool(stamps) and stamps[-1] > t0, calls + 1
    stop.set()
    t.join(15)
    assert ran, f"{ext_name}.{kernel} held the GIL through each of {calls} calls (2 s): no other thread ran"

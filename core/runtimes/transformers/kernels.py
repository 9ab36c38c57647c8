"""Which attention kernel really ran: read off the operators PyTorch dispatched during one forward pass.

Asking transformers for ``sdpa`` does not say which kernel runs: PyTorch's scaled_dot_product_attention
picks a backend per call (flash, memory-efficient, cuDNN, the CPU flash kernel, or the plain math
fallback when a mask or dtype rules the others out). The profiler records the aten operator each
backend is (``aten::_scaled_dot_product_flash_attention`` and so on), so ``measure_kernel`` runs a
forward pass under it and names what it saw. It costs one profiled forward pass (about 15 ms for the
embedded model on the CPU); the engine spends it on a throwaway pass after the prefill and after
each switch, never on a timed token.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable

#: One profiler session at a time in this process. Two at once (a re-run's pass measured on its own thread while
#: the token thread measured a decode step or a kernel) crashed the engine: kineto printed "External init
#: callback must run in same thread as registerClient", then SIGSEGV (benchmarks/stage_keys.py, key 5 after 4).
#: The token thread never waits for it: what it would measure is measured at a later token instead.
PROFILER = threading.Lock()

#: aten operator -> kernel name, most specific first.
SDPA_BACKENDS: tuple[tuple[str, str], ...] = (
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "sdpa-flash-cpu"),
    ("aten::_scaled_dot_product_flash_attention", "sdpa-flash"),
    ("aten::_scaled_dot_product_efficient_attention", "sdpa-mem-efficient"),
    ("aten::_scaled_dot_product_cudnn_attention", "sdpa-cudnn"),
    ("aten::_scaled_dot_product_fused_attention_overrideable", "sdpa-fused"),
    ("aten::_scaled_dot_product_attention_math", "sdpa-math"),
)


def kernel_from_ops(names: set[str]) -> str:
    """Name the attention kernel from the operator names of one forward pass."""
    for op, kernel in SDPA_BACKENDS:
        if op in names:
            return kernel
    if any("flash_attn" in n for n in names):
        return "flash_attention_2"
    if "aten::scaled_dot_product_attention" in names:
        return "sdpa-math"  # the composite op decomposed into matmuls (no fused backend ran)
    if any(n in names for n in ("aten::softmax", "aten::_softmax")):
        return "eager"
    return "unknown"


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints two lines to file descriptor 2 at start and stop; hide them."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def measure_kernel(forward: Callable[[], object]) -> str | None:
    """Run ``forward()`` under the profiler and return the attention kernel it dispatched (None when the
    profiler cannot run here, or runs on another thread now: ``PROFILER``; ``forward`` runs all the same, and its
    own errors propagate)."""
    if not PROFILER.acquire(blocking=False):  # a re-run's pass is measured meanwhile: not now
        forward()
        return None
    try:
        try:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU])
            with _quiet_stderr():
                prof.__enter__()
        except Exception:  # noqa: BLE001 - no profiler (a stripped build): the kernel stays unmeasured
            forward()
            return None
        try:
            forward()
        finally:
            with _quiet_stderr():
                prof.__exit__(None, None, None)
        return kernel_from_ops({e.name for e in prof.events()})
    finally:
        PROFILER.release()


_profiler_started = False


def start_profiler_threads() -> None:
    """Profile one trivial operation now, on the calling thread, once per process.

    The profiler starts helper threads the first time it runs, and a new thread takes its creator's
    name: first run on a worker thread (the window's generation thread in thread mode), they would
    be named after that thread and outlive it. The window calls this on its own thread at start-up.
    """
    global _profiler_started
    if _profiler_started:
        return
    _profiler_started = True
    import torch

    measure_kernel(lambda: torch.ones(2) + 1)

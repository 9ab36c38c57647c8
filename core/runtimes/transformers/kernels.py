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
import re
import sys
import tempfile
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


#: What the profiler's C++ side writes to file descriptor 2 by itself, around and during a session: kineto's log
#: lines (``USDT:2026-12-03 17:22:14 9035:9035 SyncActivityProfilerHandler.cpp:52] profiler_start``, STAGE,
#: WARNING...), its one ``fprintf`` (the first session on a thread other than the one that imported torch), and
#: c10's line when a block allocated before the session is freed in it (``[W1203 17:22:15.272649651
#: CPUAllocator.cpp:245] Memory block of unknown size was allocated before the profiling started, ...``).
_PROFILER_LINE = re.compile(
    rb"(?:VERBOSE|INFO|WARNING|STAGE|ERROR|USDT):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ [\w.]+:\d+\] "
    rb"|ERROR: External init callback must run in same thread as registerClient"
    rb"|\[[WIEF]\d{4} [\d:.]+ (?:\d+ )?[\w.]+:\d+\] .*profil")


@contextlib.contextmanager
def quiet_profiler():
    """Around one profiler session (start, the profiled call, stop): what reaches file descriptor 2 meanwhile is
    spooled, and on the way out written back to it less the profiler's own lines (``_PROFILER_LINE``).

    libkineto and c10 write to fd 2 from C++ (std::cerr, fprintf), past sys.stderr, so only the descriptor can be
    caught; kineto's level (KINETO_LOG_LEVEL) gates its log lines but not its fprintf nor c10's warning. Every
    other line written meanwhile, ours or a library's, comes out after the session, in order."""
    try:
        sys.stderr.flush()  # what was written before the session goes out before it
    except (AttributeError, ValueError, OSError):
        pass
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (closed): nothing to keep clean
        yield
        return
    try:
        spool = tempfile.TemporaryFile()
    except OSError:  # nowhere to spool: the session runs as it would without
        os.close(saved)
        yield
        return
    try:
        os.dup2(spool.fileno(), 2)
        yield
    finally:  # also when the call raised: what it wrote before is not lost
        try:
            sys.stderr.flush()  # Python's lines written meanwhile join the spool, in order
        except (AttributeError, ValueError, OSError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        spool.seek(0)
        kept = b"".join(line for line in spool.read().splitlines(keepends=True) if not _PROFILER_LINE.match(line))
        spool.close()
        try:
            while kept:
                kept = kept[os.write(2, kept):]
        except OSError:  # stderr gone (a closed pipe): the lines had nowhere to go in any case
            pass


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
        except Exception:  # noqa: BLE001 - no profiler (a stripped build): the kernel stays unmeasured
            forward()
            return None
        with quiet_profiler():
            try:
                prof.__enter__()
            except Exception:  # noqa: BLE001 - the profiler cannot start here: the kernel stays unmeasured
                prof = None
            try:
                forward()
            finally:
                if prof is not None:
                    prof.__exit__(None, None, None)
        # The raw kineto events' names, not prof.events(): that builds a FunctionEvent tree in Python, 1.3-2.9 s for
        # SmolLM2-135M's one decode step on two busy cores (the trial pass of a switch on the token path, issue 37);
        # the names are the same set, read in 0.05 s.
        return kernel_from_ops({e.name() for e in prof.profiler.kineto_results.events()}) if prof is not None else None
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

"""What a switch needs before it can apply, prepared off the token path (issue 25, item 1).

The first quantized cache in a fresh install makes optimum-quanto build its C++ extension (minutes
on a laptop's CPU) inside the first quantization. Done between two tokens, the run froze that long.
Here a background thread of the engine's process builds and loads the backend (by quantizing one
small tensor, as ``kvscope.core.runtimes.transformers.switch.backend_problem`` does); the run goes on under the current settings
meanwhile, the driver says what is being prepared and for how long, and the switch applies at the
first token after the backend is ready. Afterwards the backend is loaded in this process: the
engine's own check at the switch takes milliseconds.

Torch is imported only on the preparation thread, in the engine's process (the window's process,
thread mode aside, never runs this).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.caches import Quantized
from kvscope.core.runtimes.transformers.switches import parse_switch_value

#: What each backend builds or loads the first time, for the progress line.
WHAT = {"quanto": "optimum-quanto's kernels (built once, minutes the first time)", "hqq": "the hqq backend"}


@dataclass
class _Job:
    started: float
    thread: threading.Thread
    problem: str | None = None  # why the backend cannot run here (the engine refuses the switch with it)
    done: threading.Event = field(default_factory=threading.Event)


_jobs: dict[str, _Job] = {}
_lock = threading.Lock()


def backend_needed(key: str, value: str) -> str | None:
    """The quantized-cache backend (``quanto`` / ``hqq``) switch ``key=value`` needs, or None."""
    try:
        name, parsed = parse_switch_value(key, value)
    except (SettingsError, ValueError):
        return None  # the engine refuses it with the reason
    if name == "cache" and isinstance(parsed, Quantized) and parsed.backend in WHAT:
        return parsed.backend
    return None


def warm_backend(backend: str, nbits: int = 4) -> str | None:
    """Build and load ``backend`` in this process the way a cache uses it: a quantized layer's first update
    quantizes, the next one dequantizes what it holds (optimum-quanto's C++ unpack kernel, which it compiles
    on first use; quantizing alone does not build it: 0.07 s, then minutes inside the switch's trial pass).
    Returns why it cannot run here, or None. Imports torch (the engine process only)."""
    import torch
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    from kvscope.core.runtimes.transformers.switch import (
        backend_problem)  # torch: the engine process only (the window imports this module)

    problem = backend_problem(backend)
    if problem:
        return problem
    try:
        layer = (QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer)(nbits=nbits, residual_length=1)
        probe = torch.zeros(1, 1, 4, 64)
        layer.update(probe, probe)  # quantizes
        layer.update(probe[:, :, :1], probe[:, :, :1])  # dequantizes: builds and loads the unpack kernel
        layer.update(probe[:, :, :1], probe[:, :, :1])
    except Exception as exc:  # noqa: BLE001 - extension build errors come as RuntimeError, OSError...
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return None


def _warm(backend: str, nbits: int, job: _Job) -> None:
    try:
        job.problem = warm_backend(backend, nbits)
    except Exception as exc:  # noqa: BLE001 - a preparation that fails is the switch's refusal, never a dead run
        job.problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        job.done.set()


def prepare(backend: str, nbits: int = 4, clock=time.monotonic) -> _Job:
    """Start preparing ``backend`` on a background thread (once per process); returns its job."""
    with _lock:
        job = _jobs.get(backend)
        if job is None:
            job = _Job(started=clock(), thread=threading.Thread(name=f"kvscope-prepare-{backend}", daemon=True,
                                                                target=lambda: _warm(backend, nbits, job)))
            _jobs[backend] = job
            job.thread.start()
        return job


def is_ready(backend: str) -> bool:
    """Whether ``backend`` has been prepared (well or not: a problem is the engine's to report)."""
    job = _jobs.get(backend)
    return job is not None and job.done.is_set()


def progress_text(backend: str, clock=time.monotonic) -> str:
    """The status line while ``backend`` is being prepared: what, and for how long so far."""
    job = _jobs.get(backend)
    elapsed = 0.0 if job is None else clock() - job.started
    return f"preparing quantized cache: {WHAT[backend]}\u2026 {elapsed:.0f} s; the run goes on meanwhile"

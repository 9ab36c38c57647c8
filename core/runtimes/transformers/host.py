"""What the engine host (``kvscope.core.live.engine_process``) asks of the transformers runtime, through the registry:
its start in the engine's process, what ``--device auto`` means there, and the switches that wait for a backend."""

from __future__ import annotations


def host_start() -> None:
    """Once, on the engine process's main thread before any run: torch's CPU threads leave one core to the window,
    and the slow imports (torch, transformers) happen now, while the window starts."""
    from kvscope.core.model.hf import ensure_transformers
    from kvscope.core.runtimes.transformers.runtime import limit_cpu_threads

    limit_cpu_threads("cpu")
    ensure_transformers()


def auto_device() -> str:
    """The device a run with ``--device auto`` gets in this process (cuda, mps or cpu), found with torch."""
    from kvscope.core.runtimes.transformers.loading import resolve_device

    return resolve_device("auto")


def prepare_switch(key: str, value: str) -> str | None:
    """None when the switch ``key=value`` can apply at the next token; else the progress line of the quantized-cache
    backend it needs (``quanto`` / ``hqq``), whose preparation (``kvscope.core.runtimes.transformers.prepare``) has
    started on a thread of its own: the run goes on under the settings in force and asks again."""
    from kvscope.core.runtimes.transformers.prepare import backend_needed, is_ready, prepare, progress_text

    backend = backend_needed(key, value)
    if backend is None or is_ready(backend):
        return None
    prepare(backend)
    return progress_text(backend)

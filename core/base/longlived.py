"""Keep the collector off the objects a process keeps for its whole life."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


def freeze_long_lived() -> None:
    """Take every object alive now out of the cyclic garbage collector's walks (``gc.freeze``).

    Importing torch and transformers leaves hundreds of thousands of objects (modules, classes,
    functions) that live as long as the process. Each full collection walks all of them while
    holding the GIL, and every thread waits: 150-520 ms pauses were measured, in the generation
    thread and in the window's. Frozen, they are skipped; refcounting still frees them. Call it
    after big imports, never with a model alive (a model's cycles would then never be collected).
    """
    gc.freeze()


_pause_lock = threading.Lock()
_pauses = 0
_was_enabled = True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection while the block builds a model: the process's other threads (the window's, in
    thread mode; the memory sampler's) then cannot start a collection that walks half-built torch modules.

    A full test run crashed once in the collector on the window's thread (``Garbage-collecting`` in a paint)
    while the engine's thread was building a Llama on the meta device. Nested and concurrent pauses count:
    collection resumes when the last ends, and only if it was on before the first."""
    global _pauses, _was_enabled
    with _pause_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()

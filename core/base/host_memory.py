"""This process's host memory, as the kernel and the C allocator see it: the resident set, and what glibc's malloc
holds in use and keeps of freed memory (its retained pages), read without torch.

Why the C allocator's own figures: on the CPU, torch's tensors come from ``malloc``/``posix_memalign`` (c10's
``alloc_cpu``). A block above glibc's mmap threshold (128 KiB, raised dynamically up to 32 MiB as large blocks are
freed) is its own mapping and leaves the resident set when freed; smaller ones, and large ones once the threshold has
risen, stay in malloc's arenas after ``free``: resident pages that no live tensor holds (``malloc_retained``, glibc's
``mallinfo2().fordblks``). A switch that copies a model's layers and frees the old ones leaves such pages behind,
which the resident set keeps showing until malloc reuses or trims them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+): every field a size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _libc()


@dataclass(frozen=True)
class HostMemory:
    """Bytes: ``rss`` the resident set (None where the system does not say); ``malloc_in_use`` what glibc's malloc
    has handed out and not had back (its arenas' in-use chunks plus its mmapped blocks); ``malloc_retained`` the
    free bytes it keeps in its arenas (resident until reused or trimmed). The two malloc figures are None off glibc."""

    rss: int | None
    malloc_in_use: int | None = None
    malloc_retained: int | None = None

    def to_json(self) -> dict[str, int | None]:
        return {"rss": self.rss, "malloc_in_use": self.malloc_in_use, "malloc_retained": self.malloc_retained}


def resident_bytes() -> int | None:
    """This process's resident set in bytes (``/proc/self/statm``; psutil elsewhere), None if neither answers."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # noqa: BLE001 - any failure of an optional probe is "not available"
        return None


def process_memory() -> HostMemory:
    """The resident set and glibc malloc's in-use and retained bytes, now (well under a millisecond)."""
    rss = resident_bytes()
    if _MALLINFO2 is None:
        return HostMemory(rss)
    info = _MALLINFO2()
    return HostMemory(rss, int(info.uordblks + info.hblkhd), int(info.fordblks))


class HostFigures:
    """The run loop's side of the host figures (``Sample.runtime_baseline`` and ``Sample.host_retained``) for a runtime
    that runs in this process: the baseline is taken from the first Sample that says both this process's resident
    set and its weights (the load event): that RSS less the weights and malloc's free pages at that moment; every
    Sample then gets the baseline and malloc's free pages now. A runtime in another process (llama.cpp's child) gets
    none: this process's malloc is not its."""

    def __init__(self) -> None:
        self.baseline: int | None = None

    def attach(self, sample: Any) -> Any:
        """``sample`` with ``runtime_baseline`` and ``host_retained`` filled in (unchanged off glibc, or before
        anything says this process's resident set)."""
        if sample.process_rss is None:
            return sample
        now = process_memory()
        if now.malloc_retained is None:
            return sample
        if self.baseline is None and sample.weights_bytes is not None:
            self.baseline = max(sample.process_rss - sample.weights_bytes - now.malloc_retained, 0)
        return sample.replace(runtime_baseline=self.baseline, host_retained=now.malloc_retained)

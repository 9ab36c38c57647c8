"""The allocator's peak during one call, in bytes above what was held when the call began.

CUDA: torch's own counters (``reset_peak_memory_stats`` before, ``max_memory_allocated`` after, less the
bytes allocated at the start). The CPU allocator keeps no counter, so on the CPU the call runs under the
PyTorch profiler with ``profile_memory=True``: every allocation and free of the CPU allocator comes as a
``[memory]`` event with its signed size, and replaying them in order gives the high-water mark. Other
devices (MPS): not measured (None).

Engine side only (imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class PeakReading:
    """``peak``: the most bytes held at once during the call beyond those held before it; ``end``: the bytes
    the call left allocated (what it returned and kept, e.g. the KV it wrote and the logits)."""

    peak: int
    end: int


def measure_peak(call: Callable[[], Any], device: str) -> tuple[Any, PeakReading | None]:
    """Run ``call()`` once and return its result with the allocator's peak above the start (None on a
    device whose allocator cannot be followed)."""
    if device.startswith("cuda"):
        dev = torch.device(device)
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result = call()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        return result, PeakReading(peak=int(peak - start), end=int(torch.cuda.memory_allocated(dev) - start))
    if device != "cpu":
        return call(), None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda e: e.start_ns())  # stable: same-instant events keep the allocator's order
    now = peak = 0
    for event in events:
        now += int(event.nbytes())
        peak = max(peak, now)
    return result, PeakReading(peak=peak, end=now)

"""The memory sampler's rate: its default, its bounds and the one check of a rate asked for.

Both samplers the window uses keep to it: ``kvscope.workers.sampler.MemorySampler`` (a thread of this process) and
``kvscope.workers.engine_link.HostedSampler`` (the engine process's sampler), so either refuses the same rates the same way.
"""

from __future__ import annotations

#: Readings per second when none is asked for.
DEFAULT_RATE_HZ = 20.0
#: The highest rate a sampler takes (readings per second).
MAX_RATE_HZ = 1000.0


def check_rate(rate_hz: float) -> None:
    """Raise ValueError unless ``rate_hz`` (readings per second) is above 0 and at most ``MAX_RATE_HZ``."""
    if not (0 < rate_hz <= MAX_RATE_HZ):
        raise ValueError(f"sampling rate must be between 0 and {MAX_RATE_HZ:g} Hz, got {rate_hz!r}")

"""When the CPU measures a decode step's allocator peak: often enough to follow the run, never a hitch on stage.

On the CPU a decode step's peak is measured under the profiler (``kvscope.core.runtimes.transformers.peak``), and a
profiled step costs more than a plain one: on SmolLM2-135M on two busy cores 0.2-1.2 s against 0.1 s, a pause the
audience sees (issue 37). At a fixed every-64th token that was up to a sixth of the run's time on a slow machine and
1-2 % on a fast one. Here the cadence follows the measured cost:

* the first step after a prefill or re-run (the engine's ``_decode_peak_due``, as before);
* a step soon after each switch (``settle`` tokens on, so that the switch's own pause and the profiler's are two
  gaps between tokens, not one): the peak moves with the settings;
* besides, at most every ``every`` tokens, and only once the plain decode time since the last measurement is large
  enough that the profiler's extra time (what the last measured step cost beyond a plain one) stays under
  ``share`` of it.

Pure arithmetic on seconds the engine measures (no torch): ``tests/test_peak_cadence.py`` drives it with made-up
step times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PeakCadence:
    """The decode peak's measuring schedule for one engine. ``plain`` after every unmeasured step, ``measured``
    after a measured one, ``due`` before each step."""

    every: int = 64  # tokens, at least, between two periodic measurements
    share: float = 0.03  # the profiler's extra time, at most this share of the plain decode time between two
    settle: int = 2  # tokens after a switch before the new settings' step is measured
    plain_s: float | None = None  # a plain step's time (moving average), seconds
    extra_s: float = 0.0  # what the last measured step cost beyond a plain one, seconds
    since_tokens: int = 0  # plain steps since the last measurement
    since_s: float = 0.0  # their time, seconds
    settings: Any = None  # the settings the last measurement ran under
    after_switch: int | None = None  # plain steps since the settings were seen to change (None: no change)

    def due(self, settings: Any, forced: bool = False) -> bool:
        """Whether the next step should be measured, under ``settings`` (any value compared with ==); ``forced``:
        the engine asks for it (the first step after a prefill or re-run, or one whose measurement could not run)."""
        if forced:
            return True
        if self.settings is not None and settings != self.settings:
            if self.after_switch is None:
                self.after_switch = 0
            if self.after_switch >= self.settle:
                return True
        return self.since_tokens >= self.every and self.since_s * self.share >= self.extra_s

    def plain(self, seconds: float) -> None:
        """A step that was not measured took ``seconds``."""
        seconds = max(float(seconds), 0.0)
        self.plain_s = seconds if self.plain_s is None else 0.9 * self.plain_s + 0.1 * seconds
        self.since_tokens += 1
        self.since_s += seconds
        if self.after_switch is not None:
            self.after_switch += 1

    def measured(self, seconds: float, settings: Any) -> None:
        """A measured step took ``seconds`` (the profiler, the copy of the cache and the replay included)."""
        self.extra_s = max(float(seconds) - (self.plain_s or 0.0), 0.0)
        self.since_tokens = 0
        self.since_s = 0.0
        self.settings = settings
        self.after_switch = None

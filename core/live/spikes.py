"""Spikes: sudden rises in a memory series, and their likely cause from what the app knew then.

A memory series (device used, process GPU memory, allocator reserved, RSS) is a list of
``(time_s, bytes)`` points. A *spike* is a rise of more than a threshold — an absolute number of
bytes and a fraction of the level before it, both — within a short window, over and above the
series' own recent trend. Subtracting the trend is what keeps a steady KV-cache ramp, however
steep, from being reported again and again: only a departure from it is a spike.

The trend is the median of the per-interval slopes over the last ``baseline_s + window_s``
seconds, so a step (a few intervals) does not count as trend while a steady ramp (every interval)
does. A rise that keeps climbing is reported once, when it
stops climbing (or after ``window_s``), with its full size.

``attribute_cause`` then names the likely cause from the app's own events near that instant:
model load, static-cache preallocation, a mode switch, prefill, dynamic-cache growth, or another
process when the device rose and this process did not.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvscope.core.base.sample import PHASE_DECODE, PHASE_PREFILL, Sample
from kvscope.core.runtimes.probes import MemoryReading

# Event kinds the generation loop and the window report (``Event.kind``).
EVENT_LOAD = "load"  # model weights being loaded / moved to the device
EVENT_STATIC_PREALLOC = "static_prealloc"  # a static cache reserving max context up front
EVENT_SWITCH = "switch"  # attention mode / attn impl / cache strategy changed
EVENT_PREFILL = "prefill"  # the prompt's forward pass
EVENT_DECODE = "decode"  # a decode step; detail names the cache strategy (e.g. "dynamic")
EVENT_OOM = "oom"  # an out-of-memory error was caught

CAUSE_LOAD = "model load: weights being allocated"
CAUSE_STATIC = "static cache preallocation: the whole max context is reserved up front"
CAUSE_SWITCH = "mode switch: {detail} (old and new weights or cache coexist while converting)"
CAUSE_PREFILL = "prefill activations: attention scores for the whole prompt at once ({detail})"
CAUSE_DYNAMIC = ("dynamic-cache growth: the dynamic cache concatenates per layer per step, "
                 "so old and new buffers coexist")
CAUSE_OTHER_PROCESS = "another process: the device rose but this process did not"
CAUSE_UNKNOWN = "unknown: no app event near this time"

#: Fewer intervals than this and a single step would be the median: assume no trend yet.
_MIN_TREND_INTERVALS = 8

#: Which event explains a spike when several are near it: the bigger allocator wins.
_PRIORITY = (EVENT_LOAD, EVENT_STATIC_PREALLOC, EVENT_SWITCH, EVENT_PREFILL, EVENT_DECODE)


@dataclass(frozen=True)
class Event:
    """Something the app did at ``time_s`` (monotonic seconds, the probes' clock)."""

    time_s: float
    kind: str
    detail: str = ""


@dataclass(frozen=True)
class Spike:
    """A rise of ``rise_bytes`` in ``series``, from ``before`` (at ``start_s``) to ``after`` (at ``time_s``)."""

    time_s: float
    series: str
    rise_bytes: int
    before: int
    after: int
    cause: str = ""
    start_s: float | None = None

    def with_cause(self, cause: str) -> "Spike":
        return dataclasses.replace(self, cause=cause)


class SpikeDetector:
    """Incremental spike detection over one named series; feed points in time order.

    ``min_rise_bytes`` and ``min_rise_fraction`` (of the level before the rise) must both be
    exceeded by the rise, less the trend, within ``window_s`` seconds. The trend is measured over
    the last ``baseline_s + window_s`` seconds.
    """

    def __init__(self, series: str, min_rise_bytes: int, window_s: float = 0.5,
                 min_rise_fraction: float = 0.0, baseline_s: float = 2.0) -> None:
        if min_rise_bytes <= 0:
            raise ValueError(f"min_rise_bytes must be positive, got {min_rise_bytes}")
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        if not 0 <= min_rise_fraction:
            raise ValueError(f"min_rise_fraction must not be negative, got {min_rise_fraction}")
        if baseline_s < 0:
            raise ValueError(f"baseline_s must not be negative, got {baseline_s}")
        self.series = series
        self.min_rise_bytes = int(min_rise_bytes)
        self.min_rise_fraction = float(min_rise_fraction)
        self.window_s = float(window_s)
        self.baseline_s = float(baseline_s)
        self._points: deque[tuple[float, int]] = deque()
        # Every point costs the same whatever the density of the series (issue 38: a replay of 60k samples 0.1 ms
        # apart took 345 s, each point scanning the 25k points of its window and sorting their slopes): the
        # window's minimum from a monotonic deque, the trend's median from a sorted list kept as points come and go.
        self._seq_front = 0  # the number of the point at self._points[0] (points are numbered as they come)
        self._minima: deque[tuple[int, float, int]] = deque()  # (number, time, value), values rising, the latest of equals
        self._slopes: deque[float] = deque()  # the slope of each interval of self._points, in order
        self._sorted_slopes: list[float] = []
        self._floor_s = float("-inf")  # points before this belong to an already-reported spike
        self._pending: Spike | None = None  # a rise past the threshold that is still climbing
        self._pending_since = 0.0

    def feed(self, time_s: float, value: int | None) -> Spike | None:
        """Add one point; return a Spike when one has just ended. ``None`` values are skipped."""
        if value is None:
            return None
        if self._points and time_s <= self._points[-1][0]:
            raise ValueError(f"times must increase: {time_s} after {self._points[-1][0]} in series {self.series!r}")
        value = int(value)
        prev = self._points[-1][1] if self._points else None
        if self._points:
            t0, v0 = self._points[-1]
            slope = (value - v0) / (time_s - t0)
            self._slopes.append(slope)
            bisect.insort(self._sorted_slopes, slope)
        number = self._seq_front + len(self._points)
        self._points.append((time_s, value))
        while self._minima and self._minima[-1][2] >= value:
            self._minima.pop()
        self._minima.append((number, time_s, value))
        horizon = time_s - self.window_s - self.baseline_s
        while self._points and self._points[0][0] < horizon:
            self._points.popleft()
            self._seq_front += 1
            if self._slopes:  # the interval that began at the point that left
                gone = self._slopes.popleft()
                del self._sorted_slopes[bisect.bisect_left(self._sorted_slopes, gone)]

        done: Spike | None = None
        if self._pending is not None:
            trend = self._trend()
            step = value - prev if prev is not None else 0
            dt = time_s - self._points[-2][0] if len(self._points) > 1 else 0.0
            # Still climbing: each further sample adds a meaningful amount beyond the trend.
            climbing = step - trend * dt >= self._sharp_step(self._pending.rise_bytes)
            if climbing and time_s - self._pending_since <= self.window_s:
                self._pending = dataclasses.replace(self._pending, time_s=time_s, after=value,
                                                    rise_bytes=value - self._pending.before)
                return None
            ended, self._pending = self._pending, None
            # The rise is over: the window's minimum must not reach back before its peak.
            self._floor_s = ended.time_s
            # Confirm against the trend as it stands now: a ramp that began steeply is a ramp
            # once enough of it has been seen, not a spike.
            if self._passes(ended.rise_bytes - trend * _duration(ended),
                            ended.before):
                done = ended

        candidate = self._check(time_s, value)
        if candidate is not None:
            self._pending, self._pending_since = candidate, time_s
        return done

    def flush(self) -> Spike | None:
        """End of data: return a spike still climbing at the last point, if any."""
        ended, self._pending = self._pending, None
        if ended is None:
            return None
        self._floor_s = ended.time_s
        trend = self._trend()
        if self._passes(ended.rise_bytes - trend * _duration(ended), ended.before):
            return ended
        return None

    def _sharp_step(self, rise: int) -> float:
        """A one-interval increase big enough to be part of a spike of size ``rise``, not noise or a token step."""
        return max(self.min_rise_bytes / 8, 0.1 * rise)

    def _passes(self, excess: float, before: int) -> bool:
        return excess >= self.min_rise_bytes and excess >= self.min_rise_fraction * max(before, 0)

    def _check(self, time_s: float, value: int) -> Spike | None:
        window_start = max(time_s - self.window_s, self._floor_s)
        while self._minima[0][1] < window_start:  # the window's start only moves forward; the newest point stays
            self._minima.popleft()
        number_min, t_min, v_min = self._minima[0]  # the lowest value in the window, the latest of equals
        rise = value - v_min
        if rise <= 0:
            return None
        trend = self._trend()
        if not self._passes(rise - trend * (time_s - t_min), v_min):
            return None
        # The rise began where the first sharp step after the minimum is: on a gentle ramp or a
        # token staircase the minimum itself may lie well before the jump.
        t_start, v_start = t_min, v_min
        sharp = self._sharp_step(rise)
        after_min = itertools.islice(self._points, number_min - self._seq_front, None)
        for (t0, v0), (t1, v1) in itertools.pairwise(after_min):
            if (v1 - v0) - trend * (t1 - t0) >= sharp:
                t_start, v_start = t0, v0
                break
        return Spike(time_s=time_s, series=self.series, rise_bytes=value - v_start, before=v_start,
                     after=value, start_s=t_start)

    def _trend(self) -> float:
        """Bytes per second the series is rising at, robustly (>= 0).

        The median of the per-interval slopes over everything buffered (baseline and window): a
        steady ramp sets every slope, while a step moves only the few intervals it spans.
        """
        if len(self._points) <= _MIN_TREND_INTERVALS:
            return 0.0
        slopes, n = self._sorted_slopes, len(self._sorted_slopes)
        median = slopes[n // 2] if n % 2 else (slopes[n // 2 - 1] + slopes[n // 2]) / 2  # as statistics.median
        return max(median, 0.0)


def _duration(spike: Spike) -> float:
    return spike.time_s - (spike.start_s if spike.start_s is not None else spike.time_s)


def detect_spikes(times: Sequence[float], values: Sequence[int | None], min_rise_bytes: int,
                  window_s: float = 0.5, *, series: str = "memory", min_rise_fraction: float = 0.0,
                  baseline_s: float = 2.0) -> list[Spike]:
    """All spikes in a whole series (times in seconds, increasing; values in bytes, None skipped)."""
    if len(times) != len(values):
        raise ValueError(f"times and values differ in length ({len(times)} vs {len(values)})")
    detector = SpikeDetector(series, min_rise_bytes, window_s, min_rise_fraction, baseline_s)
    spikes = [s for t, v in zip(times, values) if (s := detector.feed(t, v)) is not None]
    last = detector.flush()
    if last is not None:
        spikes.append(last)
    return spikes


def rise_between(times: Sequence[float], values: Sequence[int | None], start_s: float, end_s: float) -> int | None:
    """How much a series rose from its lowest point in [start_s, end_s] to its value at end_s.

    Used to tell whether this process rose along with the device. None when no points fall there.
    """
    points = [(t, v) for t, v in zip(times, values) if v is not None and start_s <= t <= end_s]
    if not points:
        return None
    return int(points[-1][1] - min(v for _, v in points))


def attribute_cause(spike: Spike, context: Iterable[Event], *, process_rise: int | None = None,
                    lookback_s: float = 1.0, device_series: Sequence[str] = ("device", "device_used")) -> str:
    """The likely cause of ``spike``, as one line for the events table.

    ``context`` is what the app did around then; events from ``lookback_s`` before the rise began
    up to its end count. ``process_rise`` is how much this process's own memory rose over the
    same interval (see ``rise_between``); when a device-wide spike was not matched by it, the
    memory went to another process whatever this app was doing.
    """
    if spike.series in device_series and process_rise is not None and process_rise < spike.rise_bytes / 2:
        return CAUSE_OTHER_PROCESS
    start = (spike.start_s if spike.start_s is not None else spike.time_s) - lookback_s
    near = [e for e in context if start <= e.time_s <= spike.time_s]
    by_kind: dict[str, Event] = {}
    for event in near:  # the latest event of each kind is the one the spike follows
        if event.kind not in by_kind or event.time_s >= by_kind[event.kind].time_s:
            by_kind[event.kind] = event
    for kind in _PRIORITY:
        event = by_kind.get(kind)
        if event is None:
            continue
        if kind == EVENT_LOAD:
            return CAUSE_LOAD
        if kind == EVENT_STATIC_PREALLOC:
            return CAUSE_STATIC
        if kind == EVENT_SWITCH:
            if "static" in event.detail:  # switching to a static cache is a preallocation
                return CAUSE_STATIC
            return CAUSE_SWITCH.format(detail=event.detail or "settings changed")
        if kind == EVENT_PREFILL:
            return CAUSE_PREFILL.format(detail=event.detail or "eager scores are prompt x prompt per head")
        if kind == EVENT_DECODE and ("dynamic" in event.detail or not event.detail):
            return CAUSE_DYNAMIC
    return CAUSE_UNKNOWN


#: Where "this process's memory" comes from, best first: NVML's figure for this PID, else what the
#: torch allocator holds (N/A per-process on WSL), else host RSS (CPU runs).
PROCESS_SOURCES = ("process_gpu", "allocator_reserved", "process_rss")


class SpikeMonitor:
    """Spikes with causes from a stream of ``MemoryReading``s plus the app's events.

    Watches two series: ``device`` (NVML device used) and ``process`` (this process: the first of
    ``PROCESS_SOURCES`` that the first readings carry, kept for the whole run so that a change of
    source is never mistaken for a spike). A process spike is reported with the cause from the
    events near it. A device spike is reported only when this process did not rise with it
    ("another process") — or when there is no process series at all — so one allocation of our
    own is never listed twice.
    """

    def __init__(self, min_rise_bytes: int = 64 << 20, window_s: float = 0.5, min_rise_fraction: float = 0.0,
                 baseline_s: float = 2.0, keep_events_s: float = 60.0) -> None:
        self._device = SpikeDetector("device", min_rise_bytes, window_s, min_rise_fraction, baseline_s)
        self._process = SpikeDetector("process", min_rise_bytes, window_s, min_rise_fraction, baseline_s)
        self.process_source: str | None = None
        # The app's events per kind, each in time order: a spike's cause is the latest event of each kind near it,
        # found by bisection, so a spike costs the same whether a token came every 100 ms or every 0.1 ms.
        self._events: dict[str, deque[Event]] = {}
        self._keep_events_s = keep_events_s
        self._history_s = window_s * 2 + baseline_s
        self._proc_points: deque[tuple[float, int]] = deque()

    def add_event(self, event: Event) -> None:
        """Record something the app did (load, prefill, switch, ...), in time order."""
        self._events.setdefault(event.kind, deque()).append(event)
        oldest = event.time_s - self._keep_events_s
        for events in self._events.values():
            while events and events[0].time_s < oldest:
                events.popleft()

    def feed(self, reading) -> list[Spike]:  # reading: kvscope.core.runtimes.probes.MemoryReading (kept duck-typed)
        """Add one reading; return the spikes that ended with it, causes attached."""
        t = reading.time_s
        if self.process_source is None:
            self.process_source = next((s for s in PROCESS_SOURCES if getattr(reading, s) is not None), None)
        proc_value = getattr(reading, self.process_source) if self.process_source else None
        if proc_value is not None:
            self._proc_points.append((t, int(proc_value)))
            while self._proc_points and self._proc_points[0][0] < t - self._history_s:
                self._proc_points.popleft()
        out: list[Spike] = []
        spike = self._process.feed(t, proc_value)
        if spike is not None:
            out.append(spike.with_cause(attribute_cause(spike, self._events_near(spike))))
        spike = self._device.feed(t, reading.device_used)
        if spike is not None:
            out.extend(self._device_spike(spike))
        return out

    def flush(self) -> list[Spike]:
        """End of the run: spikes still rising at the last reading."""
        out: list[Spike] = []
        spike = self._process.flush()
        if spike is not None:
            out.append(spike.with_cause(attribute_cause(spike, self._events_near(spike))))
        spike = self._device.flush()
        if spike is not None:
            out.extend(self._device_spike(spike))
        return out

    def _events_near(self, spike: Spike, lookback_s: float = 1.0) -> list[Event]:
        """What ``attribute_cause`` would choose from for ``spike`` (with its default ``lookback_s``): of each kind,
        the latest event from ``lookback_s`` before the rise began up to its end, if there is one. (Of events in time
        order, as ``add_event`` takes them: the same cause as from all of them.)"""
        start = (spike.start_s if spike.start_s is not None else spike.time_s) - lookback_s
        near: list[Event] = []
        for events in self._events.values():
            i = bisect.bisect_right(events, spike.time_s, key=_event_time)
            if i and events[i - 1].time_s >= start:
                near.append(events[i - 1])
        return near

    def _device_spike(self, spike: Spike) -> list[Spike]:
        if not self._proc_points:  # nothing to compare with: the events are all we know
            return [spike.with_cause(attribute_cause(spike, self._events_near(spike)))]
        start = spike.start_s if spike.start_s is not None else spike.time_s
        # rise_between over the points of the spike's own interval, read from the newest end
        last, lowest = None, None
        for t, v in reversed(self._proc_points):
            if t < start:
                break
            if t <= spike.time_s:
                last = v if last is None else last
                lowest = v if lowest is None else min(lowest, v)
        process_rise = None if last is None else int(last - lowest)
        cause = attribute_cause(spike, self._events_near(spike), process_rise=process_rise)
        return [spike.with_cause(cause)] if cause == CAUSE_OTHER_PROCESS else []


def _event_time(event: Event) -> float:
    return event.time_s


#: Spike thresholds: a GPU allocation worth a question, and on the CPU demo a few MiB of host memory.
SPIKE_MIN_GPU = 64 << 20
SPIKE_MIN_CPU = 4 << 20


def spike_threshold(device: str | None) -> int:
    """Bytes a rise must exceed to count as a spike on ``device`` (cuda/mps: 64 MiB, cpu: 4 MiB)."""
    return SPIKE_MIN_GPU if str(device or "").startswith(("cuda", "mps")) else SPIKE_MIN_CPU


def spike_events(sample: Sample, previous_cache: str | None = None) -> list[Event]:
    """What a Sample tells the SpikeMonitor about the app's doing at ``sample.time_s`` (plot seconds).

    A switch *to* a static cache is a preallocation (the whole max context at once); other
    switches are switches, named by what they switched to (so 'static -> dynamic' is not read as
    a preallocation). Decode samples name the cache strategy (dynamic-cache growth).
    """
    t = sample.time_s
    if sample.phase == PHASE_PREFILL:
        detail = ("eager scores are prompt x prompt per head" if sample.attn_impl == "eager"
                  else f"{sample.context_tokens} prompt tokens, kernel {sample.kernel}")
        return [Event(t, EVENT_PREFILL, detail)]
    if sample.phase == PHASE_DECODE:
        return [Event(t, EVENT_DECODE, sample.cache)]
    kind = sample.event or ""
    if kind == "load":
        return [Event(t, EVENT_LOAD, sample.text)]
    if kind == "oom":
        return [Event(t, EVENT_OOM, sample.text)]
    if kind == "switch":
        key = sample.switch_key or "setting"
        if key == "cache" and sample.cache.startswith("static") and previous_cache != sample.cache:
            return [Event(t, EVENT_STATIC_PREALLOC, f"cache to {sample.cache}")]
        new = sample.switch_after or ""
        return [Event(t, EVENT_SWITCH, f"{key} to {new}" if new else key)]
    return []


def reading_from_sample(sample: Sample):
    """A MemoryReading built from what a recorded token Sample measured (replays have no sampler)."""
    return MemoryReading(time_s=sample.time_s, allocator_allocated=sample.allocator_allocated,
                         allocator_reserved=sample.allocator_reserved, allocator_peak=sample.allocator_peak,
                         device_used=sample.device_used, device_total=sample.device_total,
                         process_gpu=sample.process_gpu, process_rss=sample.process_rss)

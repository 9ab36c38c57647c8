"""The session model: one run (live or replayed) as the window shows it, without Qt.

In the spirit of napari's ``ViewerModel``: the window forwards what arrives (sample batches, memory
readings, the engine's progress, errors, the end of a run) and user intent (a switch was sent) to
plain methods here, and renders what this model announces through its ``events``. Everything a
run decides lives here and is tested without a window (``tests/test_session.py``): the run's state,
its counters, the settings the engine reports, the switches still pending, the tie between the
run's clock and the sampler's, which readings are plotted, spikes and their causes, the OOM
forecast, the alerts.

Times: a Sample's ``time_s`` is seconds since its run started (the run's clock); a MemoryReading's
``time_s`` is ``time.monotonic()`` in the engine's or this process (the same clock on one machine).
``origin`` is the monotonic second that is 0 on the plots' time axis, found from the samples'
arrival (``take_samples``).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any

from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from kvscope.core.live.spikes import (EVENT_LOAD, EVENT_SWITCH, Event, Spike, SpikeMonitor, reading_from_sample,
                                      spike_events, spike_threshold)
from kvscope.core.runtimes.transformers.switches import parse_switch_value
from kvscope.core.prediction.forecast import OOM_WARN_S, OomForecast, oom_forecast

#: Run states. ``loading`` to ``running`` at the first sample (or the model's info), ``idle`` at the end.
STATES = ("idle", "loading", "running", "paused", "stopping")
BUSY = ("loading", "running", "paused", "stopping")
#: Readings reach the spike monitor this late, so the run's events (which arrive in their own
#: batches) are known before the readings around them are judged.
SPIKE_LAG_S = 0.3
#: After a run ends the memory plot keeps taking readings this long (the drop when memory is freed).
READINGS_TAIL_S = 2.0
#: The longest marker label (characters): a recorded text can be long, a plot shows a line's worth.
MARK_LABEL_CHARS = 80
#: (token, KV bytes) points the forecast's slope is fitted to (since the last switch).
SLOPE_POINTS = 32
#: Tokens remembered to place a spike on the token axis (the oldest half goes when full).
TOKEN_INDEX_MAX = 400_000


#: The Sample field that holds each switch axis's setting.
SETTING_FIELDS = {"attention": "attention", "attn-impl": "attn_impl", "cache": "cache"}


def canonical_switch(key: str, value: Any) -> tuple[str, str]:
    """``key=value`` as the engine spells it in its events (``switch_key``, ``switch_after``); a value
    that does not parse is kept as written (the engine refuses it under that spelling)."""
    k = str(key).strip().lower().replace("_", "-")
    try:
        name, parsed = parse_switch_value(k, str(value))
    except Exception:  # noqa: BLE001 - SettingsError/SpecError: the refusal carries the text as written
        return k, str(value)
    return name.replace("_", "-"), parsed if name == "attn_impl" else parsed.key


def marker_label(s: Sample, limit: int = MARK_LABEL_CHARS) -> str:
    """What a switch marker (plot line, text) says: the setting switched to ('mqa', 'flash',
    'cache static'), else the event's name."""
    if s.event == "switch" and s.switch_after:
        label = f"cache {s.switch_after}" if s.switch_key == "cache" else s.switch_after
    elif s.event == "switch":
        label = s.text or "switch"
    else:
        label = s.event or s.text
    return label if len(label) <= limit else label[:limit - 1] + "\u2026"


class Emitter:
    """One event of the session: callbacks connected, called in order with the event's arguments."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[..., Any]] = []

    def connect(self, callback: Callable[..., Any]) -> Callable[..., Any]:
        self._callbacks.append(callback)
        return callback

    def disconnect(self, callback: Callable[..., Any]) -> None:
        self._callbacks.remove(callback)

    def emit(self, *args: Any) -> None:
        for callback in list(self._callbacks):
            callback(*args)


class SessionEvents:
    """What a view of the session listens to (each an ``Emitter``; arguments in the comments)."""

    def __init__(self) -> None:
        self.state = Emitter()  # (state: str)
        self.settings = Emitter()  # (Sample): the settings in force, as the engine reports them
        self.text = Emitter()  # (kind: 'prompt' | 'token' | 'marker', text: str) for the text view
        self.row = Emitter()  # (Sample): a run event or the prefill, for the events table
        self.spike = Emitter()  # (Spike, token: int | None)
        self.origin = Emitter()  # (origin: float): the monotonic second that is 0 s on the plots
        self.readings = Emitter()  # (readings: list[MemoryReading], origin: float): for the memory plot
        self.alert = Emitter()  # (text: str, kind: 'error' | 'warning')
        self.alert_cleared = Emitter()  # (kind: str | None): None clears any
        self.status = Emitter()  # (text: str, ms: int): a status line (0: until replaced)
        self.forecast = Emitter()  # (OomForecast | None, near: bool)


class Session:
    """A run's state. Feed it with the ``take_*`` methods and the run's milestones; listen to ``events``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.events = SessionEvents()
        self.clock = clock
        self.state = "idle"
        self.mode = "live"  # live | replay: where the samples come from
        self.info: Any = None  # ModelInfo of the loaded model (or the recording)
        self.request: Any = None  # RunRequest of the current/last live run
        self.last_error = ""
        self.last_reading: Any = None  # newest MemoryReading from the sampler
        self.alert_kind = ""  # the alert shown: '', 'error' or 'warning'
        self.pending: dict[str, str] = {}  # axis -> the value last asked and not answered yet (one per axis)
        self.monitor: SpikeMonitor | None = None
        self.monitor_threshold = 0
        self.plot_readings = False  # True while a live run is on: readings go to the memory plot
        self.readings_until = 0.0
        self.load_started: float | None = None
        self._early: deque = deque(maxlen=20_000)  # readings before the first sample fixes the origin
        self._spike_queue: deque = deque(maxlen=200_000)
        self._monitor_last_t = float("-inf")
        self._monitor_flushed = True
        self._slope_points: deque = deque(maxlen=SLOPE_POINTS)
        self._times = array("d")  # time_s and token of each token sample: where a spike sits in tokens
        self._tokens = array("q")
        self._reset_run()

    def _reset_run(self) -> None:
        """What one run accumulates (also set up here for the first)."""
        self.last_sample: Sample | None = None
        self._newest: Sample | None = None  # the newest Sample of any kind (its settings are what runs)
        self.decode_tokens = 0
        self.switch_events = 0
        self.spike_count = 0
        self.forecast: OomForecast | None = None
        self.origin: float | None = None  # the monotonic second that is 0 s on the plots
        self._prev_cache: str | None = None
        self._early.clear()
        self._spike_queue.clear()
        self._slope_points.clear()
        self._last_decode: Sample | None = None  # the newest decode token since the last event
        self.predicted_slope: float | None = None  # the engine's predicted KV growth per token, newest
        del self._times[:], self._tokens[:]

    # ---- state

    @property
    def busy(self) -> bool:
        """A run is loading, running, paused or stopping (the run's own controls are locked)."""
        return self.state in BUSY

    def set_state(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown run state {state!r}")
        self.state = state
        self.events.state.emit(state)

    def clear_alert(self, kind: str | None = None) -> None:
        """Hide the alert (only one of ``kind`` when given)."""
        if self.alert_kind and (kind is None or self.alert_kind == kind):
            self.alert_kind = ""
            self.events.alert_cleared.emit(kind)

    def _alert(self, text: str, kind: str) -> None:
        self.alert_kind = kind
        self.events.alert.emit(text, kind)

    def reset(self) -> None:
        """Forget the run's data (a new run or a new recording)."""
        self._reset_run()
        self.clear_alert()

    # ---- milestones

    def begin_live(self, request: Any, device: str | None) -> None:
        """A live run starts loading ``request`` (memory on ``device`` judged for spikes). Readings from
        now on belong to this run: the load itself is the first thing to see."""
        self._begin("live", request, device, load_started=self.clock())

    def begin_replay(self) -> None:
        """A recording starts playing (its own samples are the memory series: no readings)."""
        self._begin("replay", None, None, load_started=None)

    def _begin(self, mode: str, request: Any, device: str | None, load_started: float | None) -> None:
        self.reset()
        self.mode = mode
        self.request = request
        self.last_error = ""
        self.pending = {}
        self.plot_readings = mode == "live"
        self.load_started = load_started
        self.set_state("loading")
        self.new_monitor(device)

    def new_monitor(self, device: str | None, keep_queue: bool = False) -> None:
        """A fresh spike monitor with ``device``'s threshold (``keep_queue``: readings not yet judged stay)."""
        self.monitor_threshold = spike_threshold(device)
        self.monitor = SpikeMonitor(min_rise_bytes=self.monitor_threshold)
        self._monitor_flushed = False
        if not keep_queue:
            self._monitor_last_t = float("-inf")
            self._spike_queue.clear()
            self._early.clear()

    def model_loaded(self, info: Any) -> None:
        """The engine (or a recording's header) describes the model."""
        self.info = info
        if self.state == "loading":
            self.set_state("running")
        device = str(info.device)
        if self.monitor is not None and spike_threshold(device) != self.monitor_threshold:
            # A GPU run is judged by the GPU's threshold from here on (the load was host memory).
            self.new_monitor(device, keep_queue=self.mode == "live")

    def progress(self, text: str) -> None:
        """A progress line from the engine (loading, 'switching…', 're-running N tokens…')."""
        self.events.status.emit(text, 0)
        if text.startswith(("switching", "re-running")) and self.monitor is not None and self.origin is not None:
            # The re-run's memory rises before its switch event arrives: tell the spike monitor now,
            # so those spikes are the conversion's, not "unknown".
            self.monitor.add_event(Event(self.clock() - self.origin, EVENT_SWITCH, text))

    def error(self, message: str) -> None:
        self.last_error = message

    @property
    def switches_pending(self) -> int:
        """Switches asked and not answered yet: at most one per axis (attention, attn-impl, cache)."""
        return len(self.pending)

    def tokens_ahead(self) -> int:
        """The tokens this live run will still generate (its request's new tokens less those generated so far);
        0 outside a live run. A static cache switched to must hold them."""
        if self.mode != "live" or self.request is None:
            return 0
        done = self.last_sample.token if self.last_sample is not None else 0
        return max(int(getattr(self.request, "max_new_tokens", 0) or 0) - done, 0)

    def running_setting(self, key: str) -> str | None:
        """The setting the engine last reported on axis ``key`` (attention / attn-impl / cache): its newest Sample's,
        event or token (a switch's event is newer than the token before it: read from the last token, a key
        pressed right after a switch took the setting left for the one that runs and said 'already mha')."""
        s = self._newest or self.last_sample
        return None if s is None else getattr(s, SETTING_FIELDS.get(key, ""), None)

    def switch_sent(self, key: str, value: str) -> bool:
        """A key asks ``key=value``. Presses coalesce: per axis only the last counts (the engine's
        driver keeps only the last too); a press back to the running setting cancels the pending
        one. Returns whether the engine must be told (False: that value is already pending)."""
        key, value = canonical_switch(key, value)
        if value == self.running_setting(key) and key not in self.pending:
            return False  # nothing pending, nothing to change
        if self.pending.get(key) == value:
            return False  # pressed again: the same switch is already on its way
        if value == self.running_setting(key):
            del self.pending[key]  # back to what runs: the engine replaces its pending one with a no-op
        else:
            self.pending[key] = value
        return True

    def finished(self) -> bool:
        """The run ended. False when there was none."""
        if self.state == "idle":
            return False
        if self.mode == "live":
            # Keep reading a little longer: the drop when the cache is freed belongs to the run.
            self.plot_readings = False
            self.readings_until = self.clock() + READINGS_TAIL_S
        elif self.monitor is not None and not self._monitor_flushed:
            self._monitor_flushed = True
            self._spikes(self.monitor.flush())
        self.clear_alert("warning")
        self.pending = {}  # switches asked and not answered: no run is left to answer them
        self.set_state("idle")
        if not self.last_error:
            self.events.status.emit(f"run ended after {self.decode_tokens:,} tokens", 5000)
        return True

    # ---- data in

    def take_samples(self, samples: list[Sample]) -> None:
        """A batch of samples (live or replayed), in order."""
        if not samples:
            return
        if self.mode == "live" and self.plot_readings:
            self._fix_origin(samples, self.clock())
        spikes: list[Spike] = []
        for s in samples:
            if self.monitor is not None:
                for event in spike_events(s, self._prev_cache):
                    self.monitor.add_event(event)
                if self.mode == "replay" and not s.is_event and s.time_s > self._monitor_last_t:
                    # A replay has no sampler: what each recorded token measured is the series.
                    self._monitor_last_t = s.time_s
                    spikes.extend(self.monitor.feed(reading_from_sample(s)))
            self._prev_cache = s.cache
            self._newest = s  # every Sample carries the settings in force: the newest says what runs
            if s.phase == PHASE_EVENT:
                self._take_event(s)
                continue
            self._index_token(s)
            if s.phase == PHASE_PREFILL:
                self.events.row.emit(s)
                self.events.text.emit("prompt", s.text)
            elif s.phase == PHASE_DECODE:
                self.decode_tokens += 1
                self.events.text.emit("token", s.text)
                if s.kv_bytes_reserved is not None:
                    self._slope_points.append((s.token, s.kv_bytes_reserved))
                p = self._last_decode
                if p is not None and s.token > p.token and None not in (s.kv_bytes_predicted, p.kv_bytes_predicted):
                    self.predicted_slope = (s.kv_bytes_predicted - p.kv_bytes_predicted) / (s.token - p.token)
                self._last_decode = s
            if self.last_sample is None:
                self.events.settings.emit(s)
            self.last_sample = s
        self._spikes(spikes)
        if self.state == "loading":
            self.set_state("running")

    def _take_event(self, s: Sample) -> None:
        self.events.row.emit(s)
        self._last_decode = None  # a slope does not span a switch (or any event)
        if s.switch_key is not None and self.pending.get(s.switch_key) == canonical_switch(s.switch_key, s.switch_after)[1]:
            # The answer to the last press on that axis (applied, refused or found a no-op); the answer to
            # an earlier press, already under way when it was superseded, leaves the last one pending.
            del self.pending[s.switch_key]
            if not self.pending and s.event == "switch":
                self.events.status.emit(s.text, 4000)
        if s.event == "switch":
            self.switch_events += 1
            self.predicted_slope = None  # the old settings' growth says nothing of the new ones
            self._slope_points.clear()  # a step is not a slope: the forecast starts afresh
            self.events.text.emit("marker", f" \u27e8{marker_label(s)}\u27e9 ")
            self.events.settings.emit(s)
        elif s.event in ("oom", "budget"):
            self.events.text.emit("marker", f" \u27e8{s.event}\u27e9 ")
            what = "Out of memory" if s.event == "oom" else "Memory budget reached"
            self._alert(f"\u26a0 {what} at token {s.token:,}: {s.text}", "error")
            self.events.status.emit(s.text, 8000)
        elif s.event in ("refused", "forecast", "error", "note"):
            self.events.status.emit(s.text, 8000)
            if s.event in ("refused", "error", "note"):
                # The engine's settings after a refused (or no-op) switch: the controls must show
                # what runs, not what was asked for.
                self.events.settings.emit(s)

    def _index_token(self, s: Sample) -> None:
        if len(self._times) >= TOKEN_INDEX_MAX:
            half = TOKEN_INDEX_MAX // 2
            del self._times[:half], self._tokens[:half]
        if not self._times or s.time_s >= self._times[-1]:
            self._times.append(s.time_s)
            self._tokens.append(int(s.token))

    def take_readings(self, readings: list) -> None:
        """A batch from the memory sampler: plotted and judged for spikes while a live run is on."""
        if not readings:
            return
        self.last_reading = readings[-1]
        if self.mode != "live" or not (self.plot_readings or self.clock() < self.readings_until):
            return
        if self.origin is None:
            self._early.extend(readings)  # placed once the first sample fixes the time axis
            return
        self.events.readings.emit(list(readings), self.origin)
        self._spike_queue.extend(readings)

    def _fix_origin(self, samples: list[Sample], arrival: float) -> None:
        """Tie the samples' run clock to the sampler's monotonic clock.

        A sample produced at run time ``time_s`` arrives here after some delivery delay, so
        ``arrival - time_s`` is the run's start on the monotonic clock plus that delay; the
        smallest value seen is the best estimate (delays are milliseconds).
        """
        best = min(arrival - s.time_s for s in samples)
        first = self.origin is None
        if first or best < self.origin - 0.002:
            self.origin = best
            self.events.origin.emit(best)
        if not first:
            return
        early = list(self._early)
        self._early.clear()
        if early:
            self.events.readings.emit(early, self.origin)
        self._spike_queue.extend(early)
        if self.monitor is not None and self.load_started is not None:
            # Loading is a state, not an instant: mark it every quarter second from Start to the
            # load event, so a spike anywhere in it is put down to the load.
            load_end = next((s.time_s for s in samples if s.event == "load"), samples[0].time_s)
            t = self.load_started - self.origin
            while t < load_end:
                self.monitor.add_event(Event(t, EVENT_LOAD, "loading the model"))
                t += 0.25

    # ---- spikes

    def tick(self) -> None:
        """A frame: judge the readings old enough (live), and flush the monitor once the run and its
        readings' tail are over."""
        flush = (self.state == "idle" and self.clock() > self.readings_until and not self._monitor_flushed
                 and not self._spike_queue and self.mode == "live")
        self.feed_spikes(flush=flush)

    def feed_spikes(self, flush: bool = False) -> None:
        """Judge readings older than SPIKE_LAG_S (live runs); each spike found is announced."""
        if self.monitor is None or self.origin is None or self.mode != "live":
            return
        cutoff = self.clock() - (0.0 if flush else SPIKE_LAG_S)
        found: list[Spike] = []
        while self._spike_queue and self._spike_queue[0].time_s <= cutoff:
            r = self._spike_queue.popleft()
            t = r.time_s - self.origin
            if t <= self._monitor_last_t:
                continue
            self._monitor_last_t = t
            found.extend(self.monitor.feed(dataclasses.replace(r, time_s=t)))
        if flush and not self._monitor_flushed:
            self._monitor_flushed = True
            found.extend(self.monitor.flush())
        self._spikes(found)

    def _spikes(self, spikes: list[Spike]) -> None:
        for spike in spikes:
            self.spike_count += 1
            self.events.spike.emit(spike, self.token_at(spike.time_s))

    def token_at(self, time_s: float) -> int | None:
        """The last token generated at or before ``time_s`` (plot seconds), or None before the prefill."""
        i = bisect.bisect_right(self._times, time_s) - 1
        return None if i < 0 else int(self._tokens[i])

    # ---- forecast

    @property
    def slope_points(self) -> list[tuple[int, int]]:
        """(token, KV bytes) of the latest decode tokens since the last switch."""
        return list(self._slope_points)

    def refresh_forecast(self, sampler_device: str, host_available: int | None) -> OomForecast | None:
        """'Out of memory at token N (about T s)' from what is free now; a warning alert when near."""
        free, source = None, ""
        r, s = self.last_reading, self.last_sample
        if (self.mode == "live" and r is not None and getattr(r, "device_free", None) is not None
                and str(sampler_device).startswith("cuda")):
            free, source = r.device_free, "GPU memory"
        elif s is not None and s.device_total is not None and s.device_used is not None:
            free, source = s.device_total - s.device_used, "GPU memory"
        elif self.mode == "live" and host_available is not None:
            free, source = host_available, "host memory"
        budget = self.request.memory_budget if (self.mode == "live" and self.request is not None) else None
        self.forecast = oom_forecast(self.slope_points, s, free=free, free_source=source, budget=budget,
                                     max_context=getattr(self.info, "max_context", None))
        near = self.forecast is not None and self.forecast.warning(OOM_WARN_S) and self.state in ("running", "paused")
        self.events.forecast.emit(self.forecast, near)
        if near:
            self._alert(f"\u26a0 Warning: {self.forecast.message()}", "warning")
        else:
            self.clear_alert("warning")
        return self.forecast

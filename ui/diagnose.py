"""Diagnosing memory: the events table, the GPU processes panel and its poller, the OOM forecast.

The window feeds the sampler's readings and the run's samples in; this module turns them into
rows people read: what the run did (load, prefill, every switch, refused, forecast, budget, oom)
and which spikes the ``SpikeMonitor`` found, with their cause. The GPU process list comes from
NVML on its own thread once a second (an NVML call can block for a long time on a busy driver).
"""

from __future__ import annotations

import bisect
import dataclasses

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot
from PySide6.QtGui import QBrush, QColor, QFont
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

from core.forecast import Forecast, budget_forecast, estimate_bytes_per_token, forecast_oom
from core.sample import PHASE_DECODE, PHASE_PREFILL, Sample
from core.spec import human_bytes
from core.spikes import EVENT_DECODE, EVENT_LOAD, EVENT_OOM, EVENT_PREFILL, EVENT_STATIC_PREALLOC, EVENT_SWITCH, Event, Spike
from workers.threaded import return_to_main_thread
from ui.theme import Theme

log = logging.getLogger(__name__)

#: Spike thresholds: a GPU allocation worth a question, and on the CPU demo a few MiB of host memory.
SPIKE_MIN_GPU = 64 << 20
SPIKE_MIN_CPU = 4 << 20
#: The forecast turns into a warning when out of memory is this close (seconds).
OOM_WARN_S = 10.0
#: Rows kept in the events table (a long run's decode tokens are not rows; events and spikes are).
MAX_ROWS = 5000

#: Run events the table lists, with the name shown.
EVENT_NAMES = {
    "load": "load", "prefill": "prefill", "switch": "switch", "refused": "refused switch",
    "forecast": "forecast", "budget": "budget reached", "oom": "out of memory", "stop": "stop", "error": "error",
}


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
    from core.probes import MemoryReading

    return MemoryReading(time_s=sample.time_s, allocator_allocated=sample.allocator_allocated,
                         allocator_reserved=sample.allocator_reserved, allocator_peak=sample.allocator_peak,
                         device_used=sample.device_used, device_total=sample.device_total,
                         process_gpu=sample.process_gpu, process_rss=sample.process_rss)


def format_duration(seconds: float | None) -> str:
    """'4.2 s', '38 s', '12 min', '3.5 h', '9 days' for the forecast."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.0f} days"


@dataclass(frozen=True)
class OomForecast:
    """The window's forecast: when memory (or the budget) runs out, from what."""

    forecast: Forecast
    limit: str  # "GPU memory", "host memory" or "memory budget"
    #: The token at which the run's context ends, when that comes before the memory runs out.
    context_first: int | None = None

    @property
    def token(self) -> int:
        return self.forecast.token

    @property
    def seconds(self) -> float | None:
        return self.forecast.seconds

    def message(self) -> str:
        """'out of memory at token 5,120 (about 12 s)'; 'memory budget reached at ...' for a budget;
        the context's end when it comes first."""
        if self.context_first is not None:
            return (f"the context ends at token {self.context_first:,}, before the {self.limit} would run out "
                    f"(token {self.token:,})")
        what = "memory budget reached" if self.limit == "memory budget" else "out of memory"
        when = f" (about {format_duration(self.seconds)})" if self.seconds is not None else ""
        return f"{what} at token {self.token:,}{when}"

    def warning(self, threshold_s: float = OOM_WARN_S) -> bool:
        return self.context_first is None and self.seconds is not None and self.seconds <= threshold_s


def oom_forecast(points: list[tuple[int, int]], last: Sample | None, *, free: int | None, free_source: str,
                 budget: int | None = None, max_context: int | None = None) -> OomForecast | None:
    """Forecast from recent (token, KV bytes) ``points`` (since the last switch), free bytes and a budget.

    Bytes per token is the least-squares slope of the points (``estimate_bytes_per_token``); the
    budget counts weights + KV + activations (``budget_forecast``). The earlier of the two wins.
    None when memory is not growing or nothing is known.
    """
    if last is None:
        return None
    bpt = estimate_bytes_per_token([p[0] for p in points], [p[1] for p in points])
    if bpt is None or bpt <= 0:
        return None
    best: OomForecast | None = None
    if free is not None:
        f = forecast_oom(bpt, free, last.tokens_per_s, last.token)
        if f is not None:
            best = OomForecast(f, free_source)
    if budget is not None and last.weights_bytes is not None and last.kv_bytes_observed is not None:
        try:
            f = budget_forecast(last.weights_bytes, last.kv_bytes_observed, last.activations_predicted or 0, budget,
                                bpt, last.tokens_per_s, last.token)
        except ValueError:
            f = None
        if f is not None and (best is None or f.token < best.token):
            best = OomForecast(f, "memory budget")
    if best is not None and max_context:
        # Tokens are counted from the first generated one; the context also holds the prompt.
        last_token = max_context - max(last.context_tokens - last.token, 0)
        if last_token < best.token:
            best = dataclasses.replace(best, context_first=last_token)
    return best


# ------------------------------------------------------------------------------------------------
# events table


@dataclass(frozen=True)
class EventRow:
    """One row of the events table: time in plot seconds, the token, what, a size and the detail."""

    time_s: float
    token: int | None
    kind: str
    size: str
    detail: str


class EventsTable(QTableWidget):
    """The run's events and the spikes found, newest at the bottom (kept in view)."""

    HEADERS = ("time", "token", "what", "size", "detail / likely cause")

    def __init__(self, theme: Theme, parent: QWidget | None = None) -> None:
        super().__init__(0, len(self.HEADERS), parent)
        self.theme = theme
        self.rows: list[EventRow] = []
        self._spike_group: dict | None = None  # the newest spike row, while later spikes of its kind join it
        self.setHorizontalHeaderLabels(self.HEADERS)
        self.verticalHeader().setVisible(False)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setAlternatingRowColors(True)
        self.setWordWrap(False)
        header = self.horizontalHeader()
        for i in range(len(self.HEADERS) - 1):
            header.setSectionResizeMode(i, QHeaderView.ResizeMode.ResizeToContents)
        # Size columns from the rows in view only: measuring all of them on every new row made each
        # event cost more than the last (thousands of events in a recording took minutes).
        header.setResizeContentsPrecision(0)
        header.setStretchLastSection(True)
        self.setToolTip("What the run did (load, prefill, every switch, refused switches, forecasts, budget, out of "
                        "memory)\nand every spike in memory the sampler saw, with its likely cause.")

    def add(self, row: EventRow, color: str | None = None) -> None:
        if len(self.rows) >= MAX_ROWS:
            self.removeRow(0)
            self.rows.pop(0)
        # In time order: spikes are judged a little after they happen, so they may arrive after later events.
        r = bisect.bisect_right([existing.time_s for existing in self.rows], row.time_s)
        self.rows.insert(r, row)
        self.insertRow(r)
        cells = (f"{row.time_s:.2f} s", "" if row.token is None else str(row.token), row.kind, row.size, row.detail)
        for c, text in enumerate(cells):
            item = QTableWidgetItem(text)
            if c in (0, 1, 3):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            if color is not None and c == 2:
                item.setForeground(QBrush(QColor(color)))
                font = QFont()
                font.setBold(True)
                item.setFont(font)
            if c == 4:
                item.setToolTip(text)
            self.setItem(r, c, item)
        self.scrollToBottom()

    def add_event(self, s: Sample) -> None:
        """A run event (phase event) or the prefill, as a row."""
        t = self.theme
        if s.phase == PHASE_PREFILL:
            self.add(EventRow(s.time_s, s.token, "prefill", human_bytes(s.kv_bytes_observed),
                              f"{s.context_tokens} prompt tokens \u00b7 kernel {s.kernel} \u00b7 cache {s.cache}"),
                     t.curves["kv_observed"])
            return
        kind = s.event or "event"
        color = {"switch": t.curves["marker"], "oom": t.error, "budget": t.error, "error": t.error,
                 "refused": t.warning, "forecast": t.warning}.get(kind, t.muted)
        size = human_bytes(s.kv_bytes_observed) if kind in ("switch", "load") and s.kv_bytes_observed else ""
        if kind == "load" and s.weights_bytes:
            size = human_bytes(s.weights_bytes)
        self.add(EventRow(s.time_s, s.token, EVENT_NAMES.get(kind, kind), size, s.text), color)

    def add_spike(self, spike: Spike, token: int | None) -> None:
        """A spike as a row; a run of spikes of one cause on one series (dynamic-cache growth, step
        after step) is one row that counts them, not one row each."""
        series = {"process": "this process", "device": "whole GPU"}.get(spike.series, spike.series)
        group = self._spike_group
        last = self.rows[-1] if self.rows else None
        if (group is not None and last is group["row"] and group["key"] == (spike.series, spike.cause)
                and spike.time_s >= last.time_s):
            group["count"] += 1
            group["rise"] += spike.rise_bytes
            r = len(self.rows) - 1
            until = f" (until token {token})" if token is not None else ""
            merged = EventRow(last.time_s, last.token, f"spikes \u00d7{group['count']} ({series})",
                              f"+{human_bytes(group['rise'])}", f"{spike.cause} \u00b7 {human_bytes(group['before'])} "
                                                               f"\u2192 {human_bytes(spike.after)}{until}")
            self.rows[r] = group["row"] = merged
            for c, text in ((2, merged.kind), (3, merged.size), (4, merged.detail)):
                item = self.item(r, c)
                item.setText(text)
                if c == 4:
                    item.setToolTip(text)
            return
        row = EventRow(spike.time_s, token, f"spike ({series})", f"+{human_bytes(spike.rise_bytes)}",
                       f"{spike.cause} \u00b7 {human_bytes(spike.before)} \u2192 {human_bytes(spike.after)}")
        self.add(row, self.theme.warning)
        self._spike_group = {"row": row, "key": (spike.series, spike.cause), "count": 1,
                             "rise": spike.rise_bytes, "before": spike.before}

    def clear_rows(self) -> None:
        self._spike_group = None
        self.rows.clear()
        self.setRowCount(0)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.rows]


# ------------------------------------------------------------------------------------------------
# GPU processes


class GpuProcessesPanel(QWidget):
    """Every process on every GPU with its memory (N/A as 'n/a'), this app highlighted."""

    HEADERS = ("GPU", "PID", "process", "GPU memory", "type")

    def __init__(self, theme: Theme, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.theme = theme
        self.processes: list = []
        self.note = QLabel("waiting for NVML\u2026")
        self.note.setObjectName("statNote")
        self.note.setWordWrap(True)
        self.table = QTableWidget(0, len(self.HEADERS))
        self.table.setHorizontalHeaderLabels(self.HEADERS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        header = self.table.horizontalHeader()
        for i in range(len(self.HEADERS)):
            header.setSectionResizeMode(i, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.note)
        layout.addWidget(self.table, 1)
        self.setToolTip("Every compute and graphics process on each GPU, as NVML lists them, refreshed once a "
                        "second.\nThis app is highlighted. 'n/a': the driver does not report per-process memory "
                        "(WSL, Windows WDDM).")

    def show_processes(self, processes: list, note: str = "") -> None:
        self.processes = list(processes)
        if not self.processes:
            self.note.setText(f"no GPU processes: {note}" if note else "no GPU processes")
        else:
            gpus = len({p.gpu_index for p in self.processes})
            self.note.setText(f"{len(self.processes)} process(es) on {gpus} GPU(s)" + (f" \u00b7 {note}" if note else ""))
        self.table.setRowCount(len(self.processes))
        # No processes (no NVIDIA driver, no GPU): the note says why; no empty table under it.
        self.table.setVisible(bool(self.processes))
        accent = QColor(self.theme.accent)
        accent.setAlpha(90)
        for r, p in enumerate(self.processes):
            cells = (str(p.gpu_index), str(p.pid), p.name + ("  (this app)" if p.is_self else ""),
                     human_bytes(p.used_bytes) if p.used_bytes is not None else "n/a", p.kind)
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c in (0, 1, 3):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if p.is_self:
                    item.setBackground(QBrush(accent))
                    font = QFont()
                    font.setBold(True)
                    item.setFont(font)
                self.table.setItem(r, c, item)


class _PollLoop(QObject):
    updated = Signal(list, str)
    finished = Signal()

    def __init__(self, make_probe: Callable, interval_s: float) -> None:
        super().__init__()
        self._make_probe = make_probe
        self._interval_s = interval_s
        self.abort = threading.Event()
        self.app_pids: frozenset[int] = frozenset()  # other processes of this app (set from the GUI thread)

    @Slot()
    def run(self) -> None:
        probe = None
        try:
            probe = self._make_probe()
            while not self.abort.is_set():
                rows = probe.gpu_processes(app_pids=self.app_pids)
                self.updated.emit(rows, "; ".join(probe.last_notes))
                self.abort.wait(self._interval_s)
        except Exception as exc:  # noqa: BLE001 - shown in the panel, never a silently dead thread
            self.updated.emit([], f"GPU process list stopped: {type(exc).__name__}: {exc}")
        finally:
            if probe is not None:
                probe.close()
            return_to_main_thread(self)
            self.finished.emit()


class GpuProcessPoller(QObject):
    """``MemoryProbe.gpu_processes()`` once a second on a named thread; ``updated(list, note)`` out."""

    updated = Signal(list, str)

    def __init__(self, interval_s: float = 1.0, probe_factory: Callable | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.interval_s = interval_s
        self._probe_factory = probe_factory or _default_probe
        self._thread: QThread | None = None
        self._loop: _PollLoop | None = None
        self.app_pids: frozenset[int] = frozenset()

    def start(self) -> None:
        if self.is_running():
            return
        loop = _PollLoop(self._probe_factory, self.interval_s)
        loop.app_pids = self.app_pids
        thread = QThread()
        thread.setObjectName("kvscope-gpu-processes")
        loop.moveToThread(thread)
        loop.updated.connect(self.updated)
        loop.finished.connect(thread.quit)
        thread.started.connect(loop.run)
        self._loop, self._thread = loop, thread
        thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.isRunning()

    def set_app_pids(self, pids: set[int]) -> None:
        """Mark these processes (the engine process) as this app's in the table, from the next poll."""
        self.app_pids = frozenset(pids)
        if self._loop is not None:
            self._loop.app_pids = self.app_pids  # one assignment: safe to read from the poll thread

    def stop(self, timeout_s: float = 2.0) -> bool:
        if self._loop is None or self._thread is None:
            return True
        self._loop.abort.set()
        self._thread.quit()
        return self._thread.wait(max(int(timeout_s * 1000), 1))


def _default_probe():
    from core.probes import MemoryProbe

    return MemoryProbe("cpu")

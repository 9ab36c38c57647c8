"""Diagnosing memory, as widgets: the events table and the GPU processes panel.

The session model (``kvscope.core.live.session``) turns the run's samples and the sampler's readings into rows:
what the run did (load, prefill, every switch, refused, forecast, budget, oom) and which spikes
the ``SpikeMonitor`` found, with their cause; this module shows them. The GPU process list comes
from ``kvscope.workers.gpu_poller`` (NVML on its own thread).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics
from PySide6.QtWidgets import (QAbstractItemView, QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from kvscope.core.base.safe_text import safe_lines, safe_text
from kvscope.core.base.sample import PHASE_PREFILL, Sample
from kvscope.core.live.spikes import Spike
from kvscope.core.model.spec import human_bytes
from kvscope.ui.theme import HEADER_PAD_PX, HEADER_WEIGHT, Theme

log = logging.getLogger(__name__)

#: Rows kept in the events table (a long run's decode tokens are not rows; events and spikes are).
MAX_ROWS = 5000

#: Run events the table lists, with the name shown.
EVENT_NAMES = {
    "load": "load", "prefill": "prefill", "switch": "switch", "refused": "refused switch",
    "forecast": "forecast", "budget": "budget reached", "oom": "out of memory", "stop": "stop", "error": "error",
}


def elide_headers(table: QTableWidget) -> None:
    """Keep ``table``'s column titles (those not sized to their contents) whole or cut with an ellipsis, the whole
    title in the section's tooltip.
    Qt centres a title wider than its section and cuts it at both ends ("ail / likely ca" at 1024 px in
    presenter type); its own eliding does not count the style sheet's padding."""
    header = table.horizontalHeader()
    titles = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())]

    def fit(*_args) -> None:
        font = QFont(header.font())
        font.setWeight(QFont.Weight(HEADER_WEIGHT))
        metrics = QFontMetrics(font)
        for c, title in enumerate(titles):
            if header.sectionResizeMode(c) == QHeaderView.ResizeMode.ResizeToContents:
                continue  # as wide as its title already (a shorter title would narrow it, and so on)
            item = table.horizontalHeaderItem(c)
            room = header.sectionSize(c) - 2 * HEADER_PAD_PX - 2
            shown = metrics.elidedText(title, Qt.TextElideMode.ElideRight, max(room, 1))
            if item.text() != shown:
                item.setText(shown)
                item.setToolTip(title if shown != title else "")

    header.sectionResized.connect(fit)
    fit()


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
        for i in (0, 1, 3):  # time, token, size: short, whole
            header.setSectionResizeMode(i, QHeaderView.ResizeMode.ResizeToContents)
        # What and the detail share the rest, elided (each cell's tooltip is whole): sized to their contents they
        # ran past the table at 1024 px, and a sideways scroll bar took the room of a row.
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.Stretch)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        # Size columns from the rows in view only: measuring all of them on every new row made each
        # event cost more than the last (thousands of events in a recording took minutes).
        header.setResizeContentsPrecision(0)
        elide_headers(self)
        self.setToolTip("What the run did (load, prefill, every switch, refused switches, forecasts, budget, out of "
                        "memory)\nand every spike in memory the sampler saw, with its likely cause.")

    def recolor(self, old, new) -> None:
        """The rows' event names in ``new``'s colours: rows shown under the dark theme kept its pale colours on
        the light theme's white (1.8:1 contrast)."""
        self.theme = new
        mapping = {QColor(old.curves[k]).name(): new.curves[k] for k in old.curves if k in new.curves}
        mapping.update({QColor(getattr(old, k)).name(): getattr(new, k) for k in ("error", "warning", "muted", "text")})
        for r in range(self.rowCount()):
            item = self.item(r, 2)
            if item is not None:
                now = item.foreground().color().name()
                if now in mapping:
                    item.setForeground(QBrush(QColor(mapping[now])))

    def add(self, row: EventRow, color: str | None = None) -> None:
        if len(self.rows) >= MAX_ROWS:
            self.removeRow(0)
            self.rows.pop(0)
        # In time order: spikes are judged a little after they happen, so they may arrive after later events.
        r = bisect.bisect_right([existing.time_s for existing in self.rows], row.time_s)
        self.rows.insert(r, row)
        self.insertRow(r)
        # Before the run's time 0 (a spike while the model loaded): said so, not as "-0.44 s".
        when = f"{row.time_s:.2f} s" if row.time_s >= 0 else "loading"
        cells = (when, "" if row.token is None else str(row.token), row.kind, row.size, row.detail)
        for c, text in enumerate(cells):
            # A recording's events are untrusted text: no control character or bidi override is shown raw.
            item = QTableWidgetItem(safe_text(text))
            if c in (0, 1, 3):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            if color is not None and c == 2:
                item.setForeground(QBrush(QColor(color)))
                font = QFont()
                font.setBold(True)
                item.setFont(font)
            if c in (2, 4):
                item.setToolTip(safe_lines(text))
            self.setItem(r, c, item)
        self.scrollToBottom()

    def add_event(self, s: Sample) -> None:
        """A run event (phase event) or the prefill, as a row."""
        t = self.theme
        if s.phase == PHASE_PREFILL:
            self.add(EventRow(s.time_s, s.token, "prefill", human_bytes(s.kv_bytes_reserved),
                              f"{s.context_tokens} prompt tokens \u00b7 kernel {s.kernel} \u00b7 cache {s.cache}"),
                     t.curves["kv_observed"])
            return
        kind = s.event or "event"
        color = {"switch": t.curves["marker"], "oom": t.error, "budget": t.error, "error": t.error,
                 "refused": t.warning, "forecast": t.warning}.get(kind, t.muted)
        size = human_bytes(s.kv_bytes_reserved) if kind in ("switch", "load") and s.kv_bytes_reserved else ""
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
        elide_headers(self.table)
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
                item = QTableWidgetItem(safe_text(text))  # a process names itself
                if c in (0, 1, 3):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if p.is_self:
                    item.setBackground(QBrush(accent))
                    font = QFont()
                    font.setBold(True)
                    item.setFont(font)
                self.table.setItem(r, c, item)

"""The Servers tab: inference servers' KV cache over time, from their /metrics (``kvscope.core.records.scrape``).

The scraping runs on its own thread (``kvscope.workers.server_watch``); this tab only draws what arrives: one
solid curve per server (KV bytes in use, the predictor's bytes for the tokens the server reports, or
KV Scope's own observed bytes), its capacity dashed, and a table with each server's latest reading.
A server that is down, slow or serves garbage says so in its row; nothing here ever waits on one. What
a server names (its model, its words) is shown with control characters escaped (``kvscope.core.base.safe_text``), and
figures it served that no server can have are flagged in its row ("absurd: ..."), never plotted.
"""

from __future__ import annotations

import time
from collections import deque

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QPushButton,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from kvscope.core.base.safe_text import safe_text
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import human_bytes
from kvscope.ui.axes import BytesAxis
from kvscope.ui.theme import DARK, Theme
from kvscope.workers.server_watch import ServerWatchPoller

#: Readings kept per server for the plot (an hour at the 2 s default).
HISTORY = 1800
#: Curve colours, one per server in turn (the Okabe-Ito palette the plots use).
PALETTE = ("#56b4e9", "#e69f00", "#009e73", "#cc79a7", "#f0e442", "#0072b2", "#d55e00")


class ServersTab(QWidget):
    HEADERS = ("server", "engine", "status", "KV used", "KV tokens", "KV bytes", "capacity",
               "running", "waiting", "preempted", "warning, problem or note")

    def __init__(self, theme: Theme = DARK, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.theme = theme
        self.poller = ServerWatchPoller(self)
        self.poller.readings.connect(self.show_readings)
        self.poller.failed.connect(lambda text: self.note.setText(text))
        self.urls = QLineEdit()
        self.urls.setPlaceholderText("http://127.0.0.1:8000  http://127.0.0.1:30000  (space-separated; /metrics is added)")
        self.model = QLineEdit()
        self.model.setPlaceholderText("model (preset or config.json), optional")
        self.model.setMaximumWidth(260)
        self.button = QPushButton("Watch")
        self.button.clicked.connect(self.toggle)
        self.urls.returnPressed.connect(self.toggle)
        row = QHBoxLayout()
        row.addWidget(QLabel("Servers"))
        row.addWidget(self.urls, 1)
        row.addWidget(self.model)
        row.addWidget(self.button)
        self.note = QLabel("Give one or more inference servers (vLLM, SGLang, llama.cpp --metrics, TGI, or a KV Scope "
                           "run --metrics-port) and press Watch.")
        self.note.setObjectName("statNote")
        self.note.setWordWrap(True)
        self.plot = pg.PlotWidget(axisItems={"left": BytesAxis(orientation="left")})
        self.plot.setLabel("bottom", "seconds since watching began")
        self.plot.setLabel("left", "KV cache in use")
        self.plot.addLegend(offset=(10, 10))
        self.plot.showGrid(x=True, y=True, alpha=theme.grid_alpha)
        # Before the first reading: a minute of 0-1 GiB, not pyqtgraph's 0-1 (bytes) x 0-1 (s).
        self.plot.setXRange(0, 60, padding=0.0)
        self.plot.setYRange(0, 2**30, padding=0.0)
        self.plot.getPlotItem().getAxis("bottom").enableAutoSIPrefix(False)
        self.apply_theme(theme)
        self.table = QTableWidget(0, len(self.HEADERS))
        self.table.setHorizontalHeaderLabels(self.HEADERS)
        self.table.verticalHeader().setVisible(False)
        self.table.setToolTip("KV bytes: the predictor's bytes for the tokens a server reports (for the model given, "
                              "or the one its /v1/models names);\nfor a KV Scope run, the bytes it observed.")
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        header = self.table.horizontalHeader()
        for i in range(len(self.HEADERS)):
            header.setSectionResizeMode(i, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(len(self.HEADERS) - 1, QHeaderView.ResizeMode.Stretch)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(row)
        layout.addWidget(self.note)
        layout.addWidget(self.plot, 3)
        layout.addWidget(self.table, 2)
        self._start = time.time()
        self._history: dict[str, tuple[deque, deque, deque]] = {}
        self._curves: dict[str, tuple[pg.PlotDataItem, pg.PlotDataItem]] = {}
        self.latest: list = []

    # -- control -------------------------------------------------------------------------------

    def toggle(self) -> None:
        if self.poller.is_running():
            self.stop()
            return
        self.watch(self.urls.text().split(), self.model.text().strip() or None)

    def watch(self, urls: list[str], model: str | None = None, interval_s: float = 2.0, timeout_s: float = 2.0) -> bool:
        """Start watching ``urls``; False (and the reason in the note) when a URL or the model is refused."""
        from kvscope.core.records.scrape import ScrapeError  # ~90 ms at the window's start-up (ssl): a watch's
        from kvscope.core.records.scrape import metrics_url

        try:
            checked = [metrics_url(u) for u in urls]
            spec = load_spec(model) if model else None
        except (ScrapeError, ValueError) as exc:  # SpecError is a ValueError
            self.note.setText(str(exc))
            return False
        if not checked:
            self.note.setText("give at least one server URL, e.g. http://127.0.0.1:8000")
            return False
        self._reset(checked)
        self.poller.start(checked, spec, interval_s, timeout_s)
        self.button.setText("Stop")
        self.note.setText(f"watching {len(checked)} server(s) every {interval_s:g} s (each has {timeout_s:g} s to answer)")
        return True

    def stop(self) -> None:
        self.poller.stop()
        self.button.setText("Watch")

    def shutdown(self) -> None:
        self.poller.stop()

    # -- drawing -------------------------------------------------------------------------------

    def _reset(self, urls: list[str]) -> None:
        self.plot.clear()
        self.plot.addLegend(offset=(10, 10))
        self._start = time.time()
        self._history = {u: (deque(maxlen=HISTORY), deque(maxlen=HISTORY), deque(maxlen=HISTORY)) for u in urls}
        self._curves = {}
        for i, url in enumerate(urls):
            colour = PALETTE[i % len(PALETTE)]
            used = self.plot.plot([], [], pen=pg.mkPen(colour, width=self.theme.line_width), name=safe_text(url, 120))
            capacity = self.plot.plot([], [], pen=pg.mkPen(colour, width=1, style=Qt.PenStyle.DashLine))
            self._curves[url] = (used, capacity)

    def show_readings(self, readings: list) -> None:
        """One round of readings (``kvscope.core.records.scrape.ServerReading``): the table, and a point per server."""
        self.latest = list(readings)
        for r in readings:
            hist = self._history.get(r.url)
            if hist is None:
                continue
            t = r.time_s - self._start
            times, used, capacity = hist
            times.append(t)
            used.append(float(r.kv_bytes) if r.kv_bytes is not None else float("nan"))
            capacity.append(float(r.kv_capacity_bytes) if r.kv_capacity_bytes is not None else float("nan"))
            curve_used, curve_capacity = self._curves[r.url]
            curve_used.setData(list(times), list(used), connect="finite")
            curve_capacity.setData(list(times), list(capacity), connect="finite")
            self.plot.enableAutoRange()  # the empty plot's fixed range gives way to the data
        self._fill_table(readings)

    def _fill_table(self, readings: list) -> None:
        from kvscope.core.records.scrape import OK  # ~90 ms at the window's start-up (ssl): a watch's

        self.table.setRowCount(len(readings))
        warn = QColor(self.theme.warning)
        bad = QColor(self.theme.error)
        for row, r in enumerate(readings):
            ok = r.status == OK
            absurd = getattr(r, "absurd", None)
            said = r.warning or (r.problem if not ok else None) or r.note or ""
            if absurd:
                said = f"absurd figures left out: {absurd}" + (f"; {said}" if said else "")
            cells = (
                r.url, r.engine or "", r.status,
                f"{r.kv_usage:.1%}" if r.kv_usage is not None else "n/a",
                f"{r.kv_tokens:,}" if r.kv_tokens is not None else "n/a",
                human_bytes(r.kv_bytes) if r.kv_bytes is not None else "n/a",
                human_bytes(r.kv_capacity_bytes) if r.kv_capacity_bytes is not None else "n/a",
                f"{r.running:g}" if r.running is not None else "n/a",
                f"{r.waiting:g}" if r.waiting is not None else "n/a",
                f"{r.preemptions:g}" if r.preemptions is not None else "n/a",
                said,
            )
            for col, text in enumerate(cells):
                item = QTableWidgetItem(safe_text(text, 400))  # a server's names and words, escaped
                if not ok and col in (2, len(cells) - 1):
                    item.setForeground(bad)
                if (r.warning or absurd) and col == len(cells) - 1:
                    item.setForeground(warn)
                self.table.setItem(row, col, item)

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        self.plot.showGrid(x=True, y=True, alpha=theme.grid_alpha)
        self.plot.setBackground(theme.background)  # light theme: not a black plot on a white tab
        for side in ("left", "bottom"):
            axis = self.plot.getPlotItem().getAxis(side)
            axis.setTextPen(theme.muted)
            axis.setPen(theme.muted)

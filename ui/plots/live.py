"""The live plots together: the panels of ``PANELS`` fed from shared ring buffers, drawn in one frame budget.

Samples are appended to preallocated ring buffers as they arrive (cheap, any rate); a fixed-rate timer in the
window calls ``LivePlots.redraw`` (about 30 Hz), which hands each changed curve its column decimated to one
min/max pair per pixel column (``kvscope.ui.decimate``), so a 100,000-point curve is as cheap to draw as the plot is
wide. A plot is one class (``kvscope.ui.plots.panel.PlotPanel``) in a module of its own and one entry in ``PANELS``
(its ``"module:class"``): the columns it plots, its markers, its place (the top row, or side by side in the bottom
row), its frames, its export and its place in the summary image come from there (docs/extending.md, "a new plot").

The top row is the KV plot with the quality strip under it (``kvscope.ui.plots.quality``) and the frontier
(``kvscope.ui.plots.frontier``) to their right; the strip and the frontier show only once a Sample carries the
quality probe's figures (a run without the probe keeps the layout it had).
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QApplication, QSplitter, QVBoxLayout, QWidget

from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.live.session import MARK_LABEL_CHARS, marker_label
from kvscope.ui.plots.frontier import FrontierPlot
from kvscope.ui.plots.kv import KVPlot
from kvscope.ui.plots.memory import MemoryPlot, SpikeMark
from kvscope.ui.plots.panel import MAX_MARKS, FrameBudget, Marker, PlotPanel
from kvscope.ui.plots.quality import QualityFigure, QualityPlot
from kvscope.ui.plots.total import TotalPlot
from kvscope.ui.ringbuffer import RingBuffer
from kvscope.ui.theme import Theme, theme as make_theme

DEFAULT_CAPACITY = 200_000  # points per curve kept in memory (about 1.6 MB per column)

#: The plots, top row first, as ``"module:class"`` (imported when the plots are built, ``panel_classes``): a new plot
#: is its module and one line here. The first is drawn at every frame; the others take turns (see ``redraw``).
PANELS: tuple[str, ...] = (
    "kvscope.ui.plots.kv:KVPlot",
    "kvscope.ui.plots.quality:QualityPlot",
    "kvscope.ui.plots.frontier:FrontierPlot",
    "kvscope.ui.plots.memory:MemoryPlot",
    "kvscope.ui.plots.total:TotalPlot",
)
#: The panels shown only while the run's Samples carry the quality probe's figures.
QUALITY_PANELS = ("quality", "frontier")
#: The strip and the frontier show where the plots are at least this wide (presenter mode at 1024 px: ~675 px).
#: Narrower (1024 px with the controls shown: ~480 px, the memory and total plots stacked) they squeezed the KV plot's
#: data area to a few pixels: there they wait off screen, the attention badge still says the figure, File › Export and
#: the summary image still draw them (``rendered``), and F11 shows them.
FRONTIER_MIN_W = 600


def panel_classes(panels: tuple[str, ...] | None = None) -> tuple[type[PlotPanel], ...]:
    """The classes ``panels`` (default ``PANELS``) name. Raises ValueError, in one line, for an entry that names no
    ``PlotPanel``, or two panels with one ``key``."""
    out: list[type[PlotPanel]] = []
    for entry in PANELS if panels is None else panels:
        module, _, name = str(entry).partition(":")
        try:
            cls = getattr(importlib.import_module(module), name) if module and name else None
        except ImportError as exc:
            raise ValueError(f"plot {entry!r} cannot be imported: {exc}") from None
        except AttributeError:
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, PlotPanel)) or not cls.key:
            raise ValueError(f"plot {entry!r} is not a 'module:class' of a PlotPanel with a key")
        if any(c.key == cls.key for c in out):
            raise ValueError(f"plot {entry!r}: another plot has the key {cls.key!r}")
        out.append(cls)
    return tuple(out)


def _columns(first: str, panels, attribute: str) -> tuple[str, ...]:
    out = [first]
    for cls in panels:
        out += [c for c in getattr(cls, attribute) if c not in out]
    return tuple(out)


class LivePlots(QWidget):
    """The live plots (``PANELS``) fed by ``add_samples`` and drawn by ``redraw``."""

    #: The running quality figure of the setting in force (a ``QualityFigure``), or None (no probe, a new run).
    quality_changed = Signal(object)

    def __init__(self, theme: Theme | None = None, capacity: int = DEFAULT_CAPACITY, parent: QWidget | None = None):
        super().__init__(parent)
        self.theme = theme or make_theme("dark")
        classes = panel_classes()
        self.exportable = tuple(cls.key for cls in classes)  # what ``export_plot`` can write: one name per panel
        self.tokens = RingBuffer(capacity, _columns("token", classes, "TOKEN_COLUMNS"))
        self.times = RingBuffer(capacity, _columns("time", classes, "TIME_COLUMNS"))
        # monotonic seconds (the probes' clock) of plot time 0; set by the window from the run's samples
        self.time_origin: float | None = None
        self.markers: list[Marker] = []
        self.draws = 0
        self._ranges_pending = False

        pg.setConfigOptions(antialias=False)  # antialiasing costs more than it buys at 30 Hz
        self.panels: list[PlotPanel] = []
        for cls in classes:
            self.panels.append(cls(self.tokens, self.times, self.markers, self.theme, capacity))
        self._curves = {key: curve for panel in self.panels for key, curve in panel.curves.items()}
        self.kv, self.memory, self.total = (self.panel(cls.key) for cls in (KVPlot, MemoryPlot, TotalPlot))
        self.quality, self.frontier = self.panel(QualityPlot.key), self.panel(FrontierPlot.key)
        self.quality.plot.setXLink(self.kv.plot)  # the strip's tokens are the KV plot's, pixel for pixel
        self._figure: QualityFigure | None = None
        self._quality_shown = False  # laid out for the probe's panels in this run
        # The names the window, the tests and the benchmarks know the parts by.
        self.kv_widget, self.mem_widget, self.cmp_widget = self.kv, self.memory, self.total
        self.kv_plot, self.mem_plot = self.kv.plot, self.memory.plot
        self.total_plot, self.error_plot = self.total.total_plot, self.total.error_plot
        self.kv_view = self.memory.kv_view
        self.capacity_line, self.zero_line = self.memory.capacity_line, self.total.zero_line
        self.previous_curve, self.older_curve = self.kv.previous_curve, self.kv.older_curve
        self.slope_label, self.error_label = self.kv.readout_label, self.total.readout_label
        self.readings = self.memory.readings

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        # The top row's panels over the bottom row's, side by side (the window may stack them: a narrow column).
        # The top row: its first panels one under the other (the KV plot, the quality strip), and those marked
        # ``beside`` (the frontier) to their right.
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        rows: dict[int, list[PlotPanel]] = {}
        for panel in self.panels:
            rows.setdefault(panel.row, []).append(panel)
        for row in sorted(rows):
            if len(rows[row]) == 1 and row == 0:
                self.splitter.addWidget(rows[row][0])
            elif row == 0:
                self.top_row = QSplitter(Qt.Orientation.Horizontal)
                self.top_column = QSplitter(Qt.Orientation.Vertical)
                for panel in rows[row]:
                    (self.top_row if getattr(panel, "beside", False) else self.top_column).addWidget(panel)
                self.top_row.insertWidget(0, self.top_column)
                self.top_column.setStretchFactor(0, 5)
                self.top_column.setStretchFactor(1, 2)
                self.top_row.setStretchFactor(0, 3)
                self.top_row.setStretchFactor(1, 2)
                for i in range(self.top_column.count()):
                    self.top_column.setCollapsible(i, False)
                self.splitter.addWidget(self.top_row)
            else:
                side = QSplitter(Qt.Orientation.Horizontal)
                for panel in rows[row]:
                    side.addWidget(panel)
                self.splitter.addWidget(side)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 2)
        layout.addWidget(self.splitter)
        self._show_quality(False)
        self.apply_theme(self.theme)

    def panel(self, key: str) -> PlotPanel:
        return next(p for p in self.panels if p.key == key)

    # ---- what the window and the tests read

    @property
    def slope_bytes_per_token(self) -> float | None:
        return self.kv.slope_bytes_per_token

    @property
    def tokens_cache(self) -> str:
        return self.kv.tokens_cache

    @property
    def host_only(self) -> bool | None:
        return self.memory.host_only

    @property
    def spikes(self) -> list[SpikeMark]:
        return self.memory.spikes

    @property
    def peak_points(self) -> list[tuple[int, int, int]]:
        return self.total.peak_points

    @property
    def previous_label(self) -> str | None:
        return self.kv.previous[-1][2] if self.kv.previous else None

    @property
    def previous_labels(self) -> list[str]:
        """The held runs' labels, the latest last."""
        return [p[2] for p in self.kv.previous]

    def curve_data(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """The (x, y) a curve currently shows (for tests and exports)."""
        x, y = self._curves[key].item.getData()
        return (np.asarray([]) if x is None else x), (np.asarray([]) if y is None else y)

    def curve_visible(self, key: str) -> bool:
        return self._curves[key].item.isVisible()

    # ---- data in

    def add_samples(self, samples: list[Sample]) -> None:
        """Append a batch of samples (any rate; drawing happens in ``redraw``)."""
        token_rows: list[dict] = []
        time_rows: list[dict] = []
        for s in samples:
            for panel in self.panels:
                panel.take(s)
            if s.phase == PHASE_EVENT:
                if s.event in ("switch", "error", "oom", "budget"):
                    self._add_marker(s)
                continue
            token_row, time_row = {"token": s.token}, {"time": s.time_s}
            for panel in self.panels:
                token_row.update(panel.token_row(s))
                time_row.update(panel.time_row(s))
            token_rows.append(token_row)
            time_rows.append(time_row)
        self.tokens.extend(token_rows)
        self.times.extend(time_rows)
        if self.quality.seen and not self._quality_shown:
            self._quality_shown = True
            self._show_quality(True)

    # ---- the quality probe's panels

    def _show_quality(self, on: bool) -> None:
        """The strip and the frontier, shown while the run's Samples carry the probe's figures; the KV plot keeps
        a blank right axis as wide as the strip's, so that their tokens line up."""
        room = self.width() >= FRONTIER_MIN_W
        self.quality.setVisible(on and room)
        self.frontier.setVisible(on and room)
        self.kv.set_axis_below(on and room)
        on = on and room
        if on:
            # The top row at least half the height (the window's narrow layout gave it 3/8, and the strip took the KV
            # plot's data area down to a few pixels at 1024x768); the KV plot 5:2 over the strip, and at least 150 px
            # where the row has them; the frontier 40 % of the row, at least 200 px where it can.
            rows = self.splitter.sizes()
            if len(rows) == 2 and sum(rows) > 0 and rows[0] < sum(rows) // 2:
                self.splitter.setSizes([sum(rows) // 2, sum(rows) - sum(rows) // 2])
            height = max(self.splitter.sizes()[0], sum(self.top_column.sizes()), 7)
            strip = max(min(height * 2 // 7, height - 150), min(60, height // 3))
            self.top_column.setSizes([height - strip, strip])
            width = max(sum(self.top_row.sizes()), self.width(), 3)
            side = min(max(width * 40 // 100, 200), width // 2)
            self.top_row.setSizes([width - side, side])

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if self.quality.seen:
            # After the window's own layout of the rows (presenter mode on or off, a narrow column) has run.
            QTimer.singleShot(0, self._refit_quality)

    def _refit_quality(self) -> None:
        rows = self.splitter.sizes()
        if self.quality.seen and (self.quality.isHidden() == (self.width() >= FRONTIER_MIN_W)
                                  or (len(rows) == 2 and rows[0] < sum(rows) * 45 // 100)):
            self._show_quality(True)

    def rendered(self, panel: PlotPanel) -> PlotPanel:
        """``panel`` as it is on screen, or, where the window has no room for it (the frontier, the quality strip, a
        bottom-row panel past the second on a small screen), a copy of it drawn off screen at a readable size (what
        exports and the summary image take)."""
        if not panel.isHidden():
            return panel
        copy = type(panel)(self.tokens, self.times, [], self.theme)
        if panel is self.frontier:
            copy.points = {key: dataclasses.replace(point) for key, point in panel.points.items()}
            copy._version = 1
            size = (440, 320)  # (about its size beside the KV plot: a summary scales it, type and all)
        elif panel is self.quality:
            copy.figure, copy.seen = panel.figure, True
            size = (720, 150)
        else:  # a panel that draws the shared buffers alone: its curves and the switches' lines
            for marker in self.markers:
                for _owner, line in copy.marker_lines(marker, None):
                    copy.style_marker_line(marker, line)
            size = (panel.sizeHint().width(), panel.sizeHint().height() * 3 // 2)
        copy.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen)
        copy.resize(*size)
        copy.show()
        QApplication.sendPostedEvents(copy)  # its resize and layout before it is measured
        copy.apply_theme(self.theme)
        copy.draw()
        if panel is self.quality:
            copy.plot.setXRange(*self.kv.plot.viewRange()[0], padding=0.0)
        copy.fit_ranges(FrameBudget({id(copy)}, math.inf))
        copy.refresh_labels()
        copy.fit_type(force=True)
        QApplication.sendPostedEvents()  # (the layout requests its new type posted)
        copy.ci.layout.activate()
        copy.declutter()
        self._offscreen = getattr(self, "_offscreen", [])[-1:] + [copy]  # kept while the caller grabs or exports it
        return copy

    def quality_figure(self) -> QualityFigure | None:
        """The running quality figure of the setting in force (the strip's readout and the attention badge's)."""
        return self.quality.figure

    def summary_panels(self) -> list[PlotPanel]:
        """The panels a summary image shows, the KV plot first: the strip and the frontier where the probe ran."""
        return [self.rendered(p) for p in self.panels if p.key not in QUALITY_PANELS or self.quality.seen]

    def exportable_now(self) -> tuple[str, ...]:
        """The plots File › Export writes now: every panel, the quality probe's where it ran."""
        return tuple(p.key for p in self.panels if p.key not in QUALITY_PANELS or self.quality.seen)

    def add_memory_readings(self, readings, origin: float | None = None) -> int:
        """Append the memory sampler's readings (``kvscope.core.runtimes.probes.MemoryReading``, any number).

        Their ``time_s`` is ``time.monotonic()``; ``origin`` (default ``time_origin``) is the monotonic
        second that is 0 on the plot's time axis, the same axis the token samples' ``time_s`` use.
        Readings before the origin is known cannot be placed and are refused (returns 0). Returns
        the readings appended.
        """
        origin = self.time_origin if origin is None else origin
        if origin is None or not readings:
            return 0
        return self.memory.add_readings(readings, origin)

    def add_spike(self, time_s: float, after: int, rise: int, cause: str = "") -> SpikeMark:
        """Mark a spike on the memory plot at ``time_s`` (plot seconds): a triangle at ``after`` bytes, '+rise'."""
        return self.memory.add_spike(time_s, after, rise, cause)

    def declutter_spike_labels(self) -> int:
        return self.memory.declutter()

    def _add_marker(self, s: Sample) -> None:
        label = marker_label(s, MARK_LABEL_CHARS)  # the session's rule: the plot only draws it
        marker = Marker(max(int(s.token), 0), s.time_s, label, s.event or "switch", ())
        pairs = []
        for i, panel in enumerate(self.panels):
            for owner, line in panel.marker_lines(marker, label if i == 0 else None):
                pairs.append((panel, owner, line))
        marker.lines = tuple(line for _, _, line in pairs)
        marker.owners = tuple(owner for _, owner, _ in pairs)
        for panel, _, line in pairs:
            panel.style_marker_line(marker, line)
        self.markers.append(marker)
        if len(self.markers) > MAX_MARKS:
            old = self.markers.pop(0)
            for owner, line in zip(old.owners, old.lines):
                owner.removeItem(line)

    # ---- held runs

    def hold_previous(self, label: str) -> bool:
        """Keep this run's KV curve (observed, or what the runtime reserved) to draw, dotted, under the next run:
        a transformers run's growing cache beside a llama.cpp run's prepayment of the same model, or two
        settings side by side. False if there is no curve to keep. ``reset`` keeps it; ``drop_previous`` ends it."""
        return self.kv.hold_previous(label)

    def drop_previous(self) -> None:
        self.kv.previous = []
        self.kv.show_previous()

    # ---- the run's start, the theme

    def reset(self) -> None:
        """Forget everything (a new run) but the previous run's curve, if one is held (``hold_previous``)."""
        self.tokens.clear()
        self.times.clear()
        self.time_origin = None
        for marker in self.markers:
            for owner, line in zip(marker.owners, marker.lines):
                owner.removeItem(line)
        self.markers.clear()
        for panel in self.panels:
            panel.reset()
        self._show_quality(False)
        self._quality_shown = False
        self._announce_figure()
        self.apply_theme(self.theme)

    def apply_theme(self, theme: Theme) -> None:
        """Restyle backgrounds, axes, pens and labels (dark, light, presenter); each panel fits its type."""
        self.theme = theme
        for panel in self.panels:
            panel.apply_theme(theme)
        for panel in self.panels:
            panel.refresh_labels()

    # ---- drawing

    def redraw(self, settle: bool = True) -> int:
        """Push changed buffers to their curves and fit the view ranges. Returns curves updated.

        ``settle`` (the default) draws every panel now. The window's fixed-rate timer passes False, for
        frame pacing, so that no one frame keeps the UI thread long: the first panel (KV) updates at every
        call, the others one per call, in turn (each panel is a scene Qt repaints separately); at most one
        view range changes per call (a change re-renders axes). What waits is drawn on the next call.
        """
        first = self.panels[0]
        others = [p for p in self.panels[1:] if not p.isHidden()]  # (the probe's panels, without the probe)
        drawn = self.panels if settle or not others else [first, others[self.draws % len(others)]]
        frame = FrameBudget({id(p) for p in drawn}, math.inf if settle else 1)
        updated = sum(panel.draw() for panel in drawn)
        if updated or self._ranges_pending or settle:
            for panel in self.panels:
                panel.fit_ranges(frame)
            self._ranges_pending = frame.pending
            for panel in self.panels:
                panel.declutter()
        if updated:
            for panel in self.panels:
                panel.refresh_labels()
        self._announce_figure()
        self.draws += 1
        return updated

    def _announce_figure(self) -> None:
        figure = self.quality.figure
        if figure != self._figure:
            self._figure = figure
            self.quality_changed.emit(figure)

    # ---- export

    def export_plot(self, which: str, path: str) -> str:
        """Write one plot to ``path`` with pyqtgraph's exporters: PNG (twice the on-screen size) or SVG."""
        import pyqtgraph.exporters as exporters

        panel = next((p for p in self.panels if p.key == which), None)
        if panel is None:
            raise ValueError(f"unknown plot {which!r}; choose one of {', '.join(self.exportable)}")
        panel = self.rendered(panel)
        item = panel.export_item()
        if str(path).lower().endswith(".svg"):
            try:
                if panel is self.memory:  # its KV scale is a view box of its own in the scene: render the scene
                    raise ValueError
                exporters.SVGExporter(item).export(str(path))
            except (ValueError, IndexError):
                # pyqtgraph 0.14's SVG post-processing cannot parse the path data Qt 6.11's SVG
                # generator writes ("x,y" pairs expected); Qt's own generator gives the same vector
                # picture without that step.
                self._svg_with_qt(item, str(path))
            return str(path)
        exporter = exporters.ImageExporter(item)
        # Twice the screen size: sharp on a slide. Integer sizes (pyqtgraph rounds floats badly).
        exporter.parameters()["width"] = max(int(item.sceneBoundingRect().width() * 2), 400)
        exporter.export(str(path))
        return str(path)

    def _svg_with_qt(self, item, path: str) -> None:
        from PySide6.QtCore import QRectF, QSize
        from PySide6.QtGui import QPainter
        from PySide6.QtSvg import QSvgGenerator

        source = item.sceneBoundingRect()
        w, h = int(source.width()), int(source.height())
        generator = QSvgGenerator()
        generator.setFileName(path)
        generator.setSize(QSize(w, h))
        generator.setViewBox(QRectF(0, 0, w, h))
        generator.setTitle("KV Scope plot")
        painter = QPainter(generator)
        try:
            painter.fillRect(QRectF(0, 0, w, h), QColor(self.theme.background))
            item.scene().render(painter, QRectF(0, 0, w, h), source)
        finally:
            painter.end()

"""The three live plots: KV bytes vs token, memory vs time, predicted vs observed with the error.

Samples are appended to preallocated ring buffers as they arrive (cheap, any rate); a fixed-rate
timer in the window calls ``LivePlots.redraw`` (about 30 Hz), which hands each changed curve its
column decimated to one min/max pair per pixel column (``kvscope.ui.decimate``, incremental: a frame costs
the new points, not the whole column), so a 100,000-point curve is as cheap to draw as the plot is
wide. The view ranges always hold all the data, so there is nothing to clip.

Its helpers have their own files: axes and number formats (``kvscope.ui.axes``), the device-pixel curve
(``kvscope.ui.curves``), the decimator (``kvscope.ui.decimate``), the ring buffers (``kvscope.ui.ringbuffer``), and the
observed-vs-predicted arithmetic (``kvscope.core.live.compare``). What stays (about 850 lines) is one widget:
the three plots, their curves, markers, spike marks and stepped ranges, which share one frame
budget (``redraw``) and so one class.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import QGraphicsItem, QSplitter, QVBoxLayout, QWidget

from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.live.breakdown import comparable_totals, forward_peak_totals
from kvscope.core.live.compare import error_percent
from kvscope.core.live.session import MARK_LABEL_CHARS, marker_label
from kvscope.ui.axes import BytesAxis, SparseAxis, format_bytes, format_slope
from kvscope.ui.curves import DeviceCurve
from kvscope.ui.decimate import PeakDecimator
from kvscope.ui.ringbuffer import RingBuffer
from kvscope.ui.theme import Theme, theme as make_theme

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 200_000  # points per curve kept in memory (about 1.6 MB per column)
#: Switch markers and spike marks kept on the plots (the newest; older ones are removed): each is a
#: few graphics items every frame draws and every new item re-bounds, so a recording with thousands
#: of switches made each sample slower than the last (2,000 took 100 s to replay).
MAX_MARKS = 200

TOKEN_COLUMNS = ("token", "kv_observed", "kv_predicted", "total_observed", "total_predicted", "error_total",
                 "error_kv", "quality_kl", "kv_reserved", "kv_used")
TIME_COLUMNS = ("time", "device_total", "device_used", "process_gpu", "process_rss", "reserved", "allocated",
                "kv_share", "weights")
#: The memory sampler's readings (MemorySampler, ~20 Hz, independent of tokens), in plot seconds.
READING_COLUMNS = ("time", "device_total", "device_used", "process_gpu", "process_rss", "reserved", "allocated")
#: Memory curves the sampler's readings replace once there are any: the same quantities, read 20x a
#: second instead of once per token (a replay has no readings and keeps the per-token ones).
SAMPLED = ("device_used", "process_gpu", "process_rss", "reserved", "allocated")

#: A view range that the data outgrows grows by this factor: each change re-renders the axes (the
#: costliest frames), so few big steps beat many small ones. The data then fills 2/3 to all of it.
GROW = 1.5


@dataclass
class _Curve:
    item: DeviceCurve
    buffer: RingBuffer
    x: str
    y: str
    name: str
    legend: pg.LegendItem | None
    decimator: PeakDecimator
    view: str = "kv"  # which of the three views draws it: kv, mem, cmp
    in_legend: bool = False
    drawn_version: tuple[int, int] | None = None  # (buffer version, bins) last drawn
    y_range: tuple[float, float] | None = None  # min and max of what is drawn (None: nothing)


@dataclass
class SpikeMark:
    """A spike marked on the memory-vs-time plot: a triangle at its peak and its size above it."""

    time_s: float
    after: int
    rise: int
    cause: str
    items: tuple


@dataclass
class Marker:
    """A switch (or load/error) marked on the plots."""

    token: int
    time_s: float
    label: str
    kind: str
    lines: tuple[pg.InfiniteLine, ...]


class LivePlots(QWidget):
    """KV-vs-token, memory-vs-time and predicted-vs-observed plots fed by ``add_samples``."""

    def __init__(self, theme: Theme | None = None, capacity: int = DEFAULT_CAPACITY, parent: QWidget | None = None):
        super().__init__(parent)
        self.theme = theme or make_theme("dark")
        self.tokens = RingBuffer(capacity, TOKEN_COLUMNS)
        self.times = RingBuffer(capacity, TIME_COLUMNS)
        self.readings = RingBuffer(capacity, READING_COLUMNS)
        # monotonic seconds (the probes' clock) of plot time 0; set by the window from the run's samples
        self.time_origin: float | None = None
        self.markers: list[Marker] = []
        #: Forward-pass peaks (prefill, re-runs): (token, observed, predicted) and their two scatter items.
        self.peak_points: list[tuple[int, int, int]] = []
        self.peak_items: list[pg.ScatterPlotItem] = []
        self.spikes: list[SpikeMark] = []
        self._curves: dict[str, _Curve] = {}
        self.host_only: bool | None = None  # None until the first sample says whether a GPU reports memory
        self.draws = 0
        self._range_budget: float = 1  # view range changes left in this frame (see redraw)
        self._ranges_pending = False
        self._frame_plots: set[int] = set()  # the plots this frame draws (see redraw)

        pg.setConfigOptions(antialias=False)  # antialiasing costs more than it buys at 30 Hz
        self.kv_widget = pg.PlotWidget(axisItems={"left": BytesAxis(orientation="left")})
        self.mem_widget = pg.PlotWidget(axisItems={"left": BytesAxis(orientation="left"),
                                                   "right": BytesAxis(orientation="right")})
        self.cmp_widget = pg.GraphicsLayoutWidget()
        self.kv_plot: pg.PlotItem = self.kv_widget.getPlotItem()
        self.mem_plot: pg.PlotItem = self.mem_widget.getPlotItem()
        self.total_plot: pg.PlotItem = self.cmp_widget.addPlot(row=0, col=0, axisItems={"left": BytesAxis(orientation="left")})
        self.error_plot: pg.PlotItem = self.cmp_widget.addPlot(row=1, col=0, axisItems={"left": SparseAxis("left")})
        self.cmp_widget.ci.layout.setRowStretchFactor(0, 3)
        self.cmp_widget.ci.layout.setRowStretchFactor(1, 2)
        self.error_plot.setXLink(self.total_plot)
        self.error_plot.getAxis("left").enableAutoSIPrefix(False)
        # A perfect prediction is a flat 0 %; keep at least +-1 % in view so it reads as flat.
        self.error_plot.getViewBox().setLimits(minYRange=2.0)

        self.all_plots = (self.kv_plot, self.mem_plot, self.total_plot, self.error_plot)
        for plot in self.all_plots:  # tokens and seconds are counts: never "token (x0.001)"
            plot.getAxis("bottom").enableAutoSIPrefix(False)
        self._empty_ranges()
        # Which of the three views (scenes Qt repaints separately) draws each plot; see redraw.
        # The KV cache on the memory plot has its own scale, on the right axis: a few MiB of cache are
        # invisible under hundreds of MiB of process memory on one axis (the CPU demo: ~450 MiB RSS).
        self.kv_view = pg.ViewBox(enableMouse=False)
        self.kv_view.setMenuEnabled(False)
        self.mem_plot.showAxis("right")
        self.mem_plot.scene().addItem(self.kv_view)
        self.mem_plot.getAxis("right").linkToView(self.kv_view)
        self.kv_view.setXLink(self.mem_plot)
        self.kv_view.setZValue(-1)
        self.mem_plot.getViewBox().sigResized.connect(
            lambda vb: self.kv_view.setGeometry(vb.sceneBoundingRect()))
        self.mem_plot.getAxis("right").enableAutoSIPrefix(False)
        self.kv_view.setYRange(0, 2**20, padding=0.0)
        # The quality probe's KL (this cache against a full-cache twin) beside the KV curve, on the KV plot's
        # right axis, shown once a sample carries it (the probe is off by default).
        self.quality_view = pg.ViewBox(enableMouse=False)
        self.quality_view.setMenuEnabled(False)
        self.kv_plot.scene().addItem(self.quality_view)
        self.kv_plot.getAxis("right").linkToView(self.quality_view)
        self.quality_view.setXLink(self.kv_plot)
        self.kv_plot.getViewBox().sigResized.connect(
            lambda vb: self.quality_view.setGeometry(vb.sceneBoundingRect()))
        self.quality_view.setYRange(0, 1, padding=0.0)
        self._view_of = {id(self.kv_plot): "kv", id(self.mem_plot): "mem", id(self.total_plot): "cmp",
                         id(self.error_plot): "cmp", id(self.kv_view): "mem", id(self.quality_view): "kv"}
        self._fresh: set[tuple[int, str]] = set()
        for plot in self.all_plots:
            # Ranges are set in steps by _fit_ranges (cheap frames); a live view is not panned by mouse.
            plot.disableAutoRange()
            plot.setMouseEnabled(x=False, y=False)
            plot.setMenuEnabled(False)
            plot.hideButtons()
            for side in ("left", "bottom"):
                # Ranges change in steps (see _fit_ranges), so an axis (ticks, labels, grid) is the same
                # picture for many frames: keep it as a pixmap instead of replaying its text each paint.
                plot.getAxis(side).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)

        # Legends in rows across the top: they cover less of the curves than a tall box.
        # The KV plot's legend sits bottom-right: its top-left corner is where the first switch marker's
        # label goes, and the KV line starts high on the left.
        # The two small predicted-vs-observed plots have no legend box (it hid the line it named): their
        # title and their error label name the curves in the curves' colours.
        # The memory plot's legend has its own row under the time axis: over the curves it covered the
        # process memory line near the top (and spike labels) on a short plot (1280x720, presenter mode).
        mem_legend = pg.LegendItem(colCount=4)
        self.mem_plot.layout.addItem(mem_legend, 4, 1)
        self._legends = {id(self.kv_plot): self.kv_plot.addLegend(offset=(-8, -4), colCount=4),
                         id(self.mem_plot): mem_legend, id(self.kv_view): mem_legend}
        self._legends[id(self.quality_view)] = self._legends[id(self.kv_plot)]
        self._build_curves()

        # The current slope, large, in the KV plot's corner: the number a speaker points at.
        self.slope_label = pg.LabelItem("", justify="right")
        self.slope_label.setParentItem(self.kv_plot.vb)
        self.slope_label.anchor(itemPos=(1, 0), parentPos=(1, 0), offset=(-12, 6))
        self.error_label = pg.LabelItem("", justify="right")
        self.error_label.setParentItem(self.error_plot.vb)
        self.error_label.anchor(itemPos=(1, 1), parentPos=(1, 1), offset=(-12, -4))
        # Capacity is a labelled horizontal line outside the auto-range: a small model on a big GPU
        # would otherwise flatten every other curve against zero.
        self.capacity_line = pg.InfiniteLine(movable=False, pos=0, angle=0, label="",
                                         labelOpts={"position": 0.5, "anchors": [(0.5, 1), (0.5, 1)]})
        self.capacity_line.setVisible(False)
        self.mem_plot.addItem(self.capacity_line, ignoreBounds=True)
        self.zero_line = pg.InfiniteLine(movable=False, pos=0, angle=0)
        self.error_plot.addItem(self.zero_line, ignoreBounds=True)
        self.slope_bytes_per_token: float | None = None
        self.tokens_cache = ""  # the cache strategy of the newest token (the slope label explains a quantized drop)

        self.kv_widget.setToolTip(
            "KV cache bytes after each token.\nSolid: measured, the bytes of the cache's K/V tensors "
            "(element size x elements, summed over layers).\nDashed: the predictor's bytes for the same "
            "token and settings.\nVertical lines: live switches of attention mode, kernel or cache.")
        self.mem_widget.setToolTip(
            "Memory over wall-clock time.\nDevice capacity (dashed line, when in view) and used: NVML (whole GPU).\nThis process: "
            "the process the model runs in (the engine), NVML per-process GPU memory, or its resident set (RSS) "
            "with no GPU.\nReserved / allocated: "
            "the torch caching allocator.\nKV share: the measured bytes of the KV cache.\nA missing curve means "
            "the hardware cannot report it (shown as n/a, never as 0).")
        self.cmp_widget.setToolTip(
            "Top: observed vs predicted total. Observed is the torch allocator's allocated bytes when the "
            "device has one,\notherwise the measured weights + KV tensors; the prediction is compared like "
            "with like.\nBottom: error in % of the prediction, per token, for the total and for the KV cache "
            "alone.")

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        bottom = QSplitter(Qt.Orientation.Horizontal)
        bottom.addWidget(self.mem_widget)
        bottom.addWidget(self.cmp_widget)
        self.splitter.addWidget(self.kv_widget)
        self.splitter.addWidget(bottom)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 2)
        layout.addWidget(self.splitter)
        for view in (self.kv_widget, self.mem_widget, self.cmp_widget):
            # Each view paints every pixel of itself (its background brush first): Qt need not repaint
            # the widgets underneath whenever a view updates.
            view.viewport().setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
            view.viewport().setAttribute(Qt.WidgetAttribute.WA_NoSystemBackground)
        self.apply_theme(self.theme)

    # ---------------------------------------------------------------------------------------------
    # construction

    def _add_curve(self, key: str, plot: pg.PlotItem, buffer: RingBuffer, x: str, y: str, name: str,
                   style: str = "solid", fill: bool = False, z: int = 0, color: str | None = None) -> None:
        # A bare curve item: the data arrive decimated (one min/max pair per pixel column, computed
        # incrementally), so PlotDataItem's per-frame downsampling, clipping and bounds passes over
        # the whole column would be pure cost.
        item = DeviceCurve()
        item.setZValue(z)
        item.setVisible(False)
        plot.addItem(item)
        view = self._view_of[id(plot)]
        self._curves[key] = _Curve(item, buffer, x, y, name, self._legends.get(id(plot)), PeakDecimator(buffer, x, y),
                                   view)
        item._kv_style = (color or key, style, fill)

    def _build_curves(self) -> None:
        t, m = self.tokens, self.times
        self._add_curve("kv_observed", self.kv_plot, t, "token", "kv_observed", "observed", z=1)
        self._add_curve("kv_predicted", self.kv_plot, t, "token", "kv_predicted", "predicted", "dash", z=2)
        # A runtime that reserves ahead (llama.cpp at load: flat, filled: the prepayment) and what the tokens hold.
        self._add_curve("kv_reserved", self.kv_plot, t, "token", "kv_reserved", "reserved", fill=True, z=0,
                        color="kv_share")
        self._add_curve("kv_used", self.kv_plot, t, "token", "kv_used", "used", z=3, color="allocated")
        # The previous live runs' KV curves (hold_previous), under this one: the last run dotted, the one before it
        # dash-dotted (three runtimes on one plot). Not decimated: they are fixed.
        self.previous_curve = pg.PlotDataItem()
        self.older_curve = pg.PlotDataItem()
        for item in (self.previous_curve, self.older_curve):
            item.setZValue(-2)
            item.setVisible(False)
            self.kv_plot.addItem(item)
        self._previous: list[tuple] = []  # (tokens, bytes, label), oldest first: at most two runs
        self._add_curve("device_used", self.mem_plot, m, "time", "device_used", "device used (NVML)")
        self._add_curve("process_gpu", self.mem_plot, m, "time", "process_gpu", "process (GPU)")
        self._add_curve("process_rss", self.mem_plot, m, "time", "process_rss", "process (RSS)")
        self._add_curve("reserved", self.mem_plot, m, "time", "reserved", "allocator reserved")
        self._add_curve("allocated", self.mem_plot, m, "time", "allocated", "allocator allocated")
        self._add_curve("weights", self.mem_plot, m, "time", "weights", "weights", "dot")
        self._add_curve("kv_share", self.kv_view, m, "time", "kv_share", "KV (right axis)", fill=True, z=-1)
        for key in SAMPLED:
            name = self._curves[key].name
            self._add_curve(f"sampled_{key}", self.mem_plot, self.readings, "time", key, name, color=key)
        self._add_curve("total_observed", self.total_plot, t, "token", "total_observed", "observed total", z=1)
        self._add_curve("total_predicted", self.total_plot, t, "token", "total_predicted", "predicted total",
                        "dash", z=2)
        self._add_curve("error_total", self.error_plot, t, "token", "error_total", "total error %")
        self._add_curve("error_kv", self.error_plot, t, "token", "error_kv", "KV error %", "dash")
        self._add_curve("quality_kl", self.quality_view, t, "token", "quality_kl", "KL vs full cache (right, nats)",
                        "dot", color="error_total")

    def apply_theme(self, theme: Theme) -> None:
        """Restyle backgrounds, axes, pens and labels (dark, light, presenter)."""
        self.theme = theme
        self._fresh = set()
        axis_font = QFont()
        axis_font.setPointSize(theme.axis_pt)
        title_size = f"{theme.title_pt}pt"
        titles = {
            id(self.kv_plot): "KV cache vs token",
            id(self.mem_plot): self._memory_title(),
            id(self.total_plot): (f"Total: <span style='color:{theme.curves['total_observed']}'>observed</span> vs "
                                  f"<span style='color:{theme.curves['total_predicted']}'>predicted</span>"),
            id(self.error_plot): "",
        }
        for widget in (self.kv_widget, self.mem_widget, self.cmp_widget):
            widget.setBackground(theme.background)
        for plot in self.all_plots:
            for side in ("left", "bottom"):
                axis = plot.getAxis(side)
                axis.setTickFont(axis_font)
                axis.setTextPen(theme.muted)
                axis.setStyle(tickTextOffset=6, tickLength=-6)
            # A fixed axis width: tick labels that change width would re-lay out the plot every frame.
            plot.getAxis("left").setWidth(int(theme.axis_pt * 8))
            # No grid lines on the live plots: pyqtgraph draws them as part of each axis picture,
            # replayed at every frame, and they halve the frame rate (benchmarks/plot_fps.py).
            # Ticks and the stepped ranges carry the scale; the calculator's static chart keeps its grid.
            axis_pen = _mix(theme.background, theme.text, 0.35)
            for side in ("left", "bottom"):
                plot.getAxis(side).setPen(axis_pen)
            plot.showGrid(x=False, y=False)
            title = titles[id(plot)]
            plot.setTitle(title, color=theme.text, size=title_size) if title else plot.setTitle(None)
            legend = self._legends.get(id(plot))
            if legend is None:
                continue
            legend.setLabelTextColor(theme.text)
            legend.setLabelTextSize(f"{max(theme.font_pt - 1, 8)}pt")
            legend.setBrush(pg.mkBrush(QColor(theme.background).lighter(115 if theme.name == "dark" else 97)))
            legend.setPen(pg.mkPen(theme.border))
        # The KV cache's own scale on the memory plot, and the KL's on the KV plot, each in its curve's colour.
        for right, key in ((self.mem_plot.getAxis("right"), "kv_share"), (self.kv_plot.getAxis("right"), "error_total")):
            right.setTickFont(axis_font)
            right.setTextPen(theme.curves.get(key, theme.text))
            right.setPen(_mix(theme.background, theme.curves.get(key, theme.text), 0.6))
            right.setStyle(tickTextOffset=6, tickLength=-6)
            right.setWidth(int(theme.axis_pt * 8))
        label_style = {"color": theme.muted, "font-size": f"{theme.axis_pt}pt"}
        self.kv_plot.setLabel("bottom", "token", **label_style)
        self.mem_plot.setLabel("bottom", "time (s)", **label_style)
        self.error_plot.setLabel("bottom", "token", **label_style)
        self.error_plot.setLabel("left", "error %", **label_style)
        self.total_plot.getAxis("bottom").setStyle(showValues=False)
        self.zero_line.setPen(pg.mkPen(theme.muted, width=1, style=Qt.PenStyle.DotLine))
        self.capacity_line.setPen(pg.mkPen(theme.curves["device_total"], width=theme.marker_width,
                                           style=Qt.PenStyle.DashLine))
        if self.capacity_line.label is not None:
            self.capacity_line.label.setColor(theme.curves["device_total"])
            font = QFont()
            font.setPointSize(max(theme.font_pt - 1, 8))
            self.capacity_line.label.setFont(font)
        for name, curve in self._curves.items():
            key, style, fill = curve.item._kv_style
            # Observed is drawn wide and predicted dashed and narrower on top, so a perfect prediction
            # reads as a dashed line running inside the observed one rather than hiding it.
            wide = ("kv_observed", "total_observed", "kv_reserved", "kv_used")
            width = theme.line_width * (2.2 if key in wide or name in wide else 1.0)
            curve.item.setPen(pg.mkPen(**theme.pen(key, style, width)))
            if fill:
                color = QColor(theme.curves.get(key, theme.text))
                color.setAlpha(70)
                curve.item.setFillLevel(0)
                curve.item.setBrush(pg.mkBrush(color))
            # Legend samples are created once; rebuild them so their pens follow the theme.
            if curve.in_legend and curve.legend is not None:
                curve.legend.removeItem(curve.item)
                curve.legend.addItem(curve.item, curve.name)
        if hasattr(self, "previous_curve"):
            self.previous_curve.setPen(pg.mkPen(theme.text, width=theme.line_width * 1.6, style=Qt.PenStyle.DotLine))
            self.older_curve.setPen(pg.mkPen(theme.accent, width=theme.line_width * 1.6, style=Qt.PenStyle.DashDotLine))
            if self._previous:
                self._show_previous()  # its legend sample follows the theme too
        for marker in self.markers:
            self._style_marker(marker)
        for mark in self.spikes:
            self._style_spike(mark)
        self._refresh_labels()

    def _memory_title(self) -> str:
        if self.host_only:
            return f"Memory <span style='color:{self.theme.warning}'>\u00b7 no GPU</span>"
        return "Memory vs time"

    # ---------------------------------------------------------------------------------------------
    # data in

    def hold_previous(self, label: str) -> bool:
        """Keep this run's KV curve (observed, or what llama.cpp reserved) to draw, dotted, under the next run:
        a transformers run's growing cache beside a llama.cpp run's prepayment of the same model, or two
        settings side by side. False if there is no curve to keep. ``reset`` keeps it; ``drop_previous`` ends it."""
        tokens = self.tokens.column("token")
        # What the runtime set aside where it reserved ahead (llama.cpp's context, MLX's 256-token steps), else
        # the one observed figure (transformers): the curve each runtime is known by.
        reserved, observed = self.tokens.column("kv_reserved"), self.tokens.column("kv_observed")
        if len(tokens):
            y = np.where(np.isfinite(reserved), reserved, observed)
            ok = np.isfinite(y)
            if ok.any():
                # A run of the same label replaces its older curve; the two latest runs stay (three on the plot).
                kept = [p for p in self._previous if p[2] != label]
                self._previous = (kept + [(tokens[ok].astype(float), y[ok].astype(float), label)])[-2:]
                return True
        return False

    def drop_previous(self) -> None:
        self._previous = []
        self._show_previous()

    @property
    def previous_label(self) -> str | None:
        return self._previous[-1][2] if getattr(self, "_previous", None) else None

    @property
    def previous_labels(self) -> list[str]:
        """The held runs' labels, the latest last."""
        return [p[2] for p in getattr(self, "_previous", [])]

    def _show_previous(self) -> None:
        legend = self._legends[id(self.kv_plot)]
        held = list(getattr(self, "_previous", []))
        items = (self.older_curve, self.previous_curve) if len(held) > 1 else (self.previous_curve,)
        for item in (self.previous_curve, self.older_curve):
            legend.removeItem(item)
            if item not in items:
                item.setData([], [])
                item.setVisible(False)
        for item, previous in zip(items, held):
            x, y, label = previous
            item.setData(x, y)
            item.setVisible(True)
            legend.addItem(item, label)
        if not held:
            self.previous_curve.setData([], [])
            self.previous_curve.setVisible(False)

    def reset(self) -> None:
        """Forget everything (a new run) but the previous run's curve, if one is held (``hold_previous``)."""
        self.capacity_line.setVisible(False)
        self.capacity_line.setValue(0)
        self.tokens.clear()
        self.times.clear()
        self.readings.clear()
        self.time_origin = None
        for mark in self.spikes:
            for item in mark.items:
                self.mem_plot.removeItem(item)
        self.spikes.clear()
        for marker in self.markers:
            for plot, line in zip((self.kv_plot, self.mem_plot, self.total_plot, self.error_plot), marker.lines):
                plot.removeItem(line)
        self.markers.clear()
        self.peak_points.clear()
        for item in self.peak_items:
            item.setData([])
        self._fresh.clear()
        self.host_only = None
        self.slope_bytes_per_token = None
        self.kv_plot.hideAxis("right")
        for curve in self._curves.values():
            curve.item.setData([], [])
            curve.item.setVisible(False)
            if curve.in_legend and curve.legend is not None:
                curve.legend.removeItem(curve.item)
            curve.in_legend = False
            curve.drawn_version = None
            curve.y_range = None
        self._empty_ranges()
        self.apply_theme(self.theme)
        self._show_previous()

    def _empty_ranges(self) -> None:
        """Axes that read as a run about to start (0-256 tokens, 0-1 MiB, 0-60 s), not pyqtgraph's 0-1."""
        for plot, (x, y) in ((self.kv_plot, (256, 2**20)), (self.mem_plot, (60, 2**30)),
                             (self.total_plot, (256, 2**20)), (self.error_plot, (256, None))):
            plot.setXRange(0, x, padding=0.0)
            if y is not None:
                plot.setYRange(0, y, padding=0.0)
        if hasattr(self, "kv_view"):
            self.kv_view.setYRange(0, 2**20, padding=0.0)

    def add_samples(self, samples: list[Sample]) -> None:
        """Append a batch of samples (any rate; drawing happens in ``redraw``)."""
        token_rows: list[dict] = []
        time_rows: list[dict] = []
        for s in samples:
            peaks = forward_peak_totals(s)  # a prefill or a switch's re-run: its forward pass's peak, both ways
            if peaks is not None:
                self._add_peak(max(int(s.token), 0), *peaks)
            if s.phase == PHASE_EVENT:
                if s.event in ("switch", "error", "oom", "budget"):
                    self._add_marker(s)
                continue
            total_obs, total_pred = comparable_totals(s)
            self.tokens_cache = s.cache
            # A runtime that set more aside than the tokens hold (llama.cpp's context, reserved at load) gets two
            # curves, reserved (filled) and used; one that reserves nothing ahead, the one observed curve.
            ahead = s.kv_bytes_reserved is not None and s.kv_bytes_held is not None and s.kv_bytes_reserved != s.kv_bytes_held
            token_rows.append({
                "token": s.token,
                "kv_observed": None if ahead else s.kv_bytes_held,
                "kv_reserved": s.kv_bytes_reserved if ahead else None,
                "kv_used": s.kv_bytes_held if ahead else None,
                "kv_predicted": s.kv_bytes_predicted,
                "total_observed": total_obs,
                "total_predicted": total_pred,
                "error_total": error_percent(total_obs, total_pred),
                "error_kv": error_percent(s.kv_bytes_reserved, s.kv_bytes_predicted),
                "quality_kl": s.quality_kl,
            })
            if s.quality_kl is not None and not self.kv_plot.getAxis("right").isVisible():
                self.kv_plot.showAxis("right")
            time_rows.append({
                "time": s.time_s,
                "device_total": s.device_total,
                "device_used": s.device_used,
                "process_gpu": s.process_gpu,
                "process_rss": None if (s.device_total is not None or s.process_gpu is not None) else s.process_rss,
                "reserved": s.allocator_reserved,
                "allocated": s.allocator_allocated,
                "kv_share": s.kv_bytes_observed,
                "weights": s.weights_bytes,
            })
            gpu = s.device_total is not None or s.process_gpu is not None or s.allocator_reserved is not None
            if self.host_only is None or (self.host_only and gpu):
                self.host_only = not gpu
                self.mem_plot.setTitle(self._memory_title(), color=self.theme.text, size=f"{self.theme.title_pt}pt")
                self._refresh_labels()
        self.tokens.extend(token_rows)
        self.times.extend(time_rows)

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
        last = self.readings.last("time")
        rows = []
        for r in readings:
            t = r.time_s - origin
            if last is not None and t <= last:
                continue  # a reading already shown (or out of order): the axis must increase
            last = t
            gpu = r.device_total is not None or r.process_gpu is not None or r.allocator_reserved is not None
            rows.append({
                "time": t,
                "device_total": r.device_total,
                "device_used": r.device_used,
                "process_gpu": r.process_gpu,
                # RSS is the process's memory only without a GPU; with one it would dwarf nothing useful
                "process_rss": None if (r.device_total is not None or r.process_gpu is not None) else r.process_rss,
                "reserved": r.allocator_reserved,
                "allocated": r.allocator_allocated,
            })
            if self.host_only is None or (self.host_only and gpu):
                self.host_only = not gpu
                self.mem_plot.setTitle(self._memory_title(), color=self.theme.text, size=f"{self.theme.title_pt}pt")
        self.readings.extend(rows)
        return len(rows)

    def add_spike(self, time_s: float, after: int, rise: int, cause: str = "") -> SpikeMark:
        """Mark a spike on the memory plot at ``time_s`` (plot seconds): a triangle at ``after`` bytes, '+rise'."""
        point = pg.ScatterPlotItem([time_s], [after], symbol="t1", size=14)
        # Beside the triangle, not above it: above is where the legend rows are.
        text = pg.TextItem(f"+{format_bytes(rise)}", anchor=(-0.15, 0.5))
        text.setPos(time_s, after)
        line = pg.InfiniteLine(movable=False, pos=time_s, angle=90)
        for item in (line, point, text):
            item.setZValue(5)
            self.mem_plot.addItem(item, ignoreBounds=True)
        point.setToolTip(f"spike +{format_bytes(rise)}: {cause}")
        mark = SpikeMark(time_s, int(after), int(rise), cause, (line, point, text))
        self._style_spike(mark)
        self.spikes.append(mark)
        if len(self.spikes) > MAX_MARKS:
            self._remove_marks(self.spikes.pop(0).items, (self.mem_plot,) * 3)
        return mark

    def declutter_spike_labels(self) -> int:
        """Show a spike's '+size' label only where it fits: the largest spikes first, each label where
        no other shown label is within its width (in pixels at the current zoom). The triangles and
        lines all stay; a hidden label's size is in the triangle's tooltip and the events table.
        Returns the labels shown."""
        view = self.mem_plot.getViewBox()
        (x0, x1), _ = view.viewRange()
        width_px = max(view.width(), 1.0)
        per_px = (x1 - x0) / width_px if x1 > x0 else 0.0
        char_px = 0.62 * max(self.theme.font_pt - 1, 8) * 96 / 72
        taken: list[tuple[float, float]] = []
        shown = 0
        for mark in sorted(self.spikes, key=lambda m: -m.rise):
            text = mark.items[2]
            left = mark.time_s
            right = left + (len(text.toPlainText()) + 2) * char_px * per_px
            fits = per_px > 0 and x0 <= left <= x1 and all(right < a or left > b for a, b in taken)
            if fits:
                taken.append((left - 8 * per_px, right))
                shown += 1
            if text.isVisible() != fits:
                text.setVisible(fits)
        return shown

    #: Heights (fractions of the KV plot, top down) a switch marker's label may take.
    MARKER_ROWS = (0.93, 0.81, 0.69, 0.57, 0.45, 0.33)

    def declutter_marker_labels(self) -> int:
        """Place the switch markers' labels so that none prints over another, the slope label or the legend:
        each (in token order) at the highest row of ``MARKER_ROWS`` where its rectangle meets nothing placed;
        where no row is free it is hidden and its text joins the tooltip of the label before it (its line stays,
        and the events table lists it). Measured in the scene, at the current zoom and size. Returns the labels
        shown (-1: nothing moved since the last placement)."""
        view = self.kv_plot.getViewBox()
        (x0, x1), _ = view.viewRange()
        key = (x0, x1, view.width(), view.height(), len(self.markers), self.markers[-1].token if self.markers else None,
               self.slope_label.sceneBoundingRect().getRect())
        if key == getattr(self, "_marker_layout_key", None):
            return -1  # nothing moved since the last placement
        self._marker_layout_key = key
        taken = [item.sceneBoundingRect() for item in (self.slope_label, self._legends.get(id(self.kv_plot)))
                 if item is not None and item.isVisible() and item.sceneBoundingRect().width() > 0]
        shown, last = 0, None
        for marker in sorted(self.markers, key=lambda m: m.token):
            label = marker.lines[0].label
            if label is None:
                continue
            label.setToolTip(marker.label)
            if not x0 <= marker.token <= x1:
                label.setVisible(False)
                continue
            spot = None
            label.setVisible(True)  # a hidden label measures a few px tall: measure it as it is shown
            for row in self.MARKER_ROWS:
                label.setPosition(row)
                label.updateTransform(force=True)  # else its rectangle is the one of its last paint
                rect = label.sceneBoundingRect().adjusted(-2, -1, 2, 1)
                if not any(rect.intersects(other) for other in taken):
                    spot = rect
                    break
            label.setVisible(spot is not None)
            if spot is None:
                if last is not None:  # said by the label before: '+N' and the names in its tooltip
                    last[1].append(marker.label)
                continue
            taken.append(spot)
            shown += 1
            last = (label, [marker.label])
            label.more = last[1]
        for marker in self.markers:
            label = marker.lines[0].label
            more = getattr(label, "more", None) if label is not None else None
            if more and len(more) > 1:
                label.setToolTip("\n".join(more))  # the switches whose labels had no room beside it
        return shown

    def _style_spike(self, mark: SpikeMark) -> None:
        t = self.theme
        line, point, text = mark.items
        line.setPen(pg.mkPen(t.warning, width=max(t.marker_width - 0.5, 1.0), style=Qt.PenStyle.DotLine))
        point.setBrush(pg.mkBrush(t.warning))
        point.setPen(pg.mkPen(t.background, width=1))
        point.setSize(14 if not t.presenter else 22)
        text.setColor(t.warning)
        font = QFont()
        font.setPointSize(max(t.font_pt - 1, 8))
        font.setBold(True)
        text.setFont(font)

    def _add_peak(self, token: int, observed: int, predicted: int) -> None:
        """Mark a forward pass's peak on the Total plot: weights + the allocator's peak (a filled circle) and
        weights + the replayed prediction (a hollow diamond), at the token of the prefill or re-run."""
        if not self.peak_items:
            t = self.theme
            observed_item = pg.ScatterPlotItem(size=11, symbol="o", pen=pg.mkPen(t.curves["total_observed"]),
                                               brush=pg.mkBrush(t.curves["total_observed"]), name="peak observed")
            predicted_item = pg.ScatterPlotItem(size=13, symbol="d", pen=pg.mkPen(t.curves["total_predicted"], width=2),
                                                brush=pg.mkBrush(None), name="peak predicted")
            for item in (observed_item, predicted_item):
                item.setZValue(5)
                self.total_plot.addItem(item)
            self.peak_items = [observed_item, predicted_item]
        self.peak_points.append((token, observed, predicted))
        del self.peak_points[:-MAX_MARKS]
        xs = [float(x) for x, _, _ in self.peak_points]
        self.peak_items[0].setData(xs, [float(o) for _, o, _ in self.peak_points])
        self.peak_items[1].setData(xs, [float(p) for _, _, p in self.peak_points])

    def _add_marker(self, s: Sample) -> None:
        label = marker_label(s, MARK_LABEL_CHARS)  # the session's rule: the plot only draws it
        token = max(int(s.token), 0)
        # Stagger labels of neighbouring markers so they do not print over each other.
        position = (0.93, 0.80, 0.67)[len(self.markers) % 3]
        # pyqtgraph formats a line's label with str.format(value=...): braces from a recording
        # ("d}namic") would raise, so they are doubled.
        kv_line = pg.InfiniteLine(movable=False, pos=token, angle=90,
                                  label=label.replace("{", "{{").replace("}", "}}"),
                                  labelOpts={"position": position, "anchors": [(0, 0.5), (0, 0.5)]})
        mem_line = pg.InfiniteLine(movable=False, pos=s.time_s, angle=90)
        tot_line = pg.InfiniteLine(movable=False, pos=token, angle=90)
        err_line = pg.InfiniteLine(movable=False, pos=token, angle=90)
        for plot, line in ((self.kv_plot, kv_line), (self.mem_plot, mem_line), (self.total_plot, tot_line),
                           (self.error_plot, err_line)):
            plot.addItem(line, ignoreBounds=True)
        marker = Marker(token, s.time_s, label, s.event or "switch", (kv_line, mem_line, tot_line, err_line))
        self._style_marker(marker)
        self.markers.append(marker)
        if len(self.markers) > MAX_MARKS:
            self._remove_marks(self.markers.pop(0).lines, (self.kv_plot, self.mem_plot, self.total_plot,
                                                           self.error_plot))

    @staticmethod
    def _remove_marks(items, plots) -> None:
        for plot, item in zip(plots, items):
            plot.removeItem(item)

    def _style_marker(self, marker: Marker) -> None:
        t = self.theme
        color = t.error if marker.kind in ("error", "oom", "budget") else t.curves["marker"]
        for line in marker.lines:
            line.setPen(pg.mkPen(color, width=t.marker_width, style=Qt.PenStyle.DashLine))
        kv_line = marker.lines[0]
        if kv_line.label is not None:
            kv_line.label.setColor(color)
            font = QFont()
            font.setPointSize(t.font_pt)
            font.setBold(True)
            kv_line.label.setFont(font)
            kv_line.label.fill = pg.mkBrush(QColor(t.background))
            kv_line.label.border = pg.mkPen(color)

    # ---------------------------------------------------------------------------------------------
    # drawing

    def redraw(self, settle: bool = True) -> int:
        """Push changed buffers to their curves and fit the view ranges. Returns curves updated.

        ``settle`` (the default) draws every view now. The window's fixed-rate timer passes False, for
        frame pacing, so that no one frame keeps the UI thread long: the KV view updates at every
        call, the memory and predicted-vs-observed views at every other call, in turn (each view is a
        scene Qt repaints separately); at most one view range changes per call (a change re-renders
        axes). What waits is drawn on the next call.
        """
        updated = 0
        superseded = SAMPLED if len(self.readings) else ()
        views = {"kv", "mem", "cmp"} if settle else {"kv", ("mem", "cmp")[self.draws % 2]}
        self._frame_plots = {key for key, view in self._view_of.items() if view in views}
        for key, curve in self._curves.items():
            if curve.view not in views:
                continue
            if key in superseded:
                if curve.item.isVisible() or curve.in_legend:
                    curve.item.setVisible(False)
                    if curve.in_legend and curve.legend is not None:
                        curve.legend.removeItem(curve.item)
                    curve.in_legend = False
                    updated += 1
                curve.drawn_version = None
                curve.y_range = None
                continue
            # One bin per pixel column of the plot (min and max: two points each), or per pen width
            # for lines wider than 2 px: a wide line cannot show anything narrower than itself.
            view = curve.item.getViewBox()
            px = view.width() if view is not None else 1000.0
            bins = max(int(px / max(1.0, curve.item.opts["pen"].widthF() / 2.0)), 100)
            if curve.drawn_version == (curve.buffer.version, bins):
                continue
            curve.drawn_version = (curve.buffer.version, bins)
            x, y = curve.decimator.data(bins)
            finite = ~np.isnan(y)
            if len(y) == 0 or not finite.any():
                curve.item.setVisible(False)
                curve.y_range = None
                continue
            curve.y_range = (float(np.nanmin(y)), float(np.nanmax(y)))
            if finite.all():
                curve.item.setData(x, y, skipFiniteCheck=True, connect="all")
            else:
                # Gaps are "not available" moments: draw them as gaps, never as zeros.
                curve.item.setData(x, y, skipFiniteCheck=False, connect="finite")
            curve.item.setVisible(True)
            if not curve.in_legend and curve.legend is not None:
                curve.legend.addItem(curve.item, curve.name)
                curve.in_legend = True
            updated += 1
        capacity = self.readings.last("device_total") or self.times.last("device_total")
        if capacity is not None and self.capacity_line.value() != capacity:
            self.capacity_line.setValue(capacity)
            self.capacity_line.label.setFormat(f"device capacity {format_bytes(capacity)}")
            self.capacity_line.setVisible(True)
        if updated or self._ranges_pending or settle:
            self._range_budget = math.inf if settle else 1
            self._ranges_pending = False
            self._fit_ranges()
            self.declutter_spike_labels()
            self.declutter_marker_labels()
        if updated:
            self.slope_bytes_per_token = self._slope()
            self._refresh_labels()
        self.draws += 1
        return updated

    def _fit_ranges(self) -> None:
        """Set every view range ourselves, in steps, instead of pyqtgraph's per-frame auto-range.

        A range that changes every frame makes every axis regenerate its ticks and pictures at
        30 Hz, which costs more than drawing the curves. Ranges here grow in steps (``GROW``) and
        only change when the data leaves them, so most frames repaint curves only. The KV plot's
        top keeps room for its legend row.
        """
        tok = self.tokens.column("token")
        if len(tok):
            self._set_x(self.kv_plot, float(tok[0]), float(tok[-1]))
            self._set_x(self.total_plot, float(tok[0]), float(tok[-1]))
        ends = [(float(c[0]), float(c[-1])) for c in (self.times.column("time"), self.readings.column("time"))
                if len(c)]
        if ends:
            self._set_x(self.mem_plot, min(e[0] for e in ends), max(e[1] for e in ends))
        kv_top = self._top(("kv_observed", "kv_predicted", "kv_reserved", "kv_used"))
        if kv_top is not None and self._previous:  # the held runs' curves fit too
            kv_top = max([kv_top] + [float(p[1].max()) for p in self._previous])
        if kv_top is not None:
            self._set_y(self.kv_plot, 0.0, kv_top, 1.15)
        mem_top = self._top(("device_used", "process_gpu", "process_rss", "reserved", "allocated", "weights")
                            + tuple(f"sampled_{key}" for key in SAMPLED))
        if mem_top is not None:
            self._set_y(self.mem_plot, 0.0, mem_top, 1.2)  # room for the spike labels above the peaks
        kv_share_top = self._top(("kv_share",))
        if kv_share_top is not None:
            self._set_y(self.kv_view, 0.0, kv_share_top, 1.2)
        hi = self._top(("total_observed", "total_predicted"))
        lo = self._bottom(("total_observed", "total_predicted"))
        if self.peak_points and hi is not None:
            hi = max(hi, max(max(o, p) for _, o, p in self.peak_points))
        if hi is not None and lo is not None:
            span = max(hi - lo, hi * 0.02, 1.0)
            self._set_y(self.total_plot, max(lo - 0.05 * span, 0.0), lo + span, 1.15, base=lo)
        kl_top = self._top(("quality_kl",))
        if kl_top is not None:
            self._set_y(self.quality_view, 0.0, max(kl_top, 0.1), 1.2)
        err = self._top_abs(("error_total", "error_kv"))
        if err is not None:
            self._set_y(self.error_plot, None, max(err, 0.5), 1.3)

    def _ranges(self, keys: tuple[str, ...]) -> list[tuple[float, float]]:
        return [r for r in (self._curves[k].y_range for k in keys) if r is not None]

    def _top(self, keys: tuple[str, ...]) -> float | None:
        """Largest value drawn by any of these curves (decimation keeps every bin's maximum)."""
        ranges = self._ranges(keys)
        return max(r[1] for r in ranges) if ranges else None

    def _bottom(self, keys: tuple[str, ...]) -> float | None:
        ranges = self._ranges(keys)
        return min(r[0] for r in ranges) if ranges else None

    def _top_abs(self, keys: tuple[str, ...]) -> float | None:
        ranges = self._ranges(keys)
        return max(max(abs(r[0]), abs(r[1])) for r in ranges) if ranges else None

    def _may_change_range(self, plot: pg.PlotItem) -> bool:
        """One range change per frame, of a view drawn this frame: True (and spent) when allowed."""
        if self._range_budget <= 0 or id(plot) not in self._frame_plots:
            self._ranges_pending = True
            return False
        self._range_budget -= 1
        return True

    def _set_x(self, plot: pg.PlotItem, first: float, last: float) -> None:
        lo, hi = _view(plot).viewRange()[0]
        if last > hi or first < lo or (hi - first) > 4 * max(last - first, 1.0) or self._stale(plot, "x"):
            if not self._may_change_range(plot):
                self._fresh.discard((id(plot), "x"))  # (if it was stale, it still is: ask again next frame)
                return
            width = max(last - first, 1.0)
            plot.setXRange(first, first + width * GROW + 1.0, padding=0.0)

    def _set_y(self, plot: pg.PlotItem, bottom: float | None, top: float, headroom: float,
               base: float | None = None) -> None:
        """y range [bottom, top x headroom] (symmetric around 0 when bottom is None), with hysteresis."""
        lo, hi = _view(plot).viewRange()[1]
        origin = base if base is not None else (bottom or 0.0)
        want_hi = origin + (top - origin) * headroom
        if bottom is None:
            if top > hi or top < 0.4 * hi or self._stale(plot, "y"):
                if self._may_change_range(plot):
                    plot.setYRange(-top * headroom, top * headroom, padding=0.0)
                else:
                    self._fresh.discard((id(plot), "y"))
            return
        used = hi - lo
        if top > hi or bottom < lo or (top - bottom) < 0.45 * used or self._stale(plot, "y"):
            if top > hi and hi > lo:  # growing: a step big enough that the next one is a while off
                want_hi = origin + (top - origin) * headroom * GROW / 1.25
            if self._may_change_range(plot):
                plot.setYRange(bottom, want_hi, padding=0.0)
            else:
                self._fresh.discard((id(plot), "y"))

    def _stale(self, plot: pg.PlotItem, axis: str) -> bool:
        """True once per plot axis after a reset or theme change (its range belongs to old data)."""
        if (id(plot), axis) in self._fresh:
            return False
        self._fresh.add((id(plot), axis))
        return True

    def curve_data(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """The (x, y) a curve currently shows (for tests and exports)."""
        x, y = self._curves[key].item.getData()
        return (np.asarray([]) if x is None else x), (np.asarray([]) if y is None else y)

    #: What ``export_plot`` can write: the KV plot, the memory plot, the predicted-vs-observed pair.
    EXPORTABLE = ("kv", "memory", "compare")

    def export_plot(self, which: str, path: str) -> str:
        """Write one plot to ``path`` with pyqtgraph's exporters: PNG (twice the on-screen size) or SVG."""
        import pyqtgraph.exporters as exporters

        item = {"kv": self.kv_plot, "memory": self.mem_plot, "compare": self.cmp_widget.ci}.get(which)
        if item is None:
            raise ValueError(f"unknown plot {which!r}; choose one of {', '.join(self.EXPORTABLE)}")
        if str(path).lower().endswith(".svg"):
            if which == "memory":  # its KV scale is a view box of its own in the scene: render the scene
                self._svg_with_qt(item, str(path))
                return str(path)
            try:
                exporters.SVGExporter(item).export(str(path))
            except (ValueError, IndexError):
                # pyqtgraph 0.14's SVG post-processing cannot parse the path data Qt 6.11's SVG
                # generator writes ("x,y" pairs expected); Qt's own generator gives the same vector
                # picture without that step.
                self._svg_with_qt(item, str(path))
            return str(path)
        else:
            exporter = exporters.ImageExporter(item)
            # Twice the screen size: sharp on a slide. Integer sizes (pyqtgraph rounds floats badly).
            width = max(int(item.sceneBoundingRect().width() * 2), 400)
            exporter.parameters()["width"] = width
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

    def curve_visible(self, key: str) -> bool:
        return self._curves[key].item.isVisible()

    def _slope(self, window: int = 32) -> float | None:
        """Bytes per token over the last ``window`` tokens since the last switch (a step is not a slope)."""
        # The newest rows only: tokens increase, so the last `window` after the marker are among them.
        tok = self.tokens.column("token")[-4 * window:]
        kv = self.tokens.column("kv_observed")[-4 * window:]
        if len(tok) < 2:
            return None
        since = self.markers[-1].token if self.markers else -math.inf
        idx = np.flatnonzero((tok > since) & ~np.isnan(kv))
        if idx.size < 2:
            return None
        idx = idx[-window:]
        dt = tok[idx[-1]] - tok[idx[0]]
        if dt <= 0:
            return None
        return float((kv[idx[-1]] - kv[idx[0]]) / dt)

    def _refresh_labels(self) -> None:
        t = self.theme
        size = f"{t.title_pt + 2}pt"
        slope = "" if self.slope_bytes_per_token is None else format_slope(self.slope_bytes_per_token)
        if (self.slope_bytes_per_token or 0) < 0 and self.tokens_cache.startswith("quantized"):
            slope = "\u2193 residual quantized"  # the flush, not a shrinking cache: said in words
        err = self.tokens.last("error_kv")
        tot = self.tokens.last("error_total")
        parts = []  # coloured like their curves: this label is the error plot's legend
        if err is not None:
            parts.append(f"<span style='color:{t.curves['error_kv']}'>KV {err:+.2f}%</span>")
        if tot is not None:
            parts.append(f"<span style='color:{t.curves['error_total']}'>total {tot:+.2f}%</span>")
        errors = "&nbsp;&nbsp;&nbsp;".join(parts)
        # Re-laying out rich text is costly; only touch a label whose text or look changed.
        key = (slope, errors, t)
        if key == getattr(self, "_labels_key", None):
            return
        self._labels_key = key
        self.slope_label.setText(slope, color=t.curves["kv_observed"], size=size, bold=True)
        self.error_label.setText(errors, color=t.text, size=f"{t.font_pt}pt", bold=True)


def _view(plot: pg.PlotItem | pg.ViewBox) -> pg.ViewBox:
    """The view box of a plot (a bare view box, such as the memory plot's KV scale, is its own)."""
    return plot if isinstance(plot, pg.ViewBox) else plot.getViewBox()


def _mix(a: str, b: str, t: float) -> QColor:
    """Colour t of the way from a to b (opaque)."""
    ca, cb = QColor(a), QColor(b)
    return QColor(round(ca.red() + (cb.red() - ca.red()) * t), round(ca.green() + (cb.green() - ca.green()) * t),
                  round(ca.blue() + (cb.blue() - ca.blue()) * t))

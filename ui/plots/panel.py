"""What every live plot does the same way: a view of its own, decimated curves, stepped ranges, switch
markers, a header and a legend row outside the data, and type that fits the panel.

A panel (``PlotPanel``) is one ``GraphicsLayoutWidget``, one scene Qt repaints on its own, laid out top down:
a header row (the title, and a readout such as the slope, which wraps under the title where the two do not
fit side by side), one or more plot items, and a legend row under them. Nothing but curves and markers is
drawn inside a plot's data area, so no legend or readout ever covers the live line. The type is the theme's
(presenter mode: large) where the panel has room for it, and steps down a point at a time where the title,
the axes, the legend or the plots' minimum heights would not fit: nothing is clipped at 1024x768.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QColor, QFont, QFontMetricsF
from PySide6.QtWidgets import QGraphicsItem, QSizePolicy

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import SparseAxis
from kvscope.ui.curves import DeviceCurve
from kvscope.ui.decimate import PeakDecimator
from kvscope.ui.ringbuffer import RingBuffer
from kvscope.ui.theme import Theme

#: A view range that the data outgrows grows by this factor: each change re-renders the axes (the
#: costliest frames), so few big steps beat many small ones. The data then fills 2/3 to all of it.
GROW = 1.5
#: Switch markers and spike marks kept on the plots (the newest; older ones are removed): each is a
#: few graphics items every frame draws and every new item re-bounds, so a recording with thousands
#: of switches made each sample slower than the last (2,000 took 100 s to replay).
MAX_MARKS = 200
#: The widest tick label a bytes axis is sized for (its width is fixed: a width that follows the labels
#: would re-lay out the plot at every range step).
BYTES_TICK_SAMPLE = "888.8 MiB"
#: Room around the panel's items (px): the layout's margins and spacing.
MARGIN = 4


@dataclass
class Curve:
    """One decimated curve: its item, the ring buffer and columns it draws, its legend entry."""

    item: DeviceCurve
    buffer: RingBuffer
    x: str
    y: str
    name: str
    decimator: PeakDecimator
    style: tuple[str, str, bool]  # (colour key, line style, filled)
    legend: bool = True  # named in the panel's legend row
    in_legend: bool = False
    drawn_version: tuple[int, int] | None = None  # (buffer version, bins) last drawn
    y_range: tuple[float, float] | None = None  # min and max of what is drawn (None: nothing)


@dataclass
class Marker:
    """A switch (or load/error) marked on the plots: one vertical line per plot item, the first labelled."""

    token: int
    time_s: float
    label: str
    kind: str
    lines: tuple[pg.InfiniteLine, ...]
    owners: tuple = ()  # the plot item (or view box) of each line, to remove it


@dataclass(frozen=True)
class PlotType:
    """Type sizes (points) of a panel: the theme's where they fit, smaller where they would clip."""

    title_pt: int
    axis_pt: int
    label_pt: int  # legends, marker and spike labels, small readouts
    readout_pt: int

    @staticmethod
    def of(theme: Theme, step: int = 0) -> "PlotType":
        """The theme's sizes ``step`` points smaller, never below the normal theme's smallest readable."""
        return PlotType(max(theme.title_pt - step, 9), max(theme.axis_pt - step, 8),
                        max(theme.font_pt - 1 - step, 8), max(theme.title_pt + 2 - step, 10))


@dataclass
class FrameBudget:
    """What one frame may do: the panels it draws, and the view range changes left (each re-renders axes)."""

    panels: set[int]
    changes: float
    pending: bool = False  # a range wanted to change and could not: fit again next frame

    def may_change(self, panel: "PlotPanel") -> bool:
        if self.changes <= 0 or id(panel) not in self.panels:
            self.pending = True
            return False
        self.changes -= 1
        return True


def mix(a: str, b: str, t: float) -> QColor:
    """Colour t of the way from a to b (opaque)."""
    ca, cb = QColor(a), QColor(b)
    return QColor(round(ca.red() + (cb.red() - ca.red()) * t), round(ca.green() + (cb.green() - ca.green()) * t),
                  round(ca.blue() + (cb.blue() - ca.blue()) * t))


def view_of(plot: pg.PlotItem | pg.ViewBox) -> pg.ViewBox:
    """The view box of a plot (a bare view box, such as the memory plot's KV scale, is its own)."""
    return plot if isinstance(plot, pg.ViewBox) else plot.getViewBox()


def headroom(view: pg.ViewBox, band_px: float, least: float = 1.15) -> float:
    """The factor a y range keeps above the data so that a band of ``band_px`` at the top of ``view`` stays free
    (for labels that must not cover a curve), at least ``least``, at most 2.5."""
    height = view.height()
    if band_px <= 0 or height <= band_px + 8:
        return least if band_px <= 0 else 2.5
    return min(max(least, height / (height - band_px)), 2.5)


def text_width(text: str, pt: float, bold: bool = False) -> float:
    font = QFont()
    font.setPointSizeF(pt)
    font.setBold(bold)
    return QFontMetricsF(font).horizontalAdvance(text)


def line_height(pt: float) -> float:
    font = QFont()
    font.setPointSizeF(pt)
    return QFontMetricsF(font).height()


def label_height(pt: float) -> float:
    """A LabelItem's height: its line and the text document's margins (4 px a side)."""
    return line_height(pt) + 8


@dataclass
class PlotSpec:
    """One plot item of a panel: how tall its data area must stay readable, and what its axes show."""

    item: pg.PlotItem
    min_height: float  # px of data area
    bottom_values: bool = True  # tick values on the bottom axis
    bottom_label: str = ""
    left_label: str = ""
    left_sample: str = BYTES_TICK_SAMPLE
    right_sample: str | None = None  # a right axis (its own scale) sized for this text, when shown
    marker_axis: str = "token"  # where a marker's line goes on this plot: "token" or "time"
    optional: bool = False  # hidden where the panel is too short for it (its figures are in the readout)
    stretch: int = 1  # its share of the height the header and legend leave


class PlotPanel(pg.GraphicsLayoutWidget):
    """A live plot panel: subclasses add their plot items (``add_plot``) and curves (``add_curve``), and say
    which columns of a sample they plot (``token_row``, ``time_row``)."""

    #: Its name for ``LivePlots.export_plot`` (and in the list ``kvscope.ui.plots.live.PANELS``).
    key = ""
    #: 0: the top row, full width; 1: the bottom row, side by side with the other panels of the row.
    row = 1
    #: The columns it adds to the shared per-token and per-sample-time ring buffers.
    TOKEN_COLUMNS: tuple[str, ...] = ()
    TIME_COLUMNS: tuple[str, ...] = ()
    TOOLTIP = ""
    #: The readout in large type (the slope: the number a speaker points at), else in the legend's.
    READOUT_BIG = True

    def __init__(self, tokens: RingBuffer, times: RingBuffer, markers: list[Marker], theme: Theme,
                 capacity: int = 200_000) -> None:
        super().__init__()
        # The shared buffers and markers (LivePlots owns them); ``capacity``: rows a buffer of its own keeps.
        self.tokens, self.times, self.markers, self.capacity = tokens, times, markers, capacity
        self.theme = theme
        self.type = PlotType.of(theme)
        self.curves: dict[str, Curve] = {}
        self.plots: list[PlotSpec] = []
        self._fresh: set[tuple[int, str]] = set()
        self._fit_key = None
        self.ci.layout.setContentsMargins(MARGIN, MARGIN, MARGIN, MARGIN)
        self.ci.layout.setVerticalSpacing(2)
        self.header = self.ci.addLayout(row=0, col=0)
        self.header.layout.setContentsMargins(0, 0, 0, 0)
        self.header.layout.setSpacing(0)
        self.title_label = pg.LabelItem("", justify="center")
        self.readout_label = pg.LabelItem("", justify="right")
        self.header.addItem(self.title_label, row=0, col=0)
        self.header.addItem(self.readout_label, row=0, col=1)
        # The header and the legend are as tall as their text; the plots take the rest.
        for item in (self.title_label, self.readout_label):
            item.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self._readout_below = False
        self.readout_text, self.readout_color = "", None
        self.legend = pg.LegendItem(colCount=4)
        self.legend.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)
        self.legend.layout.setContentsMargins(2, 0, 2, 0)  # its rows are all its height (as _layout_for counts)
        self._legend_row = 1  # moves under the plots as plots are added
        self.ci.addItem(self.legend, row=self._legend_row, col=0)
        self.ci.layout.setAlignment(self.legend, Qt.AlignmentFlag.AlignHCenter)
        self.setToolTip(self.TOOLTIP)
        # Each view paints every pixel of itself (its background brush first): Qt need not repaint
        # the widgets underneath whenever a view updates.
        self.viewport().setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.viewport().setAttribute(Qt.WidgetAttribute.WA_NoSystemBackground)

    # ---------------------------------------------------------------------------------------------
    # construction

    def add_plot(self, spec_axes: dict | None = None, **spec) -> pg.PlotItem:
        """A plot item under the previous ones (x axes linked), with the shared live-plot manners."""
        row = 1 + len(self.plots)
        self.ci.removeItem(self.legend)
        # Every time and token axis spaces its labels by their width (SparseAxis), whatever the type size.
        plot = self.ci.addPlot(row=row, col=0, axisItems={"bottom": SparseAxis("bottom"), **(spec_axes or {})})
        self.ci.addItem(self.legend, row=row + 1, col=0)
        self.ci.layout.setAlignment(self.legend, Qt.AlignmentFlag.AlignHCenter)
        if self.plots:
            plot.setXLink(self.plots[0].item)
        plot.setTitle(None)
        plot.getAxis("bottom").enableAutoSIPrefix(False)  # tokens and seconds are counts: never "token (x0.001)"
        # Ranges are set in steps by fit_ranges (cheap frames); a live view is not panned by mouse.
        plot.disableAutoRange()
        plot.setMouseEnabled(x=False, y=False)
        plot.setMenuEnabled(False)
        plot.hideButtons()
        for side in ("left", "bottom"):
            # Ranges change in steps, so an axis (ticks, labels) is the same picture for many frames:
            # keep it as a pixmap instead of replaying its text each paint.
            plot.getAxis(side).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        self.plots.append(PlotSpec(plot, **spec))
        self.ci.layout.setRowStretchFactor(row, self.plots[-1].stretch)
        return plot

    def add_right_view(self, plot: pg.PlotItem) -> pg.ViewBox:
        """A second y scale on ``plot``'s right axis: a view box of its own, x-linked, the same rectangle."""
        view = pg.ViewBox(enableMouse=False)
        view.setMenuEnabled(False)
        plot.scene().addItem(view)
        plot.getAxis("right").linkToView(view)
        plot.getAxis("right").enableAutoSIPrefix(False)
        view.setXLink(plot)
        plot.getViewBox().sigResized.connect(lambda vb: view.setGeometry(vb.sceneBoundingRect()))
        return view

    def add_curve(self, key: str, plot: pg.PlotItem | pg.ViewBox, buffer: RingBuffer, x: str, y: str, name: str,
                  style: str = "solid", fill: bool = False, z: int = 0, color: str | None = None,
                  legend: bool = True) -> Curve:
        # A bare curve item: the data arrive decimated (one min/max pair per pixel column, computed
        # incrementally), so PlotDataItem's per-frame downsampling, clipping and bounds passes over
        # the whole column would be pure cost.
        item = DeviceCurve()
        item.setZValue(z)
        item.setVisible(False)
        plot.addItem(item)
        curve = Curve(item, buffer, x, y, name, PeakDecimator(buffer, x, y), (color or key, style, fill), legend)
        self.curves[key] = curve
        return curve

    # ---------------------------------------------------------------------------------------------
    # data in: the rows a sample adds to the shared buffers, and what else a panel takes from it

    def token_row(self, s: Sample) -> dict:
        return {}

    def time_row(self, s: Sample) -> dict:
        return {}

    def take(self, s: Sample) -> None:
        """Every sample, events included, before its rows are appended."""

    # ---------------------------------------------------------------------------------------------
    # markers

    def marker_lines(self, marker: Marker, label: str | None) -> list[tuple[object, pg.InfiniteLine]]:
        """One dashed vertical line per plot item at the marker's token (or time); ``label`` on the first."""
        out = []
        for spec in self.plots:
            pos = marker.time_s if spec.marker_axis == "time" else marker.token
            line = pg.InfiniteLine(movable=False, pos=pos, angle=90)
            spec.item.addItem(line, ignoreBounds=True)
            out.append((spec.item, line))
        return out

    def style_marker_line(self, marker: Marker, line: pg.InfiniteLine) -> None:
        t = self.theme
        color = t.error if marker.kind in ("error", "oom", "budget") else t.curves["marker"]
        line.setPen(pg.mkPen(color, width=t.marker_width, style=Qt.PenStyle.DashLine))
        if getattr(line, "label", None) is not None:
            line.label.setColor(color)
            font = QFont()
            font.setPointSize(self.type.label_pt + 1)
            font.setBold(True)
            line.label.setFont(font)
            line.label.fill = pg.mkBrush(QColor(t.background))
            line.label.border = pg.mkPen(color)

    # ---------------------------------------------------------------------------------------------
    # drawing

    def superseded(self) -> tuple[str, ...]:
        """Curves hidden this frame (another curve draws the same quantity better)."""
        return ()

    def draw(self) -> int:
        """Hand each changed curve its column decimated to the plot's pixel columns. Returns curves updated."""
        updated = 0
        hidden = self.superseded()
        for key, curve in self.curves.items():
            if key in hidden:
                if curve.item.isVisible() or curve.in_legend:
                    curve.item.setVisible(False)
                    self._unlist(curve)
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
            if not curve.in_legend and curve.legend:
                self.legend.addItem(curve.item, curve.name)
                curve.in_legend = True
                self._fit_key = None  # a new legend entry: the legend row may need another line
            updated += 1
        if self._fit_key is None:
            self.fit_type()
        return updated

    def _unlist(self, curve: Curve) -> None:
        if curve.in_legend:
            self.legend.removeItem(curve.item)
            curve.in_legend = False
            self._fit_key = None

    def fit_ranges(self, frame: FrameBudget) -> None:
        """Set this panel's view ranges (``set_x``, ``set_y``)."""

    def over_curves(self, rect, keys: tuple[str, ...]) -> bool:
        """Whether any of these curves, as drawn, passes through ``rect`` (scene coordinates)."""
        for key in keys:
            item = self.curves[key].item
            view = item.getViewBox()
            if not item.isVisible() or view is None:
                continue
            x, y = item.getData()
            if x is None or not len(x):
                continue
            r = view.mapSceneToView(rect).boundingRect()
            lo, hi = np.searchsorted(x, r.left()), np.searchsorted(x, r.right(), side="right") + 1
            seg = y[max(lo, 0):min(hi, len(y))]
            seg = seg[np.isfinite(seg)]
            if seg.size and seg.min() <= r.bottom() and seg.max() >= r.top():
                return True
        return False

    def declutter(self) -> None:
        """Place labels after the ranges changed."""

    def refresh_labels(self) -> None:
        """Readouts that follow the data (after curves were updated)."""

    # ---- ranges: set in steps, instead of pyqtgraph's per-frame auto-range
    # A range that changes every frame makes every axis regenerate its ticks and pictures at 30 Hz, which
    # costs more than drawing the curves. Ranges grow in steps (GROW) and change only when the data leave
    # them, so most frames repaint curves only.

    def ranges(self, keys: tuple[str, ...]) -> list[tuple[float, float]]:
        return [r for r in (self.curves[k].y_range for k in keys if k in self.curves) if r is not None]

    def top(self, keys: tuple[str, ...]) -> float | None:
        """Largest value drawn by any of these curves (decimation keeps every bin's maximum)."""
        ranges = self.ranges(keys)
        return max(r[1] for r in ranges) if ranges else None

    def bottom(self, keys: tuple[str, ...]) -> float | None:
        ranges = self.ranges(keys)
        return min(r[0] for r in ranges) if ranges else None

    def top_abs(self, keys: tuple[str, ...]) -> float | None:
        ranges = self.ranges(keys)
        return max(max(abs(r[0]), abs(r[1])) for r in ranges) if ranges else None

    def set_x(self, frame: FrameBudget, plot, first: float, last: float) -> None:
        lo, hi = view_of(plot).viewRange()[0]
        if last > hi or first < lo or (hi - first) > 4 * max(last - first, 1.0) or self._stale(plot, "x"):
            if not frame.may_change(self):
                self._fresh.discard((id(plot), "x"))  # (if it was stale, it still is: ask again next frame)
                return
            width = max(last - first, 1.0)
            plot.setXRange(first, first + width * GROW + 1.0, padding=0.0)

    def set_y(self, frame: FrameBudget, plot, bottom: float | None, top: float, headroom: float,
              base: float | None = None) -> None:
        """y range [bottom, top x headroom] (symmetric around 0 when bottom is None), with hysteresis."""
        lo, hi = view_of(plot).viewRange()[1]
        origin = base if base is not None else (bottom or 0.0)
        want_hi = origin + (top - origin) * headroom
        if bottom is None:
            if top > hi or top < 0.4 * hi or self._stale(plot, "y"):
                if frame.may_change(self):
                    plot.setYRange(-top * headroom, top * headroom, padding=0.0)
                else:
                    self._fresh.discard((id(plot), "y"))
            return
        used = hi - lo
        if top > hi or bottom < lo or (top - bottom) < 0.45 * used or self._stale(plot, "y"):
            if top > hi and hi > lo:  # growing: a step big enough that the next one is a while off
                want_hi = origin + (top - origin) * headroom * GROW / 1.25
            if frame.may_change(self):
                plot.setYRange(bottom, want_hi, padding=0.0)
            else:
                self._fresh.discard((id(plot), "y"))

    def _stale(self, plot, axis: str) -> bool:
        """True once per plot axis after a reset or theme change (its range belongs to old data)."""
        if (id(plot), axis) in self._fresh:
            return False
        self._fresh.add((id(plot), axis))
        return True

    # ---------------------------------------------------------------------------------------------
    # the header, the theme, and type that fits

    def titles(self) -> tuple[str, ...]:
        """The title, longest first: the longest that fits is shown (rich text allowed)."""
        return ("",)

    def set_readout(self, text: str, color: str | None = None) -> None:
        """The header's readout (rich text), beside the title or under it where both do not fit."""
        if (text, color) == (self.readout_text, self.readout_color):
            return
        self.readout_text, self.readout_color = text, color
        self._fit_key = None
        self.fit_type(force=True)

    def reset(self) -> None:
        """Forget the run's curves and markers' lines (the window starts a new run)."""
        self._fresh.clear()
        for curve in self.curves.values():
            curve.item.setData([], [])
            curve.item.setVisible(False)
            self._unlist(curve)
            curve.drawn_version = None
            curve.y_range = None

    def apply_theme(self, theme: Theme) -> None:
        """Restyle background, axes, pens and labels (dark, light, presenter)."""
        self.theme = theme
        self._fresh = set()
        self.setBackground(theme.background)
        axis_pen = mix(theme.background, theme.text, 0.35)
        for spec in self.plots:
            for side in ("left", "bottom"):
                axis = spec.item.getAxis(side)
                axis.setTextPen(theme.muted)
                axis.setStyle(tickTextOffset=6, tickLength=-6)
                # No grid lines on the live plots: pyqtgraph draws them as part of each axis picture,
                # replayed at every frame, and they halve the frame rate (benchmarks/plot_fps.py).
                axis.setPen(axis_pen)
            spec.item.showGrid(x=False, y=False)
        self.legend.setLabelTextColor(theme.text)
        self.legend.setBrush(pg.mkBrush(QColor(theme.background)))
        self.legend.setPen(pg.mkPen(None))
        for name, curve in self.curves.items():
            key, style, fill = curve.style
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
            if curve.in_legend:
                self.legend.removeItem(curve.item)
                self.legend.addItem(curve.item, curve.name)
        self._fit_key = None
        self.fit_type(force=True)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name: the rows share the height 3:2, whatever the text
        return QSize(480, 300 if self.row == 0 else 200)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - never what sets the window's minimum; the type yields
        return QSize(120, 80)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if hasattr(self, "legend"):  # (GraphicsView's constructor resizes before ours has run)
            self.fit_type()

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().showEvent(event)
        self.fit_type()

    def legend_entries(self) -> list[str]:
        """The legend's entry names, in order (what the legend row must find room for)."""
        return [label.text for _, label in self.legend.items]

    def right_axes(self) -> list[tuple[pg.AxisItem, str]]:
        """The right axes shown now, with the text each is sized for."""
        return [(s.item.getAxis("right"), s.right_sample) for s in self.plots
                if s.right_sample is not None and s.item.getAxis("right").isVisible()]

    def _layout_for(self, t: PlotType, width: float, height: float, shown: list[PlotSpec],
                    labels: bool = True) -> dict | None:
        """How the panel lays out in type ``t`` within width x height px showing the plots ``shown`` (and their
        bottom axes' labels, with ``labels``), or None where something would clip."""
        self._labels = labels
        room = width - 2 * MARGIN - 4
        if room <= 0:
            return None
        title = next((text for text in self.titles() if _rich_width(text, t.title_pt) <= room), None)
        if title is None:
            return None
        readout = _rich_width(self.readout_text, self._readout_pt(t), bold=True) if self.readout_text else 0.0
        if readout > room:
            return None
        below = bool(readout) and _rich_width(title, t.title_pt) + readout + 16 > room
        ticks = max(text_width(s.left_sample, t.axis_pt) for s in self.plots) + 12
        left = ticks + (label_height(t.axis_pt) if any(s.left_label for s in shown) else 0)
        right = max([text_width(sample, t.axis_pt) + 12 for _, sample in self.right_axes()] or [0.0])
        if left + right + 80 > room:
            return None
        # The legend: as many entries a line as fit across (sample swatch 30 px, gaps), in order.
        entries = [text_width(name, t.label_pt) + 44 for name in self.legend_entries()]
        columns = len(entries) or 1
        while columns > 1 and any(sum(entries[i:i + columns]) > room for i in range(0, len(entries), columns)):
            columns -= 1
        if entries and max(entries) > room:
            return None
        legend_lines = math.ceil(len(entries) / columns) if entries else 0
        title_h = label_height(t.title_pt)
        readout_h = label_height(self._readout_pt(t)) if self.readout_text else 0.0
        header = title_h + readout_h if below else max(title_h, readout_h)
        plots_h = sum(s.min_height + self._axis_height(t, s, shown) + 2 for s in shown)
        legend_h = legend_lines * label_height(t.label_pt)
        need = header + plots_h + legend_h + 2 * MARGIN + 2 * (len(shown) + 1)
        if need > height:
            return None
        return {"title": title, "below": below, "left": math.ceil(ticks), "right": math.ceil(right),
                "columns": columns, "shown": shown, "labels": labels}

    def _axis_height(self, t: PlotType, spec: PlotSpec, shown: list[PlotSpec]) -> int:
        """The bottom axis's height: its tick values and its label, set (not left to pyqtgraph, which
        measures the values only when it paints them)."""
        values = line_height(t.axis_pt) + 6 if self._values(spec, shown) else 2
        # (pyqtgraph nudges the label 5 px down, into the room under the axis)
        return math.ceil(values + (label_height(t.axis_pt) + 5 if self._bottom_label(spec, shown) else 0))

    def _values(self, spec: PlotSpec, shown: list[PlotSpec]) -> bool:
        """Tick values on this plot's bottom axis: its own choice, and always on the lowest plot shown."""
        return spec.bottom_values or spec is shown[-1]

    def _bottom_label(self, spec: PlotSpec, shown: list[PlotSpec]) -> str:
        if not getattr(self, "_labels", True):
            return ""  # too short for them: the ticks stay ("token" and "time (s)" are in the tooltip)
        return spec.bottom_label or (self.plots[-1].bottom_label if spec is shown[-1] else "")

    def _readout_pt(self, t: PlotType) -> int:
        return t.readout_pt if self.READOUT_BIG else t.label_pt + 1

    def fit_type(self, force: bool = False) -> None:
        """The largest type (the theme's, then a point smaller at a time) in which nothing clips, applied."""
        width, height = float(self.width()), float(self.height())
        key = (width, height, self.theme, self.readout_text, tuple(self.legend_entries()),
               tuple(a.isVisible() for a, _ in self.right_axes()))
        if key == self._fit_key and not force:
            return
        self._fit_key = key
        every, needed = list(self.plots), [s for s in self.plots if not s.optional]
        # The theme's type before the optional plots, and they before the axes' labels: where both cannot be
        # had, the type stays. Each candidate the estimate lets through is applied and checked against the
        # layout's real minimum (the labels, axes and data areas as Qt sizes them).
        t = PlotType.of(self.theme)
        for step in range(0, 16):
            t = PlotType.of(self.theme, step)
            for shown, labels in ((every, True), (needed, True), (needed, False)):
                if shown is needed and needed == every and labels:
                    continue
                layout = self._layout_for(t, width, height, shown, labels)
                if layout is not None:
                    self._apply_type(t, layout)
                    least = self.ci.effectiveSizeHint(Qt.SizeHint.MinimumSize)
                    if least.height() <= height + 0.5 and least.width() <= width + 0.5:
                        return
            if t == PlotType.of(self.theme, step + 1):
                break
        # Too small even for the smallest type: the title that fits, the smallest type, what room there is.
        room = width - 2 * MARGIN - 4
        self._apply_type(t, {"title": next((x for x in self.titles() if _rich_width(x, t.title_pt) <= room),
                                           self.titles()[-1]),
                             "below": bool(self.readout_text), "columns": 1, "shown": needed, "labels": False,
                             "fits": False, "left": math.ceil(text_width(BYTES_TICK_SAMPLE, t.axis_pt) + 12),
                             "right": 0})

    def _apply_type(self, t: PlotType, layout: dict) -> None:
        theme = self.theme
        self._labels = layout["labels"]
        self.type = t
        axis_font = QFont()
        axis_font.setPointSize(t.axis_pt)
        label_style = {"color": theme.muted, "font-size": f"{t.axis_pt}pt"}
        for spec in self.plots:
            # The layout shares out the height by stretch and would squeeze one plot below its readable
            # minimum while another has room to spare: each data area asks for its minimum (where it fits).
            spec.item.getViewBox().setMinimumHeight(spec.min_height if layout.get("fits", True) else 0)
            if spec.item.isVisible() != (spec in layout["shown"]):
                spec.item.setVisible(spec in layout["shown"])
                # A hidden plot gives its row back (a hidden item keeps its place, and its minimum, otherwise).
                spec.item.setMinimumHeight(0)
                spec.item.setMaximumHeight(1e6 if spec in layout["shown"] else 0)
            for side in ("left", "bottom", "right"):
                spec.item.getAxis(side).setTickFont(axis_font)
            # A fixed axis width: tick labels that change width would re-lay out the plot every frame.
            spec.item.getAxis("left").setWidth(layout["left"])
            if spec.right_sample is not None:
                spec.item.getAxis("right").setWidth(max(layout["right"], 1) if layout["right"] else
                                                    math.ceil(text_width(spec.right_sample, t.axis_pt) + 12))
            shown = layout["shown"]
            if spec in shown:
                spec.item.getAxis("bottom").setStyle(showValues=self._values(spec, shown))
                label = self._bottom_label(spec, shown)
                if label:
                    spec.item.setLabel("bottom", label, **label_style)
                else:
                    spec.item.getAxis("bottom").showLabel(False)
                spec.item.getAxis("bottom").setHeight(self._axis_height(t, spec, shown))
            if spec.left_label:
                spec.item.setLabel("left", spec.left_label, **label_style)
        self.title_label.setText(layout["title"], color=theme.text, size=f"{t.title_pt}pt")
        if self.readout_text:
            self.readout_label.setText(self.readout_text, size=f"{self._readout_pt(t)}pt", bold=True,
                                       color=self.readout_color or theme.text)
        else:
            self.readout_label.setText("")
        if layout["below"] != self._readout_below:
            self._readout_below = layout["below"]
            self.header.removeItem(self.readout_label)
            if self._readout_below:
                self.header.addItem(self.readout_label, row=1, col=0)
            else:
                self.header.addItem(self.readout_label, row=0, col=1)
        self.readout_label.setVisible(bool(self.readout_text))
        listed = bool(self.legend.items)
        if self.legend.isVisible() != listed:
            self.legend.setVisible(listed)
        self.ci.layout.setRowMaximumHeight(len(self.plots) + 1, 1e6 if listed else 0)  # an empty legend: no row
        self.legend.setLabelTextSize(f"{t.label_pt}pt")
        if self.legend.columnCount != layout["columns"]:
            self.legend.setColumnCount(layout["columns"])
        for item, label in self.legend.items:  # labels keep the size they were made with: restyle them
            label.setText(label.text, size=f"{t.label_pt}pt", color=theme.text)
        self.legend.updateSize()
        for marker in self.markers:
            for line in marker.lines:
                if line.scene() is self.scene():
                    self.style_marker_line(marker, line)
        self.restyle_labels()

    def restyle_labels(self) -> None:
        """Labels a subclass draws in the panel's type (spike sizes): called whenever the type changes."""

    def export_item(self):
        """What ``LivePlots.export_plot`` renders: the whole panel, header and legend included."""
        return self.ci


def _rich_width(text: str, pt: float, bold: bool = False) -> float:
    """The width of a label's text, its markup (coloured spans) left out."""
    import re

    plain = re.sub(r"<[^>]+>", "", text).replace("&nbsp;", " ")
    return text_width(plain, pt, bold) + 6

"""What every live plot does the same way: a view of its own, decimated curves, switch markers, and the parts
it mixes in: view ranges set in steps (``kvscope.ui.plots.ranges``) and a header, a legend row and type that fit
the panel (``kvscope.ui.plots.fit``).

A panel (``PlotPanel``) is one ``GraphicsLayoutWidget``, one scene Qt repaints on its own, laid out top down:
a header row (the title, and a readout such as the slope, which wraps under the title where the two do not
fit side by side), one or more plot items, and a legend row under them. Nothing but curves and markers is
drawn inside a plot's data area, so no legend or readout ever covers the live line. A new plot is a subclass in
a module of its own and one entry in ``kvscope.ui.plots.live.PANELS`` (docs/extending.md, "a new plot").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import QGraphicsItem

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import SparseAxis
from kvscope.ui.curves import DeviceCurve
from kvscope.ui.decimate import PeakDecimator
# The plots import these from here (the names a panel's module needs, in one place).
from kvscope.ui.plots.fit import (BYTES_TICK_SAMPLE, MARGIN, FittedType, PlotSpec, PlotType,  # noqa: F401
                                  label_height, line_height, text_width)
from kvscope.ui.plots.ranges import GROW, FrameBudget, SteppedRanges, headroom, view_of  # noqa: F401
from kvscope.ui.ringbuffer import RingBuffer
from kvscope.ui.theme import Theme


#: Switch markers and spike marks kept on the plots (the newest; older ones are removed): each is a
#: few graphics items every frame draws and every new item re-bounds, so a recording with thousands
#: of switches made each sample slower than the last (2,000 took 100 s to replay).
MAX_MARKS = 200


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


def mix(a: str, b: str, t: float) -> QColor:
    """Colour t of the way from a to b (opaque)."""
    ca, cb = QColor(a), QColor(b)
    return QColor(round(ca.red() + (cb.red() - ca.red()) * t), round(ca.green() + (cb.green() - ca.green()) * t),
                  round(ca.blue() + (cb.blue() - ca.blue()) * t))


class PlotPanel(FittedType, SteppedRanges, pg.GraphicsLayoutWidget):
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
        self._build_header()
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

    def export_item(self):
        """What ``LivePlots.export_plot`` renders: the whole panel, header and legend included."""
        return self.ci

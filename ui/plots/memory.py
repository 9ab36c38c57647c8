"""The memory plot: memory over wall-clock time (the device, this process, the allocator, the weights), the
KV cache on a scale of its own, the device's capacity, and the spikes the session found."""

from __future__ import annotations

from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import BytesAxis, format_bytes
from kvscope.ui.plots.panel import MAX_MARKS, PlotPanel, headroom, label_height, mix
from kvscope.ui.ringbuffer import RingBuffer
from kvscope.ui.theme import Theme

#: The memory sampler's readings (MemorySampler, ~20 Hz, independent of tokens), in plot seconds.
READING_COLUMNS = ("time", "device_total", "device_used", "process_gpu", "process_rss", "reserved", "allocated")
#: Memory curves the sampler's readings replace once there are any: the same quantities, read 20x a
#: second instead of once per token (a replay has no readings and keeps the per-token ones).
SAMPLED = ("device_used", "process_gpu", "process_rss", "reserved", "allocated")


@dataclass
class SpikeMark:
    """A spike marked on the memory-vs-time plot: a triangle at its peak and its size beside it."""

    time_s: float
    after: int
    rise: int
    cause: str
    items: tuple


class MemoryPlot(PlotPanel):
    """Memory vs time: per-token figures, replaced by the sampler's readings where there are any."""

    key = "memory"
    TIME_COLUMNS = ("device_total", "device_used", "process_gpu", "process_rss", "reserved", "allocated",
                    "kv_share", "weights")
    TOOLTIP = (
        "Memory over wall-clock time.\nDevice capacity (dashed line, when in view) and used: NVML (whole GPU).\nThis "
        "process: the process the model runs in (the engine), NVML per-process GPU memory, or its resident set (RSS) "
        "with no GPU.\nReserved / allocated: the torch caching allocator.\nKV share: the measured bytes of the KV "
        "cache.\nA missing curve means the hardware cannot report it (shown as n/a, never as 0).")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.readings = RingBuffer(self.capacity, READING_COLUMNS)
        self.plot = self.add_plot({"left": BytesAxis(orientation="left"), "right": BytesAxis(orientation="right")},
                                  min_height=50, bottom_label="time (s)", right_sample=BYTES_RIGHT,
                                  marker_axis="time")
        # The KV cache has its own scale, on the right axis: a few MiB of cache are invisible under hundreds of
        # MiB of process memory on one axis (the CPU demo: ~450 MiB RSS).
        self.plot.showAxis("right")
        self.kv_view = self.add_right_view(self.plot)
        self.kv_view.setZValue(-1)
        m = self.times
        self.add_curve("device_used", self.plot, m, "time", "device_used", "device used (NVML)")
        self.add_curve("process_gpu", self.plot, m, "time", "process_gpu", "process (GPU)")
        self.add_curve("process_rss", self.plot, m, "time", "process_rss", "process (RSS)")
        self.add_curve("reserved", self.plot, m, "time", "reserved", "allocator reserved")
        self.add_curve("allocated", self.plot, m, "time", "allocated", "allocator allocated")
        self.add_curve("weights", self.plot, m, "time", "weights", "weights", "dot")
        self.add_curve("kv_share", self.kv_view, m, "time", "kv_share", "KV (right axis)", fill=True, z=-1)
        for key in SAMPLED:
            name = self.curves[key].name
            self.add_curve(f"sampled_{key}", self.plot, self.readings, "time", key, name, color=key)
        # Capacity is a labelled horizontal line outside the auto-range: a small model on a big GPU
        # would otherwise flatten every other curve against zero.
        self.capacity_line = pg.InfiniteLine(movable=False, pos=0, angle=0, label="",
                                             labelOpts={"position": 0.5, "anchors": [(0.5, 1), (0.5, 1)]})
        self.capacity_line.setVisible(False)
        self.plot.addItem(self.capacity_line, ignoreBounds=True)
        self.spikes: list[SpikeMark] = []
        self.host_only: bool | None = None  # None until the first sample says whether a GPU reports memory
        self.empty_ranges()

    def titles(self) -> tuple[str, ...]:
        if self.host_only:
            warn = f"<span style='color:{self.theme.warning}'>\u00b7 no GPU</span>"
            return (f"Memory vs time {warn}", f"Memory {warn}", "Memory")
        return ("Memory vs time", "Memory")

    # ---- data in

    def time_row(self, s: Sample) -> dict:
        return {"device_total": s.device_total,
                "device_used": s.device_used,
                "process_gpu": s.process_gpu,
                "process_rss": None if (s.device_total is not None or s.process_gpu is not None) else s.process_rss,
                "reserved": s.allocator_reserved,
                "allocated": s.allocator_allocated,
                "kv_share": s.kv_bytes_reserved,
                "weights": s.weights_bytes}

    def take(self, s: Sample) -> None:
        if not s.is_event:
            self._saw(s.device_total is not None or s.process_gpu is not None or s.allocator_reserved is not None)

    def _saw(self, gpu: bool) -> None:
        if self.host_only is None or (self.host_only and gpu):
            self.host_only = not gpu
            self._fit_key = None
            self.fit_type(force=True)  # the title says "no GPU"

    def add_readings(self, readings, origin: float) -> int:
        """Append the memory sampler's readings (``kvscope.core.runtimes.probes.MemoryReading``), ``origin`` the monotonic second
        that is 0 on the time axis. Returns the readings appended (one already shown, or out of order, is not)."""
        last = self.readings.last("time")
        rows = []
        for r in readings:
            t = r.time_s - origin
            if last is not None and t <= last:
                continue  # a reading already shown (or out of order): the axis must increase
            last = t
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
            self._saw(r.device_total is not None or r.process_gpu is not None or r.allocator_reserved is not None)
        self.readings.extend(rows)
        return len(rows)

    def empty_ranges(self) -> None:
        """Axes that read as a run about to start (0-60 s, 0-1 GiB; the KV scale 0-1 MiB)."""
        self.plot.setXRange(0, 60, padding=0.0)
        self.plot.setYRange(0, 2**30, padding=0.0)
        self.kv_view.setYRange(0, 2**20, padding=0.0)

    def reset(self) -> None:
        super().reset()
        self.capacity_line.setVisible(False)
        self.capacity_line.setValue(0)
        self.readings.clear()
        for mark in self.spikes:
            for item in mark.items:
                self.plot.removeItem(item)
        self.spikes.clear()
        self.host_only = None
        self.empty_ranges()

    # ---- spikes

    def add_spike(self, time_s: float, after: int, rise: int, cause: str = "") -> SpikeMark:
        """Mark a spike at ``time_s`` (plot seconds): a triangle at ``after`` bytes, '+rise' beside it."""
        point = pg.ScatterPlotItem([time_s], [after], symbol="t1", size=14)
        # Above the peak, right of the triangle: beside it, the label covered the line that stays at the peak.
        text = pg.TextItem(f"+{format_bytes(rise)}", anchor=(-0.05, 1.0))
        text.setPos(time_s, after)
        line = pg.InfiniteLine(movable=False, pos=time_s, angle=90)
        for item in (line, point, text):
            item.setZValue(6 if item is text else 5)  # the size over the lines and triangles near it
            self.plot.addItem(item, ignoreBounds=True)
        point.setToolTip(f"spike +{format_bytes(rise)}: {cause}")
        mark = SpikeMark(time_s, int(after), int(rise), cause, (line, point, text))
        self._style_spike(mark)
        self.spikes.append(mark)
        if len(self.spikes) > MAX_MARKS:
            for item in self.spikes.pop(0).items:
                self.plot.removeItem(item)
        return mark

    def declutter(self) -> int:
        """Show a spike's '+size' label only where it fits: the largest spikes first, each label where
        no other shown label is within its width (in pixels at the current zoom). The triangles and
        lines all stay; a hidden label's size is in the triangle's tooltip and the events table.
        Returns the labels shown."""
        view = self.plot.getViewBox()
        (x0, x1), (y0, y1) = view.viewRange()
        width_px = max(view.width(), 1.0)
        per_px = (x1 - x0) / width_px if x1 > x0 else 0.0
        # Each label stands on its triangle, not across it: lifted by half the triangle's height (the
        # triangles of spikes close in time sit on one row, and a label at the peak ran through them).
        half = _TRIANGLE_PX[self.theme.presenter] / 2
        lift = half * (y1 - y0) / max(view.height(), 1.0)
        char_px = 0.62 * self.type.label_pt * 96 / 72
        area = view.sceneBoundingRect().adjusted(-1, -1, 1, 1)  # (a label in the headroom band ends on its edge)
        drawn = tuple(k for k, c in self.curves.items() if c.item.isVisible() and c.item.getViewBox() is view)
        taken: list[tuple[float, float]] = []
        shown = 0
        # Nor over another spike's triangle (three spikes in a second on a small plot: the label ran under them).
        triangles = {id(m): _triangle(view, m, half) for m in self.spikes}
        # One line per triangle's width: dynamic-cache growth makes a spike every few tokens, and on a small plot
        # (presenter type, 720 px) their lines were a barcode over the curves. The largest keep theirs; every
        # triangle stays (its tooltip and the events table have each spike).
        by_size = sorted(self.spikes, key=lambda m: -m.rise)  # the largest first: they keep their lines and labels
        lines: list[float] = []
        for mark in by_size:
            x = triangles[id(mark)].center().x()
            crowded = any(abs(x - other) < 2 * half for other in lines)
            if not crowded:
                lines.append(x)
            if mark.items[0].isVisible() == crowded:
                mark.items[0].setVisible(not crowded)
        for mark in by_size:
            text = mark.items[2]
            left = mark.time_s
            right = left + (len(text.toPlainText()) + 2) * char_px * per_px
            fits = per_px > 0 and x0 <= left and right <= x1 and all(right < a or left > b for a, b in taken)
            if fits:
                for y in (mark.after + lift, mark.after):  # on its triangle; else (no room above) at its peak
                    text.setPos(mark.time_s, y)
                    rect = _shown_rect(text)
                    inner = rect.adjusted(4, 4, -4, -4)
                    fits = (area.contains(rect) and not self.over_curves(rect.adjusted(2, 2, -2, -4), drawn)
                            and not any(inner.intersects(t) for k, t in triangles.items() if k != id(mark)))
                    if fits:
                        break
            if fits:
                taken.append((left - 8 * per_px, right))
                shown += 1
            if text.isVisible() != fits:
                text.setVisible(fits)
        return shown

    def _style_spike(self, mark: SpikeMark) -> None:
        t = self.theme
        line, point, text = mark.items
        line.setPen(pg.mkPen(t.warning, width=max(t.marker_width - 0.5, 1.0), style=Qt.PenStyle.DotLine))
        point.setBrush(pg.mkBrush(t.warning))
        point.setPen(pg.mkPen(t.background, width=1))
        point.setSize(_TRIANGLE_PX[t.presenter])
        text.setColor(t.warning)
        backdrop = QColor(t.background)
        backdrop.setAlpha(200)
        text.fill = pg.mkBrush(backdrop)  # the spike lines near it pass behind its figure, not through it
        font = QFont()
        font.setPointSize(self.type.label_pt)
        font.setBold(True)
        text.setFont(font)

    def restyle_labels(self) -> None:
        for mark in self.spikes:
            self._style_spike(mark)
        if self.capacity_line.label is not None:
            font = QFont()
            font.setPointSize(self.type.label_pt)
            self.capacity_line.label.setFont(font)

    # ---- drawing

    def superseded(self) -> tuple[str, ...]:
        return SAMPLED if len(self.readings) else ()

    def draw(self) -> int:
        updated = super().draw()
        capacity = self.readings.last("device_total") or self.times.last("device_total")
        if capacity is not None and self.capacity_line.value() != capacity:
            self.capacity_line.setValue(capacity)
            self.capacity_line.label.setFormat(f"device capacity {format_bytes(capacity)}")
            self.capacity_line.setVisible(True)
        return updated

    def fit_ranges(self, frame) -> None:
        ends = [(float(c[0]), float(c[-1])) for c in (self.times.column("time"), self.readings.column("time"))
                if len(c)]
        if ends:
            self.set_x(frame, self.plot, min(e[0] for e in ends), max(e[1] for e in ends))
        top = self.top(("device_used", "process_gpu", "process_rss", "reserved", "allocated", "weights")
                       + tuple(f"sampled_{key}" for key in SAMPLED))
        if top is not None:
            # room for the spike labels above the peaks
            band = label_height(self.type.label_pt) + _TRIANGLE_PX[self.theme.presenter] / 2 if self.spikes else 0
            self.set_y(frame, self.plot, 0.0, top, headroom(self.plot.getViewBox(), band, least=1.2))
        kv_top = self.top(("kv_share",))
        if kv_top is not None:
            self.set_y(frame, self.kv_view, 0.0, kv_top, 1.2)

    def apply_theme(self, theme: Theme) -> None:
        right = self.plot.getAxis("right")
        right.setTextPen(theme.curves["kv_share"])
        right.setPen(mix(theme.background, theme.curves["kv_share"], 0.6))
        right.setStyle(tickTextOffset=6, tickLength=-6)
        self.capacity_line.setPen(pg.mkPen(theme.curves["device_total"], width=theme.marker_width,
                                           style=Qt.PenStyle.DashLine))
        if self.capacity_line.label is not None:
            self.capacity_line.label.setColor(theme.curves["device_total"])
        super().apply_theme(theme)


#: A spike's triangle, in px: normal and presenter mode.
_TRIANGLE_PX = {False: 14, True: 22}

#: The right axis (the KV cache's scale) is sized for this.
BYTES_RIGHT = "88.8 MiB"


def _triangle(view: pg.ViewBox, mark: SpikeMark, half: float) -> QRectF:
    """A spike's triangle as drawn, in scene pixels (its item's bounding rectangle is padded for the pen)."""
    at = view.mapViewToScene(QPointF(mark.time_s, mark.after))
    return QRectF(at.x() - half, at.y() - half, 2 * half, 2 * half)


def _shown_rect(text: pg.TextItem):
    """A spike label's rectangle in the scene as it would be shown (a hidden one is measured as shown)."""
    was = text.isVisible()
    text.setVisible(True)
    rect = text.sceneBoundingRect()
    text.setVisible(was)
    return rect

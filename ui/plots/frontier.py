"""The frontier: what each setting of the run costs in KV bytes per token against what it keeps of the model.

Every setting the run visited (its attention and cache, as the Samples spell them: ``mqa``, ``mqa:mean``,
``mla:64``, ``window:16``, ``sink:4+60``...) is one labelled point: x, the KV bytes each more token of context
costs under it (the held bytes' growth over the context's between its consecutive probed tokens: what the setting
saves per token, without the fixed part a latent's basis or a preallocation adds once); a cache that stops growing
(a full window, a sink) is placed at the bytes it held per token of context instead (``kv_bytes_held /
context_tokens``, the mean over its tokens, falling as the context grows past it); y, the quality probe's top-1 agreement with the model as loaded over those tokens, in %; its label
names the setting and its mean KL in nats. x on a log scale (powers of two: a half is one step, whatever the
size), y linear from 0 to 100 %. A setting visited twice is one point over all its tokens. Only tokens the probe
judged count; a run without the probe has no point (``LivePlots`` hides the panel).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtGui import QColor, QFont, QFontMetrics

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import SparseAxis, format_bytes
from kvscope.ui.plots.panel import PlotPanel
from kvscope.ui.theme import Theme


class Log2BytesAxis(pg.AxisItem):
    """A bytes axis on a log scale: the plot's x is log2 of bytes; ticks at whole powers of two (every other one
    where they would crowd), labelled in binary units ('1 KiB', '4 KiB')."""

    def tickValues(self, minVal, maxVal, size):  # noqa: N802 (pyqtgraph API)
        if not (math.isfinite(minVal) and math.isfinite(maxVal)) or maxVal <= minVal:
            return []
        first, last = math.ceil(minVal), math.floor(maxVal)
        font = self.style.get("tickFont") or QFont()
        widest = QFontMetrics(font).horizontalAdvance("888 KiB") * 1.4
        step = 1
        while (last - first) / step * widest > max(size, 1) and step < 64:
            step *= 2
        return [(float(step), [float(v) for v in range(first, last + 1) if v % step == 0])]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph API)
        # (pyqtgraph also asks for strings while it sizes the axis, of values that are no power on this scale:
        # 2.0 ** 16384 raised inside Qt's paint and took the process down)
        return [format_bytes(2.0 ** v).replace(".0 ", " ") if -1 <= v <= 60 else "" for v in values]


@dataclass
class FrontierPoint:
    """One setting's tokens judged by the probe: sums, so that a mean is exact over every token."""

    attention: str
    cache: str
    tokens: int = 0
    agreed: int = 0
    kl_sum: float = 0.0
    bytes_tokens: int = 0  # tokens with a KV figure (held bytes and a context)
    bytes_per_token_sum: float = 0.0
    grown_bytes: int = 0  # the held bytes' growth between consecutive tokens of this setting
    grown_tokens: int = 0  # and the context's

    @property
    def top1(self) -> float:
        """Top-1 agreement with the loaded model, 0-1."""
        return self.agreed / self.tokens

    @property
    def kl(self) -> float:
        """Mean KL (loaded || run), nats per token."""
        return self.kl_sum / self.tokens

    @property
    def bytes_per_token(self) -> float | None:
        """KV bytes each more token costs (the growth over consecutive tokens); where the cache did not grow, the mean
        KV bytes held per token of context; None where no token had a KV figure."""
        if self.grown_tokens and self.grown_bytes > 0:
            return self.grown_bytes / self.grown_tokens
        return self.bytes_per_token_sum / self.bytes_tokens if self.bytes_tokens else None


class FrontierPlot(PlotPanel):
    """KV bytes per token (x) against top-1 agreement with the loaded model (y): one labelled point per setting."""

    key = "frontier"
    row = 0
    #: To the right of the KV plot and the quality strip.
    beside = True
    TOOLTIP = ("The trade-off of this run: one point per setting it ran with the quality probe on.\n"
               "x: KV bytes each more token of context costs under the setting (the held bytes' growth per token; "
               "a cache that stopped growing, a full window: held / tokens so far).\ny: how often the run's next token is the loaded model's (its own attention, a full cache), "
               "in %.\nThe label: the setting, and its mean KL divergence from the loaded model in nats.")
    READOUT_BIG = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plot = self.add_plot({"left": SparseAxis("left"), "bottom": Log2BytesAxis(orientation="bottom")},
                                  min_height=70, bottom_label="KV per token", left_label="top-1 %",
                                  left_sample="100")
        self.plot.getAxis("left").enableAutoSIPrefix(False)
        self.scatter = pg.ScatterPlotItem(size=12, symbol="o")
        self.scatter.setZValue(3)
        self.plot.addItem(self.scatter)
        self.points: dict[tuple[str, str], FrontierPoint] = {}
        self.labels: dict[tuple[str, str], pg.TextItem] = {}
        self.leaders: dict[tuple[str, str], pg.PlotCurveItem] = {}  # a line to a label placed off a corner
        self._version = 0  # bumped by every judged token
        self._last: tuple | None = None  # the last judged token's (attention, cache, context, held bytes)
        self._drawn = -1
        self._placed_key = None
        self.empty_ranges()

    def titles(self) -> tuple[str, ...]:
        return ("Frontier: top-1 vs KV bytes per token", "Top-1 vs KV per token", "Frontier")

    # ---- data in

    def take(self, s: Sample) -> None:
        if s.is_event or s.quality_top1 is None or s.quality_kl is None:
            return
        point = self.points.get((s.attention, s.cache))
        if point is None:
            point = self.points[(s.attention, s.cache)] = FrontierPoint(s.attention, s.cache)
        point.tokens += 1
        point.agreed += int(s.quality_top1)
        point.kl_sum += float(s.quality_kl)
        if s.kv_bytes_held is not None and s.context_tokens > 0:
            point.bytes_tokens += 1
            point.bytes_per_token_sum += s.kv_bytes_held / s.context_tokens
            last = self._last
            if last and last[:2] == (s.attention, s.cache) and s.context_tokens > last[2]:
                point.grown_bytes += s.kv_bytes_held - last[3]
                point.grown_tokens += s.context_tokens - last[2]
            self._last = (s.attention, s.cache, s.context_tokens, s.kv_bytes_held)
        self._version += 1

    def marker_lines(self, marker, label):
        return []  # no token or time axis here: a switch is a new point, not a line

    # ---- what the tests and the exports read

    def shown_points(self) -> list[tuple[str, float, float, float]]:
        """(label, KV bytes per token, top-1 %, mean KL) of each point drawn, in the order first visited."""
        return [(self.label_of(p), p.bytes_per_token, 100.0 * p.top1, p.kl) for p in self.points.values()
                if p.bytes_per_token is not None]

    def label_of(self, point: FrontierPoint) -> str:
        """The setting as the Samples spell it: the attention, and the cache where the run's points differ in it."""
        caches = {p.cache for p in self.points.values()}
        return point.attention if len(caches) <= 1 else f"{point.attention} \u00b7 {point.cache}"

    # ---- drawing

    def empty_ranges(self) -> None:
        self.plot.setXRange(0, 16 * 1024, padding=0.0)
        self.plot.setYRange(0, 120, padding=0.0)

    def reset(self) -> None:
        super().reset()
        self.points.clear()
        for item in list(self.labels.values()) + list(self.leaders.values()):
            self.plot.removeItem(item)
        self.labels.clear()
        self.leaders.clear()
        self.scatter.setData([])
        self._version, self._drawn, self._placed_key = 0, -1, None
        self._last = None
        self.empty_ranges()

    def draw(self) -> int:
        if self._drawn == self._version:
            return 0
        self._drawn = self._version
        shown = [(key, p) for key, p in self.points.items() if p.bytes_per_token is not None]
        self.scatter.setData([math.log2(p.bytes_per_token) for _, p in shown], [100.0 * p.top1 for _, p in shown])
        for key, point in shown:
            item = self.labels.get(key)
            if item is None:
                item = self.labels[key] = pg.TextItem(anchor=(0, 0.5))
                leader = self.leaders[key] = pg.PlotCurveItem(pen=pg.mkPen(self.theme.muted, width=1))
                leader.setZValue(2)
                leader.setVisible(False)
                self.plot.addItem(leader, ignoreBounds=True)
                item.setZValue(4)
                self.plot.addItem(item, ignoreBounds=True)
            item.point = point
            item.setPos(math.log2(point.bytes_per_token), 100.0 * point.top1)
            item.setToolTip(f"{self.label_of(point)}: top-1 {100 * point.top1:.1f}% over {point.tokens:,} tokens, "
                            f"KL {point.kl:.4g} nats, {format_bytes(point.bytes_per_token)} per token")
            self._style_label(item, point)
        self._placed_key = None
        return 1

    def _style_label(self, item: pg.TextItem, point: FrontierPoint, figures: bool = True, step: int = 0) -> None:
        """The setting in bold and, with ``figures``, its top-1 and KL on a second line (two short lines: one was
        wider than the whole plot in presenter type)."""
        t = self.theme
        name = html.escape(self.label_of(point))
        text = (f"<div style='color:{t.text}; font-size:{max(self.type.label_pt - step, 7)}pt; font-weight:600'>"
                f"{name}</div>")
        if figures:
            small = max(self.type.label_pt - 1, 8)
            text += (f"<div style='color:{t.muted}; font-size:{small}pt'>{100 * point.top1:.0f}% "
                     f"\u00b7 KL {point.kl:.2g}</div>")
        item.setHtml(text)
        item.figures = figures
        item.fill = pg.mkBrush(QColor(t.background))

    def fit_ranges(self, frame) -> None:
        xs = [math.log2(p.bytes_per_token) for p in self.points.values() if p.bytes_per_token is not None]
        if not xs:
            return
        # Room on either side of the points for their dots and a label under or beside the outermost, 3 in all at least.
        want = (min(xs) - 1.4, max(xs) + 0.8)
        if want[1] - want[0] < 3:
            middle = (want[0] + want[1]) / 2
            want = (middle - 1.5, middle + 1.5)
        if (tuple(self.plot.getViewBox().viewRange()[0]) != want or self._stale(self.plot, "x")) \
                and frame.may_change(self):
            self.plot.setXRange(*want, padding=0.0)
            self._placed_key = None
        # y: 0-100 % on one linear scale, from a round ten under the lowest point (the points spread over the
        # height, and their labels with them), with room over 100 % for a label.
        low = max(0.0, math.floor(min(100.0 * p.top1 for p in self.points.values()) / 10.0 - 1.5) * 10.0)
        want_y = (low, 100.0 + (100.0 - low) * 0.2)
        if (tuple(self.plot.getViewBox().viewRange()[1]) != want_y or self._stale(self.plot, "y")) \
                and frame.may_change(self):
            self.plot.setYRange(*want_y, padding=0.0)
            self._placed_key = None

    #: Where a label may sit around its point (a TextItem's anchor): right, left, under, over; never at a corner,
    #: where in a cluster it read as another point's.
    ANCHORS = ((0, 0.5), (1, 0.5), (0.5, 0), (0.5, 1))
    #: Where a label goes where none of those is free: off a corner, with a leader line to its dot.
    CORNERS = ((0, 0), (0, 1), (1, 0), (1, 1))

    def declutter(self) -> None:
        """Each label beside its point where it meets no other label and stays inside the data area (``ANCHORS`` in
        order): first every setting's name, the highest points first; then, where the room allows, its figures
        under the name. A name with no room anywhere is hidden (its point's tooltip still says it)."""
        view = self.plot.getViewBox()
        key = (tuple(view.viewRange()[0]), tuple(view.viewRange()[1]), view.width(), view.height(), self._drawn,
               self.type)
        if key == self._placed_key:
            return
        self._placed_key = key
        area = view.sceneBoundingRect()
        placed: dict[tuple[str, str], object] = {}
        # The dots: no label covers one; a label keeps its dot's radius and a gap away from its point.
        radius = self.scatter.opts["size"] / 2 + 2
        px, py = view.viewPixelSize()
        dots = []
        for p in self.points.values():
            if p.bytes_per_token is not None:
                at = view.mapViewToScene(pg.Point(math.log2(p.bytes_per_token), 100.0 * p.top1))
                dots.append(QRectF(at.x() - radius + 2, at.y() - radius + 2, 2 * radius - 4, 2 * radius - 4))

        def place(item, others, anchors=self.ANCHORS, reach: float = 1.0) -> object | None:
            point = item.point
            for anchor in anchors:
                item.setAnchor(anchor)
                item.setPos(math.log2(point.bytes_per_token) + (0.5 - anchor[0]) * 2 * radius * px * reach,
                            100.0 * point.top1 + (anchor[1] - 0.5) * 2 * radius * py * reach)
                item.updateTransform(force=True)
                rect = item.mapRectToScene(item.boundingRect())
                if area.contains(rect) and not any(rect.intersects(o) for o in list(others) + dots):
                    return rect
            return None

        order = sorted(self.labels, key=lambda k: -self.points[k].top1)
        for k in order:
            item, point = self.labels[k], self.points[k]
            item.setVisible(point.bytes_per_token is not None)
            if not item.isVisible():
                continue
            leader = self.leaders[k]
            leader.setVisible(False)
            for step in (0, 2, 4):  # the theme's label type, then smaller: a name in a cluster still shows
                self._style_label(item, point, figures=False, step=step)
                spot = place(item, placed.values())
                if spot is not None:
                    break
            if spot is None:
                # Last: a corner a little further off, a line from the dot to it (so that it reads as this point's).
                spot = place(item, placed.values(), self.CORNERS, reach=2.0)
                if spot is not None:
                    x, y = math.log2(point.bytes_per_token), 100.0 * point.top1
                    leader.setData([x, item.pos().x()], [y, item.pos().y()])
                    leader.setVisible(True)
                    step = -1  # (no figures)
            if spot is None:
                item.setVisible(False)
            else:
                placed[k] = spot
                item.step = step
        for k in list(placed):
            item, point = self.labels[k], self.points[k]
            if item.step:
                continue  # (no room for its figures: it had none for its name in the theme's type)
            name_spot = placed[k]
            self._style_label(item, point, figures=True)
            spot = place(item, [r for o, r in placed.items() if o != k])
            if spot is not None:
                placed[k] = spot
                continue
            self._style_label(item, point, figures=False)  # back to the name where it was
            place(item, [r for o, r in placed.items() if o != k])  # (the first free spot: the one it had)
            placed[k] = name_spot

    def restyle_labels(self) -> None:
        for key, item in self.labels.items():
            self._style_label(item, self.points[key], getattr(item, "figures", True))
        self._placed_key = None

    def apply_theme(self, theme: Theme) -> None:
        self.scatter.setPen(pg.mkPen(theme.background, width=1.5))
        self.scatter.setBrush(pg.mkBrush(theme.accent))
        self.scatter.setSize(8 + 2 * theme.line_width)
        for leader in self.leaders.values():
            leader.setPen(pg.mkPen(theme.muted, width=1))
        super().apply_theme(theme)
        self.restyle_labels()

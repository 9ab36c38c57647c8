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

Every point is labelled, readable at 1024x768 in presenter mode (``declutter``): beside its point where no other
label, dot or leader line is, else at the nearest free spot with a leader line to its dot, in smaller type where it
must; points on one dot share one label; a name with no room whole is elided, its tooltip saying it whole.
"""

from __future__ import annotations

import html
import logging
import math
import time
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QRectF, QTimer
from PySide6.QtGui import QColor, QFont, QFontMetrics

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import SparseAxis, format_bytes
from kvscope.ui.plots.frontier_labels import LabelPlacement
from kvscope.ui.plots.panel import PlotPanel
from kvscope.ui.theme import Theme

log = logging.getLogger(__name__)


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
        self._placed_geometry: tuple = ()
        self._placed_at = 0.0
        self._relabel_pending = False
        self.unlabelled: list[tuple[str, str]] = []  # points whose label found no spot (declutter)
        self.placed: dict[tuple[str, str], QRectF] = {}  # each shown label's box, in scene coordinates
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
        self.unlabelled, self.placed = [], {}
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
                item.textItem.document().setDocumentMargin(1)  # (Qt's 4 px around each label crowded a small plot)
                leader = self.leaders[key] = pg.PlotCurveItem(pen=pg.mkPen(self.theme.muted, width=1))
                leader.setZValue(2)
                leader.setVisible(False)
                self.plot.addItem(leader, ignoreBounds=True)
                item.setZValue(4)
                self.plot.addItem(item, ignoreBounds=True)
                item.point = point
                item.setPos(math.log2(point.bytes_per_token), 100.0 * point.top1)
                item.names = [self.label_of(point)]
                self._style_label(item, point)
                self._placed_key = None  # (a new point: every label placed again at once)
            item.setToolTip(self._tooltip(point))
        return 1

    def _tooltip(self, point: FrontierPoint) -> str:
        return (f"{self.label_of(point)}: top-1 {100 * point.top1:.1f}% over {point.tokens:,} tokens, "
                f"KL {point.kl:.4g} nats, {format_bytes(point.bytes_per_token)} per token")

    def _style_label(self, item: pg.TextItem, point: FrontierPoint, figures: bool = True, step: int = 0,
                     elide: int = 0, joined: bool = False) -> None:
        """The setting in bold (the settings of a group of overlapping points, one per line, or with ``joined``
        on one line) and, with ``figures``, its top-1 and KL on a further line (short lines: one was wider than
        the whole plot in presenter type); ``elide`` cuts each name to its first ``ELIDE_KEEP`` characters and an
        ellipsis."""
        t = self.theme
        names = getattr(item, "names", None) or [self.label_of(point)]
        if elide:
            names = [n if len(n) <= elide else n[:elide - 1] + "\u2026" for n in names]
        if joined:
            names = [", ".join(names)]
        text = "".join(f"<div style='color:{t.text}; font-size:{max(self.type.label_pt - step, 7)}pt; "
                       f"font-weight:600'>{html.escape(n)}</div>" for n in names)
        if figures:
            small = max(self.type.label_pt - 1, 8)
            text += (f"<div style='color:{t.muted}; font-size:{small}pt'>{100 * point.top1:.0f}% "
                     f"\u00b7 KL {point.kl:.2g}</div>")
        item.setHtml(text)
        item.figures = figures
        item.elided, item.joined = elide, joined
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
    #: Type steps a label may take below the theme's label type (a name in a cluster still shows).
    STEPS = (0, 2, 4, 5)
    #: Directions searched for a free spot away from a point (a leader line then joins them), in eighths of a turn.
    RING_DIRECTIONS = 16
    #: A name elided to fit keeps at least this many characters, its ellipsis included (its tooltip says it whole).
    ELIDE_KEEP = 4

    #: Seconds between two placements of the same plot's labels while its points move.
    RELABEL_S = 0.5

    def _relabel(self) -> None:
        self._relabel_pending = False
        try:
            self.declutter()
        except Exception:  # noqa: BLE001 - a timer slot: log, never raise inside Qt's event loop
            log.exception("the frontier's labels could not be placed")

    def _geometry(self, view) -> tuple:
        """What a placement depends on besides the view: each point's dot (to 3 px), name and figures."""
        out = []
        for k, p in self.points.items():
            if p.bytes_per_token is None or k not in self.labels:
                continue
            at = view.mapViewToScene(pg.Point(math.log2(p.bytes_per_token), 100.0 * p.top1))
            out.append((k, round(at.x() / 3), round(at.y() / 3), self.label_of(p), f"{100 * p.top1:.0f}",
                        f"{p.kl:.2g}"))
        return tuple(out)

    def _groups(self, dots: dict[tuple[str, str], object], radius: float) -> list[list[tuple[str, str]]]:
        """Points whose dots overlap on screen, as groups (each one label naming them all), the highest first."""
        keys = sorted(dots, key=lambda k: -self.points[k].top1)
        groups: list[list[tuple[str, str]]] = []
        for k in keys:
            at = dots[k]
            for g in groups:
                if any((dots[o].x() - at.x()) ** 2 + (dots[o].y() - at.y()) ** 2 < (1.2 * radius) ** 2 for o in g):
                    g.append(k)
                    break
            else:
                groups.append([k])
        return groups

    def declutter(self) -> None:
        """Every point's label placed where it meets no other label and no dot and stays inside the data area:
        first beside its point (``ANCHORS``; the theme's type, then smaller), then, for those with no room there,
        the nearest free spot around it with a leader line to its dot, then the same with its name elided (its
        tooltip says it whole). Points whose dots overlap share one label naming them all. Where room allows, a
        label beside its point adds its figures (top-1, KL) under the name. ``unlabelled`` lists what found no
        spot at all (none at 1024x768 in presenter mode with seven settings)."""
        view = self.plot.getViewBox()
        key = (tuple(view.viewRange()[0]), tuple(view.viewRange()[1]), view.width(), view.height(),
               tuple(self.labels), self.type)
        # The same plot: placed again only where a dot moved or a figure changed, at most every RELABEL_S (a
        # placement costs tens of ms; as friture does, text follows the data on a slow clock).
        geometry = self._geometry(view)
        if key == self._placed_key:
            if geometry == self._placed_geometry:
                return
            wait = self.RELABEL_S - (time.monotonic() - self._placed_at)
            if wait > 0:
                if not self._relabel_pending:  # (the last move of a run is placed too, once the clock allows)
                    self._relabel_pending = True
                    QTimer.singleShot(int(1000 * wait) + 1, self, self._relabel)
                return
        self._placed_key, self._placed_geometry, self._placed_at = key, geometry, time.monotonic()
        for k, item in self.labels.items():
            item.setVisible(False)
            self.leaders[k].setVisible(False)
        placement = LabelPlacement(self, view)
        groups = self._groups(placement.centres, placement.radius)
        self.unlabelled = []
        heads = []
        for group in groups:
            head = group[0]
            item = self.labels[head]
            item.names = [self.label_of(self.points[k]) for k in group]
            item.group = group
            item.centre = placement.centres[head]
            item.setToolTip("\n".join(self._tooltip(self.points[k]) for k in group))
            item.setVisible(True)
            heads.append(head)
        for k in placement.place(heads):
            self.labels[k].setVisible(False)
            self.unlabelled.extend(self.labels[k].group)
        placement.add_figures()
        self.placed = placement.placed

    def restyle_labels(self) -> None:
        for key, item in self.labels.items():
            self._style_label(item, self.points[key], getattr(item, "figures", True),
                              elide=getattr(item, "elided", 0), joined=getattr(item, "joined", False))
        self._placed_key = None

    def apply_theme(self, theme: Theme) -> None:
        self.scatter.setPen(pg.mkPen(theme.background, width=1.5))
        self.scatter.setBrush(pg.mkBrush(theme.accent))
        self.scatter.setSize(8 + 2 * theme.line_width)
        for leader in self.leaders.values():
            leader.setPen(pg.mkPen(theme.muted, width=1))
        super().apply_theme(theme)
        self.restyle_labels()

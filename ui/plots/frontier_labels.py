"""Where the frontier's point labels go: beside their points, else at the nearest free spot with a leader line.

One ``LabelPlacement`` is one placement of a ``kvscope.ui.plots.frontier.FrontierPlot``'s labels in its view as it
is now (``FrontierPlot.declutter`` decides when one is due): no label meets another label, a dot or a leader line,
and every label stays inside the data area; in smaller type where it must, its name elided last (its tooltip says
it whole); where room allows, a label beside its point adds its figures (top-1, KL) under the name.
"""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import QRectF

Key = tuple[str, str]  # a point's (attention, cache)


def crosses(x0: float, y0: float, x1: float, y1: float, rect: QRectF) -> bool:
    """Whether the segment (scene) passes through ``rect``."""
    n = max(2, int(math.hypot(x1 - x0, y1 - y0) / 3))
    return any(rect.contains(pg.Point(x0 + (x1 - x0) * i / n, y0 + (y1 - y0) * i / n)) for i in range(n + 1))


def gap(rect: QRectF, at) -> float:
    """The distance from ``at`` to the nearest point of ``rect`` (scene)."""
    return math.hypot(at.x() - min(max(at.x(), rect.left()), rect.right()),
                      at.y() - min(max(at.y(), rect.top()), rect.bottom()))


class LabelPlacement:
    """One placement of ``plot``'s labels in ``view``: ``place`` the group heads, then ``add_figures``."""

    def __init__(self, plot, view) -> None:
        self.plot, self.view = plot, view
        self.area = view.sceneBoundingRect()
        self.placed: dict[Key, QRectF] = {}
        # The dots: no label covers one; a label keeps its dot's radius and a gap away from its point.
        self.radius = plot.scatter.opts["size"] / 2 + 2
        self.px, self.py = view.viewPixelSize()
        shown = {k: p for k, p in plot.points.items() if p.bytes_per_token is not None and k in plot.labels}
        self.centres = {k: view.mapViewToScene(pg.Point(math.log2(p.bytes_per_token), 100.0 * p.top1))
                        for k, p in shown.items()}
        r = self.radius
        self.dots = [QRectF(c.x() - r + 2, c.y() - r + 2, 2 * r - 4, 2 * r - 4) for c in self.centres.values()]
        self.lines: list[tuple[float, float, float, float]] = []  # the leader lines drawn so far (scene)

    def free(self, rect: QRectF, others) -> bool:
        return self.area.contains(rect) and not any(rect.intersects(o) for o in list(others) + self.dots) and \
            not any(crosses(*line, rect) for line in self.lines)

    def segment(self, centre, rect: QRectF) -> tuple[float, float, float, float] | None:
        """The leader from the dot's edge to the nearest point of ``rect`` (None: the label touches its dot)."""
        nx = min(max(centre.x(), rect.left()), rect.right())
        ny = min(max(centre.y(), rect.top()), rect.bottom())
        dx, dy = nx - centre.x(), ny - centre.y()
        length = math.hypot(dx, dy)
        if length <= self.radius:
            return None
        return centre.x() + dx * self.radius / length, centre.y() + dy * self.radius / length, nx, ny

    def nearer_another(self, rect: QRectF, item) -> bool:
        """Whether a label without a leader is as near another dot as its own (it would read as that one's)."""
        mine = gap(rect, item.centre)
        return any(gap(rect, self.centres[k]) < mine + self.radius for k in self.centres if k not in item.group)

    def beside(self, item, others) -> QRectF | None:
        """The first of the plot's ``ANCHORS`` beside the item's point where it is free, or None."""
        point = item.point
        for anchor in self.plot.ANCHORS:
            item.setAnchor(anchor)
            item.setPos(math.log2(point.bytes_per_token) + (0.5 - anchor[0]) * 2 * self.radius * self.px,
                        100.0 * point.top1 + (anchor[1] - 0.5) * 2 * self.radius * self.py)
            item.updateTransform(force=True)
            rect = item.mapRectToScene(item.boundingRect())
            if self.free(rect, others) and not self.nearer_another(rect, item):
                return rect
        return None

    def away(self, item, centre, others) -> QRectF | None:
        """The nearest free spot on rings around ``centre`` (scene), the label centred on it, its leader crossing
        no other label and no dot but its own (its group's)."""
        view = self.view
        own = [self.centres[k] for k in item.group]
        blocks = list(others) + [d for d in self.dots if not any(d.contains(c) for c in own)]
        item.setAnchor((0.5, 0.5))
        item.setPos(view.mapSceneToView(centre))
        item.updateTransform(force=True)
        size = item.mapRectToScene(item.boundingRect())
        w, h = size.width(), size.height()
        reach = max(self.area.width(), self.area.height())
        ring = self.radius + min(w, h) / 2 + 4
        while ring < reach:
            for i in range(self.plot.RING_DIRECTIONS):
                turn = 2 * math.pi * i / self.plot.RING_DIRECTIONS
                # (an ellipse as wide as the label: a spot straight left or right keeps the label's half width)
                cx = centre.x() + math.cos(turn) * (ring + (w - h) / 2 * abs(math.cos(turn)))
                cy = centre.y() - math.sin(turn) * ring
                rect = QRectF(cx - w / 2, cy - h / 2, w, h)
                line = self.segment(centre, rect)
                # (its leader crosses no other label and no other dot)
                if self.free(rect, others) and not (line and any(crosses(*line, o) for o in blocks)):
                    item.setPos(view.mapSceneToView(pg.Point(cx, cy)))
                    item.updateTransform(force=True)
                    return item.mapRectToScene(item.boundingRect())
            ring += max(h, self.radius)
        return None

    def lead(self, k: Key, centre, rect: QRectF) -> None:
        line = self.segment(centre, rect)
        if line is None:
            return
        self.lines.append(line)
        a, b = self.view.mapSceneToView(pg.Point(*line[:2])), self.view.mapSceneToView(pg.Point(*line[2:]))
        leader = self.plot.leaders[k]
        leader.setData([a.x(), b.x()], [a.y(), b.y()])
        leader.setVisible(True)

    def attempt(self, order: list[Key]) -> list[Key]:
        """Place the labels in ``order``; returns those with no spot."""
        plot, placed = self.plot, self.placed
        placed.clear()
        self.lines.clear()
        for k in order:
            plot.leaders[k].setVisible(False)
        left = []
        for k in order:  # beside its point
            item = plot.labels[k]
            for step in plot.STEPS:
                plot._style_label(item, item.point, figures=False, step=step)
                spot = self.beside(item, placed.values())
                if spot is not None:
                    placed[k], item.step, item.away = spot, step, False
                    break
            else:
                left.append(k)
        # Then away from it, with a leader line (over no other dot: it would read as that one's); last, its
        # name elided.
        for elide, joined in ((0, False), (0, True), (6, False), (6, True), (plot.ELIDE_KEEP, False),
                              (plot.ELIDE_KEEP, True)):
            still = []
            for k in left:
                item = plot.labels[k]
                if joined and len(item.names) == 1:
                    still.append(k)  # (tried as it is)
                    continue
                for step in plot.STEPS:
                    plot._style_label(item, item.point, figures=False, step=step, elide=elide, joined=joined)
                    spot = self.away(item, self.centres[k], placed.values())
                    if spot is not None:
                        placed[k], item.step, item.away = spot, step, True
                        self.lead(k, self.centres[k], spot)
                        break
                else:
                    still.append(k)
            left = still
        return left

    def place(self, heads: list[Key]) -> list[Key]:
        """Place the heads' labels, the highest points first; a label left without a spot goes first in the next
        round (a few rounds, the best kept: fewest left, then fewest placed away from their points). Returns the
        heads whose label found no spot."""
        labels = self.plot.labels
        order, best, left = list(heads), None, []
        for _ in range(min(len(heads), 4)):
            left = self.attempt(order)
            score = (len(left), sum(labels[k].away for k in self.placed), sum(labels[k].step for k in self.placed))
            if best is None or score < best[0]:
                best = (score, list(order))
            if not left:
                break
            order = left + [k for k in order if k not in left]
        if best is not None and (order != best[1] or left):
            left = self.attempt(best[1])
        return left

    def add_figures(self) -> None:
        """Each label beside its point in the theme's type, alone on its dot, gains its figures where they fit."""
        plot, placed = self.plot, self.placed
        for k in list(placed):
            item = plot.labels[k]
            if item.step or item.away or len(item.names) > 1:
                continue  # (no room for its figures: it had none for its name in the theme's type)
            name_spot = placed[k]
            plot._style_label(item, item.point, figures=True)
            spot = self.beside(item, [r for o, r in placed.items() if o != k])
            if spot is not None:
                placed[k] = spot
                continue
            plot._style_label(item, item.point, figures=False)  # back to the name where it was
            self.beside(item, [r for o, r in placed.items() if o != k])  # (the first free spot: the one it had)
            placed[k] = name_spot

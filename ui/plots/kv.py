"""The KV plot: the cache's bytes after each token, observed and predicted, its slope, the switches' labels,
and the held earlier runs' curves under this one (the quality probe's figures are the strip under it,
``kvscope.ui.plots.quality``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import BytesAxis, format_slope
from kvscope.ui.plots.panel import Marker, PlotPanel, headroom, label_height
from kvscope.ui.theme import Theme

#: The curves of the run being shown: a label never covers them.
LIVE = ("kv_observed", "kv_predicted", "kv_reserved", "kv_used")


class KVPlot(PlotPanel):
    """KV cache bytes vs token, with the slope in its header and a labelled line per switch."""

    key = "kv"
    row = 0
    TOKEN_COLUMNS = ("kv_observed", "kv_predicted", "kv_reserved", "kv_used")
    TOOLTIP = ("KV cache bytes after each token.\nSolid: measured, the bytes of the cache's K/V tensors "
               "(element size x elements, summed over layers).\nDashed: the predictor's bytes for the same "
               "token and settings.\nVertical lines: live switches of attention mode, kernel or cache.")
    #: Heights (fractions of the plot, top down) a switch marker's label may take.
    MARKER_ROWS = (0.93, 0.81, 0.69, 0.57, 0.45, 0.33)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plot = self.add_plot({"left": BytesAxis(orientation="left")}, min_height=70, bottom_label="token",
                                  right_sample="0.888")
        # While the quality strip shows under this plot (a Sample carries the probe's figures), a right axis as wide
        # as the strip's KL axis and blank: the two data areas span the same pixels, a token over the same token.
        t = self.tokens
        self.add_curve("kv_observed", self.plot, t, "token", "kv_observed", "observed", z=1)
        self.add_curve("kv_predicted", self.plot, t, "token", "kv_predicted", "predicted", "dash", z=2)
        # A runtime that reserves ahead (the context at load: flat, filled: the prepayment) and what the tokens hold.
        self.add_curve("kv_reserved", self.plot, t, "token", "kv_reserved", "reserved", fill=True, z=0,
                       color="kv_share")
        self.add_curve("kv_used", self.plot, t, "token", "kv_used", "used", z=3, color="allocated")
        # The previous live runs' KV curves (hold_previous), under this one: the last run dotted, the one before it
        # dash-dotted (three runtimes on one plot). Not decimated: they are fixed.
        self.previous_curve = pg.PlotDataItem()
        self.older_curve = pg.PlotDataItem()
        for item in (self.previous_curve, self.older_curve):
            item.setZValue(-2)
            item.setVisible(False)
            self.plot.addItem(item)
        self.previous: list[tuple] = []  # (tokens, bytes, label), oldest first: at most two runs
        self.slope_bytes_per_token: float | None = None
        self.tokens_cache = ""  # the cache strategy of the newest token (the slope explains a quantized drop)
        self._marker_layout_key = None
        self.empty_ranges()

    def titles(self) -> tuple[str, ...]:
        return ("KV cache vs token", "KV cache", "KV")

    #: The quality strip under this plot carries the token axis (its ticks and label): the same tokens, once.
    axis_below = False

    def set_axis_below(self, on: bool) -> None:
        if on != self.axis_below:
            self.axis_below = on
            self.fit_type(force=True)

    def _values(self, spec, shown) -> bool:
        return not self.axis_below and super()._values(spec, shown)

    def _bottom_label(self, spec, shown) -> str:
        return "" if self.axis_below else super()._bottom_label(spec, shown)

    # ---- data in

    def take(self, s: Sample) -> None:
        if not s.is_event:
            self.tokens_cache = s.cache
            if s.quality_kl is not None and not self.plot.getAxis("right").isVisible():
                self.plot.showAxis("right")
                self._fit_key = None

    def token_row(self, s: Sample) -> dict:
        # A runtime that set more aside than the tokens hold (a context reserved at load) gets two
        # curves, reserved (filled) and used; one that reserves nothing ahead, the one observed curve.
        ahead = (s.kv_bytes_reserved is not None and s.kv_bytes_held is not None
                 and s.kv_bytes_reserved != s.kv_bytes_held)
        return {"kv_observed": None if ahead else s.kv_bytes_held,
                "kv_reserved": s.kv_bytes_reserved if ahead else None,
                "kv_used": s.kv_bytes_held if ahead else None,
                "kv_predicted": s.kv_bytes_predicted}

    def empty_ranges(self) -> None:
        """Axes that read as a run about to start (0-256 tokens, 0-1 MiB), not pyqtgraph's 0-1."""
        self.plot.setXRange(0, 256, padding=0.0)
        self.plot.setYRange(0, 2**20, padding=0.0)

    def reset(self) -> None:
        super().reset()
        self.slope_bytes_per_token = None
        self.plot.hideAxis("right")
        self.empty_ranges()
        self.show_previous()

    # ---- the held runs

    def hold_previous(self, label: str) -> bool:
        """Keep this run's KV curve (what the runtime reserved where it reserved ahead, else the observed) to
        draw under the next runs; the two latest stay. False if there is no curve to keep."""
        tokens = self.tokens.column("token")
        reserved, observed = self.tokens.column("kv_reserved"), self.tokens.column("kv_observed")
        if len(tokens):
            y = np.where(np.isfinite(reserved), reserved, observed)
            ok = np.isfinite(y)
            if ok.any():
                # A run of the same label replaces its older curve; the two latest runs stay (three on the plot).
                kept = [p for p in self.previous if p[2] != label]
                self.previous = (kept + [(tokens[ok].astype(float), y[ok].astype(float), label)])[-2:]
                return True
        return False

    def show_previous(self) -> None:
        held = list(self.previous)
        items = (self.older_curve, self.previous_curve) if len(held) > 1 else (self.previous_curve,)
        for item in (self.previous_curve, self.older_curve):
            self.legend.removeItem(item)
            if item not in items:
                item.setData([], [])
                item.setVisible(False)
        for item, previous in zip(items, held):
            x, y, label = previous
            item.setData(x, y)
            item.setVisible(True)
            self.legend.addItem(item, label)
        if not held:
            self.previous_curve.setData([], [])
            self.previous_curve.setVisible(False)
        self._fit_key = None
        self.fit_type()

    # ---- markers

    def marker_lines(self, marker: Marker, label: str | None):
        # pyqtgraph formats a line's label with str.format(value=...): braces from a recording
        # ("d}namic") would raise, so they are doubled.
        line = pg.InfiniteLine(movable=False, pos=marker.token, angle=90,
                               label=(label or "").replace("{", "{{").replace("}", "}}"),
                               labelOpts={"position": self.MARKER_ROWS[0], "anchors": [(0, 0.5), (0, 0.5)]})
        self.plot.addItem(line, ignoreBounds=True)
        return [(self.plot, line)]

    def label_band(self) -> float:
        """The height (px) a switch marker's label takes: the KV range keeps that much free above the curves."""
        return label_height(self.type.label_pt + 1) + 6

    def declutter(self) -> int:
        """Place the switch markers' labels so that none prints over another or over a live curve: each (in token
        order) at the
        highest row of ``MARKER_ROWS`` where its rectangle meets nothing placed; where no row is free it is
        hidden and its text joins the tooltip of the label before it (its line stays, and the events table
        lists it). Measured in the scene, at the current zoom and size. Returns the labels shown (-1: nothing
        moved since the last placement)."""
        view = self.plot.getViewBox()
        (x0, x1), _ = view.viewRange()
        # (and again every 16 tokens: the newest marker's label reaches over the tokens still to come)
        key = (x0, x1, view.width(), view.height(), len(self.markers), self.markers[-1].token if self.markers else None,
               self.type, view.viewRange()[1][1], len(self.tokens) // 16)
        if key == self._marker_layout_key:
            return -1
        self._marker_layout_key = key
        taken = []
        shown, last = 0, None
        pending: list[str] = []  # hidden before any label was shown: the next label shown counts them
        placed: list[tuple[Any, Marker, Any]] = []
        for marker in sorted(self.markers, key=lambda m: m.token):
            label = marker.lines[0].label
            if label is None:
                continue
            label.setToolTip(marker.label)
            label.setFormat(marker.label.replace("{", "{{").replace("}", "}}"))  # its own text (a "+N" of before)
            if not x0 <= marker.token <= x1:
                label.setVisible(False)
                continue
            spot = None
            label.setVisible(True)  # a hidden label measures a few px tall: measure it as it is shown
            area = view.sceneBoundingRect()
            for row in self.MARKER_ROWS:
                label.setPosition(row)
                label.updateTransform(force=True)  # else its rectangle is the one of its last paint
                rect = label.sceneBoundingRect().adjusted(-2, -1, 2, 1)
                if (area.contains(rect.adjusted(2, 1, -2, -1)) and not any(rect.intersects(o) for o in taken)
                        and not self.over_curves(rect, LIVE)):
                    spot = rect
                    break
            label.setVisible(spot is not None)
            if spot is None:
                if last is not None:  # said by the label before: its tooltip names the switches beside it
                    last[1].append(marker.label)
                else:
                    pending.append(marker.label)
                continue
            taken.append(spot)
            placed.append((label, marker, spot))
            shown += 1
            last = (label, pending + [marker.label])
            pending = []
            label.more = last[1]
        for label, marker, spot in placed:
            more = getattr(label, "more", None)
            if not more or len(more) < 2:
                continue
            label.setToolTip("\n".join(more))  # the switches whose labels had no room beside it
            # Said on screen too (issue 37: window, static, fa-on, q8_0 had no label where room was short): "mqa +2",
            # where the longer text still meets nothing placed, else the tooltip alone.
            label.setFormat(f"{marker.label} +{len(more) - 1}".replace("{", "{{").replace("}", "}}"))
            label.updateTransform(force=True)
            rect = label.sceneBoundingRect().adjusted(-2, -1, 2, 1)
            if (not view.sceneBoundingRect().contains(rect.adjusted(2, 1, -2, -1))
                    or any(rect.intersects(o) for o in taken if o is not spot) or self.over_curves(rect, LIVE)):
                label.setFormat(marker.label.replace("{", "{{").replace("}", "}}"))
                label.updateTransform(force=True)
        return shown

    # ---- drawing

    def fit_ranges(self, frame) -> None:
        tok = self.tokens.column("token")
        if len(tok):
            self.set_x(frame, self.plot, float(tok[0]), float(tok[-1]))
        top = self.top(("kv_observed", "kv_predicted", "kv_reserved", "kv_used"))
        if top is not None and self.previous:  # the held runs' curves fit too
            top = max([top] + [float(p[1].max()) for p in self.previous])
        top = self.past_excursion(tok, top)
        if top is not None:
            self.set_y(frame, self.plot, 0.0, top, headroom(self.plot.getViewBox(), self.label_band() if self.markers else 0))

    #: Once this many tokens have come since the last switch, the KV axis follows them: an earlier top more than
    #: EXCURSION times theirs (a static cache's whole context, 500 MiB, then a few MiB) runs off the top of the plot.
    EXCURSION_AFTER = 32
    EXCURSION = 8.0

    def past_excursion(self, tok: np.ndarray, top: float | None) -> float | None:
        """The y range's top after an excursion (issue 37: after a static cache the axis kept 0-500 MiB and the later
        curves drew flat at 0): at most EXCURSION times the top of the curves since the last switch, once it has
        run EXCURSION_AFTER tokens; ``top`` as it was otherwise. The drop itself still shows (8x its new level)."""
        if top is None or not self.markers or not len(tok):
            return top
        recent = tok > self.markers[-1].token
        if int(recent.sum()) < self.EXCURSION_AFTER:
            return top
        tops = [np.nanmax(col[recent]) for col in (self.tokens.column(k) for k in LIVE) if np.isfinite(col[recent]).any()]
        now = float(max(tops)) if tops else 0.0
        return min(top, self.EXCURSION * now) if now > 0 else top

    def slope(self, window: int = 32) -> float | None:
        """Bytes per token over the last ``window`` tokens since the last switch (a step is not a slope)."""
        # The newest rows only: tokens increase, so the last `window` after the marker are among them.
        tok = self.tokens.column("token")[-4 * window:]
        kv = self.tokens.column("kv_observed")[-4 * window:]
        if len(kv) and np.isnan(kv[-1]):
            # A runtime that reserved the context at load: what a token costs is the cells it fills, the
            # growth of the held bytes (flat in the sliding layers once their window is full), not the reservation.
            kv = self.tokens.column("kv_used")[-4 * window:]
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

    def refresh_labels(self) -> None:
        self.slope_bytes_per_token = self.slope()
        slope = "" if self.slope_bytes_per_token is None else format_slope(self.slope_bytes_per_token)
        if (self.slope_bytes_per_token or 0) < 0 and self.tokens_cache.startswith("quantized"):
            slope = "\u2193 residual quantized"  # the flush, not a shrinking cache: said in words
        self.set_readout(slope, self.theme.curves["kv_observed"])

    def apply_theme(self, theme: Theme) -> None:
        right = self.plot.getAxis("right")
        right.setPen(pg.mkPen(None))  # blank: room only (see __init__)
        right.setStyle(showValues=False, tickLength=0)
        self.previous_curve.setPen(pg.mkPen(theme.text, width=theme.line_width * 1.6, style=Qt.PenStyle.DotLine))
        self.older_curve.setPen(pg.mkPen(theme.accent, width=theme.line_width * 1.6, style=Qt.PenStyle.DashDotLine))
        self.readout_color = theme.curves["kv_observed"]
        super().apply_theme(theme)
        if self.previous:
            self.show_previous()  # its legend sample follows the theme too
        self._marker_layout_key = None

"""View ranges set in steps: a live plot's axes change only when the data leave them, and then by a big step.

A range that changes every frame makes every axis regenerate its ticks and pictures at 30 Hz, which costs more
than drawing the curves. Ranges grow in steps (``GROW``) and change only when the data leave them, so most frames
repaint curves only; one frame changes at most what its ``FrameBudget`` allows (``kvscope.ui.plots.live.LivePlots``
hands every panel the same budget). ``SteppedRanges`` is the part of ``kvscope.ui.plots.panel.PlotPanel`` that
does it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyqtgraph as pg

#: A view range that the data outgrows grows by this factor: each change re-renders the axes (the
#: costliest frames), so few big steps beat many small ones. The data then fills 2/3 to all of it.
GROW = 1.5


@dataclass
class FrameBudget:
    """What one frame may do: the panels it draws, and the view range changes left (each re-renders axes)."""

    panels: set[int]
    changes: float
    pending: bool = False  # a range wanted to change and could not: fit again next frame

    def may_change(self, panel: object) -> bool:
        if self.changes <= 0 or id(panel) not in self.panels:
            self.pending = True
            return False
        self.changes -= 1
        return True


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


class SteppedRanges:
    """A panel's ranges in steps: what its curves span as drawn (``top``, ``bottom``, ``top_abs``) and the view
    ranges set from them with hysteresis (``set_x``, ``set_y``). Mixed into ``PlotPanel``, whose ``curves`` (the
    drawn ``y_range`` of each) it reads and whose ``_fresh`` set marks the axes whose range belongs to this run."""

    curves: dict
    _fresh: set

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

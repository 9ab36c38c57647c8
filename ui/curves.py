"""DeviceCurve: a curve item that maps its points to device pixels itself and strokes them
untransformed (Qt's raster engine strokes a wide pen under the plot's data-to-pixel scale 3x
slower, a dashed one far slower still)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from pyqtgraph.graphicsItems.PlotCurveItem import arrayToLineSegments as _line_segments
from PySide6.QtCore import Qt
from PySide6.QtGui import QPainter, QPen, QTransform


class DeviceCurve(pg.PlotCurveItem):
    """A curve that maps its points to device pixels itself (numpy) and strokes them untransformed.

    Qt's raster engine strokes a pen wider than 1 px three times slower under the plot's data-to-pixel
    scale than in plain pixels (and a dashed path far slower still), so ``paint`` transforms the
    (already decimated) points once with numpy and draws with the identity transform: the same
    picture, cheaper. Rotated or sheared transforms (none in these plots) take pyqtgraph's path.
    """

    _LIMIT = 1e7  # device coordinates are clipped here; Qt's rasteriser misbehaves far outside int range

    def paint(self, p, opt, widget):
        x, y = self.getData()
        tr = p.transform()
        if x is None or len(x) < 2 or tr.type().value > QTransform.TransformationType.TxScale.value:
            return super().paint(p, opt, widget)
        dx = np.clip(x * tr.m11() + tr.dx(), -self._LIMIT, self._LIMIT)
        dy = np.clip(y * tr.m22() + tr.dy(), -self._LIMIT, self._LIMIT)
        connect, check = self.opts["connect"], not self.opts["skipFiniteCheck"]
        p.save()
        try:
            p.resetTransform()
            p.setRenderHint(QPainter.RenderHint.Antialiasing, bool(self.opts["antialias"]))
            brush = self.opts["brush"]
            if self.opts["fillLevel"] is not None and brush is not None and brush.style() != Qt.BrushStyle.NoBrush:
                base = float(np.clip(self.opts["fillLevel"] * tr.m22() + tr.dy(), -self._LIMIT, self._LIMIT))
                keep = np.isfinite(dx) & np.isfinite(dy)
                if keep.sum() >= 2:
                    fx, fy = dx[keep], dy[keep]
                    fill = pg.functions.arrayToQPath(np.r_[fx[0], fx, fx[-1]], np.r_[base, fy, base], "all",
                                                     finiteCheck=False)
                    fill.closeSubpath()
                    p.fillPath(fill, brush)
            pen = self.opts["pen"]
            if pen is not None and pen.style() != Qt.PenStyle.NoPen:
                # Widths are logical pixels: on a scaled display (4K at 200%) these device coordinates
                # hold devicePixelRatio pixels per logical one, so the pen grows with it.
                ratio = p.device().devicePixelRatioF() if p.device() is not None else 1.0
                if ratio != 1.0:
                    pen = QPen(pen)
                    pen.setWidthF(max(pen.widthF(), 1.0) * ratio)
                p.setPen(pen)
                if self._shouldUseDrawLineSegments(pen):
                    self._device_lines = _line_segments(dx, dy, connect, check, getattr(self, "_device_lines", None))
                    p.drawLines(*self._device_lines.drawargs())
                else:
                    p.drawPath(pg.functions.arrayToQPath(dx, dy, connect, finiteCheck=check))
        finally:
            p.restore()

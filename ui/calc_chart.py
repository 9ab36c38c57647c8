"""The calculator's chart: predicted memory against context (log scale), stacked weights, KV and activations,
with the GPU's memory, this context, the largest that fits and the trained maximum as lines.

It draws a ``kvscope.core.runtimes.calculator.Chart`` and a ``CalcFigures``; it computes nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont

from kvscope.core.model.spec import ModelSpec, human_bytes
from kvscope.core.runtimes.calculator import CalcFigures, Chart, chart_start, context_ceiling
from kvscope.ui.axes import BytesAxis, format_tokens
from kvscope.ui.theme import Theme

LAYERS = (("weights", "weights"), ("kv", "KV cache"), ("activations", "activations"))


class TokensLog2Axis(pg.AxisItem):
    """x axis whose values are log2(tokens), labelled in tokens (1K, 32K, 128K)."""

    def tickValues(self, minVal, maxVal, size):  # noqa: N802 (pyqtgraph API)
        lo, hi = math.floor(minVal), math.ceil(maxVal)
        step = 1
        while (hi - lo) / step > max(size / 55.0, 2):
            step += 1
        major = [v for v in range(lo, hi + 1) if v % step == 0 and minVal <= v <= maxVal]
        return [(step, major)]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph API)
        return [format_tokens(2 ** int(round(v))) for v in values]


def _line(angle: int, position: float, anchor: tuple[int, int]) -> pg.InfiniteLine:
    return pg.InfiniteLine(angle=angle, movable=False, label="", labelOpts={"position": position,
                           "anchors": [anchor, anchor]})


class CalcChart(pg.PlotWidget):
    """The stacked chart of the Calculator tab."""

    def __init__(self) -> None:
        super().__init__(axisItems={"left": BytesAxis(orientation="left"), "bottom": TokensLog2Axis(orientation="bottom")})
        self.setMinimumHeight(180)  # the whole tab fits 1280x720 (else it scrolls)
        self.setToolTip("Predicted memory vs context (log scale), stacked: weights, KV cache, activation peak. "
                        "Horizontal line: the GPU's memory. Vertical lines: this context, the largest that fits and "
                        "the model's trained maximum.")
        plot = self.getPlotItem()
        plot.setMenuEnabled(False)
        plot.hideButtons()
        plot.setMouseEnabled(x=False, y=False)
        self.legend = plot.addLegend(offset=(10, 10))
        self.zero = pg.PlotDataItem()
        self.layers = {key: pg.PlotDataItem() for key, _ in LAYERS}
        self.fills: dict[str, pg.FillBetweenItem] = {}
        self.swatches: dict[str, pg.PlotDataItem] = {}
        lower = self.zero
        for key, name in LAYERS:
            plot.addItem(self.layers[key])
            self.fills[key] = pg.FillBetweenItem(lower, self.layers[key])
            plot.addItem(self.fills[key])
            # A legend sample of a FillBetweenItem crashes pyqtgraph 0.14's ItemSample; a filled stand-in curve
            # (never added to the plot) draws the same swatch.
            self.swatches[key] = pg.PlotDataItem([0], [0], fillLevel=0)
            self.legend.addItem(self.swatches[key], name)
            lower = self.layers[key]
        self.memory_line = pg.InfiniteLine(angle=0, movable=False, label="", labelOpts={"position": 0.02,
                                           "anchors": [(0, 1), (0, 1)]})
        self.context_line = _line(90, 0.95, (1, 0))
        self.fit_line = _line(90, 0.80, (0, 0))
        self.trained_line = _line(90, 0.65, (1, 0))
        for line in (self.memory_line, self.context_line, self.fit_line, self.trained_line):
            plot.addItem(line, ignoreBounds=line is not self.memory_line)

    def show_curve(self, spec: ModelSpec, chart: Chart) -> None:
        """The stacked areas (a new model or settings; the context alone moves only the lines)."""
        lx = np.log2(np.asarray(chart.contexts, dtype=float))
        w, kv, act = (np.asarray(a, dtype=float) for a in (chart.weights, chart.kv, chart.activations))
        self.zero.setData(lx, np.zeros_like(lx))
        self.layers["weights"].setData(lx, w)
        self.layers["kv"].setData(lx, w + kv)
        self.layers["activations"].setData(lx, w + kv + act)
        self.getPlotItem().setXRange(math.log2(chart_start(spec)), math.log2(context_ceiling(spec)), padding=0.01)

    def show_lines(self, spec: ModelSpec, figures: CalcFigures) -> None:
        """This context, the trained maximum, the GPU's memory and the largest context that fits."""
        context, ceiling = figures.inputs.context, context_ceiling(spec)
        self.context_line.setValue(math.log2(context))
        self.context_line.label.setFormat(format_tokens(context))
        self.trained_line.setValue(math.log2(spec.max_position_embeddings))
        self.trained_line.label.setFormat(f"trained max {format_tokens(spec.max_position_embeddings)}")
        self.trained_line.setVisible(spec.max_position_embeddings < ceiling)
        memory, fit = figures.memory, figures.fit
        if memory:
            self.memory_line.setValue(memory)
            self.memory_line.label.setFormat(f"GPU {human_bytes(memory)}")
        self.memory_line.setVisible(bool(memory))
        if fit is not None and fit < ceiling:
            self.fit_line.setValue(math.log2(max(fit, 1)))
            self.fit_line.label.setFormat(f"fits up to {format_tokens(fit)}")
        self.fit_line.setVisible(fit is not None and fit < ceiling)

    def apply_theme(self, theme: Theme) -> None:
        self.setBackground(theme.background)
        plot = self.getPlotItem()
        font = QFont()
        font.setPointSize(theme.axis_pt)
        for side in ("left", "bottom"):
            axis = plot.getAxis(side)
            axis.setTickFont(font)
            axis.setTextPen(theme.muted)
            axis.setPen(theme.border)
        plot.showGrid(x=True, y=True, alpha=theme.grid_alpha)
        plot.setLabel("bottom", "context (tokens, log scale)", **{"color": theme.muted, "font-size": f"{theme.axis_pt}pt"})
        self.legend.setLabelTextColor(theme.text)
        self.legend.setLabelTextSize(f"{theme.font_pt}pt")
        for key, fill in self.fills.items():
            color = QColor(theme.curves[key])
            self.layers[key].setPen(pg.mkPen(color, width=max(1.0, theme.line_width / 2)))
            color.setAlpha(170)
            fill.setBrush(pg.mkBrush(color))
            self.swatches[key].setPen(pg.mkPen(theme.curves[key]))
            self.swatches[key].setBrush(pg.mkBrush(color))
        self.zero.setPen(None)
        label_font = QFont()
        label_font.setPointSize(theme.font_pt)
        label_font.setBold(True)
        for line, color, style in ((self.memory_line, theme.curves["budget"], Qt.PenStyle.SolidLine),
                                   (self.context_line, theme.curves["context"], Qt.PenStyle.SolidLine),
                                   (self.fit_line, theme.curves["allocated"], Qt.PenStyle.DashLine),
                                   (self.trained_line, theme.muted, Qt.PenStyle.DotLine)):
            line.setPen(pg.mkPen(color, width=theme.marker_width + 0.5, style=style))
            line.label.setColor(color)
            line.label.setFont(label_font)

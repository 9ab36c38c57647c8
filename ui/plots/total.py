"""The Total plot: the observed total against the predicted one per token, the forward passes' peaks, and
under it the prediction's error in percent (for the total and for the KV cache alone)."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt

from kvscope.core.base.sample import Sample
from kvscope.core.live.breakdown import comparable_totals, forward_peak_totals
from kvscope.core.live.compare import error_percent
from kvscope.ui.axes import BytesAxis, SparseAxis
from kvscope.ui.plots.panel import MAX_MARKS, PlotPanel
from kvscope.ui.theme import Theme


class TotalPlot(PlotPanel):
    """Observed vs predicted total (top) and the error in % (bottom); the errors' figures in its header."""

    key = "compare"
    TOKEN_COLUMNS = ("total_observed", "total_predicted", "error_total", "error_kv")
    TOOLTIP = ("Top: observed vs predicted total. Observed is the torch allocator's allocated bytes when the "
               "device has one,\notherwise the measured weights + KV tensors; the prediction is compared like "
               "with like.\nBottom: error in % of the prediction, per token, for the total and for the KV cache "
               "alone.")
    READOUT_BIG = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.total_plot = self.add_plot({"left": BytesAxis(orientation="left")}, min_height=44, bottom_values=False,
                                        stretch=3)
        self.error_plot = self.add_plot({"left": SparseAxis("left")}, min_height=34, bottom_label="token",
                                        left_label="error %", optional=True, stretch=2)
        self.error_plot.getAxis("left").enableAutoSIPrefix(False)
        # A perfect prediction is a flat 0 %; keep at least +-1 % in view so it reads as flat.
        self.error_plot.getViewBox().setLimits(minYRange=2.0)
        t = self.tokens
        # No legend box (it hid the line it named): the title and the errors' readout name the curves in
        # the curves' colours.
        self.add_curve("total_observed", self.total_plot, t, "token", "total_observed", "observed total", z=1,
                       legend=False)
        self.add_curve("total_predicted", self.total_plot, t, "token", "total_predicted", "predicted total",
                       "dash", z=2, legend=False)
        self.add_curve("error_total", self.error_plot, t, "token", "error_total", "total error %", legend=False)
        self.add_curve("error_kv", self.error_plot, t, "token", "error_kv", "KV error %", "dash", legend=False)
        self.zero_line = pg.InfiniteLine(movable=False, pos=0, angle=0)
        self.error_plot.addItem(self.zero_line, ignoreBounds=True)
        #: Forward-pass peaks (prefill, re-runs): (token, observed, predicted) and their two scatter items.
        self.peak_points: list[tuple[int, int, int]] = []
        self.peak_items: list[pg.ScatterPlotItem] = []
        self.empty_ranges()

    def titles(self) -> tuple[str, ...]:
        c = self.theme.curves

        def span(key: str, text: str) -> str:
            return f"<span style='color:{c[key]}'>{text}</span>"

        obs, pred = span("total_observed", "observed"), span("total_predicted", "predicted")
        short = f"{span('total_observed', 'obs.')} vs {span('total_predicted', 'pred.')}"
        return (f"Total: {obs} vs {pred}", f"Total: {short}", short)

    # ---- data in

    def token_row(self, s: Sample) -> dict:
        total_obs, total_pred = comparable_totals(s)
        return {"total_observed": total_obs,
                "total_predicted": total_pred,
                "error_total": error_percent(total_obs, total_pred),
                "error_kv": error_percent(s.kv_bytes_reserved, s.kv_bytes_predicted)}

    def take(self, s: Sample) -> None:
        peaks = forward_peak_totals(s)  # a prefill or a switch's re-run: its forward pass's peak, both ways
        if peaks is not None:
            self.add_peak(max(int(s.token), 0), *peaks)

    def add_peak(self, token: int, observed: int, predicted: int) -> None:
        """Mark a forward pass's peak: weights + the allocator's peak (a filled circle) and weights + the
        replayed prediction (a hollow diamond), at the token of the prefill or re-run."""
        if not self.peak_items:
            t = self.theme
            observed_item = pg.ScatterPlotItem(size=11, symbol="o", pen=pg.mkPen(t.curves["total_observed"]),
                                               brush=pg.mkBrush(t.curves["total_observed"]), name="peak observed")
            predicted_item = pg.ScatterPlotItem(size=13, symbol="d", pen=pg.mkPen(t.curves["total_predicted"], width=2),
                                                brush=pg.mkBrush(None), name="peak predicted")
            for item in (observed_item, predicted_item):
                item.setZValue(5)
                self.total_plot.addItem(item)
            self.peak_items = [observed_item, predicted_item]
        self.peak_points.append((token, observed, predicted))
        del self.peak_points[:-MAX_MARKS]
        xs = [float(x) for x, _, _ in self.peak_points]
        self.peak_items[0].setData(xs, [float(o) for _, o, _ in self.peak_points])
        self.peak_items[1].setData(xs, [float(p) for _, _, p in self.peak_points])

    def empty_ranges(self) -> None:
        self.total_plot.setXRange(0, 256, padding=0.0)
        self.total_plot.setYRange(0, 2**20, padding=0.0)

    def reset(self) -> None:
        super().reset()
        self.peak_points.clear()
        for item in self.peak_items:
            item.setData([])
        self.set_readout("")
        self.empty_ranges()

    # ---- drawing

    def fit_ranges(self, frame) -> None:
        tok = self.tokens.column("token")
        if len(tok):
            self.set_x(frame, self.total_plot, float(tok[0]), float(tok[-1]))
        hi = self.top(("total_observed", "total_predicted"))
        lo = self.bottom(("total_observed", "total_predicted"))
        if self.peak_points and hi is not None:
            hi = max(hi, max(max(o, p) for _, o, p in self.peak_points))
        if hi is not None and lo is not None:
            span = max(hi - lo, hi * 0.02, 1.0)
            self.set_y(frame, self.total_plot, max(lo - 0.05 * span, 0.0), lo + span, 1.15, base=lo)
        err = self.top_abs(("error_total", "error_kv"))
        if err is not None:
            self.set_y(frame, self.error_plot, None, max(err, 0.5), 1.3)

    def refresh_labels(self) -> None:
        t = self.theme
        err, tot = self.tokens.last("error_kv"), self.tokens.last("error_total")
        parts = []  # coloured like their curves: this readout is the error plot's legend
        if err is not None:
            parts.append(f"<span style='color:{t.curves['error_kv']}'>KV {err:+.2f}%</span>")
        if tot is not None:
            parts.append(f"<span style='color:{t.curves['error_total']}'>total {tot:+.2f}%</span>")
        self.set_readout("&nbsp;&nbsp;".join(parts), t.text)

    def apply_theme(self, theme: Theme) -> None:
        self.zero_line.setPen(pg.mkPen(theme.muted, width=1, style=Qt.PenStyle.DotLine))
        super().apply_theme(theme)
        self.refresh_labels()

"""The quality strip under the KV plot: how close the run stays to the model as loaded, per token (the quality
probe's top-1 agreement as a running mean in %, and its KL in nats), with the switches' lines.

The probe (``--quality-probe``, the controls' "Quality probe") compares every next-token distribution of the run
with the unswitched loaded model's on the same tokens (``kvscope.core.runtimes.transformers.reference``); a Sample
carries the figure of its own token (``quality_top1`` 0 or 1, ``quality_kl``). One token's 0 or 1 is no picture,
so the strip draws the running mean over the last ``WINDOW`` probed tokens, and a switch starts the mean afresh:
what the strip shows after a switch is the setting now, never a blend with the one before. The strip is shown once
a Sample carries the probe's figures (``LivePlots`` hides it otherwise).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import SparseAxis
from kvscope.ui.plots.panel import BYTES_TICK_SAMPLE, PlotPanel, mix
from kvscope.ui.theme import Theme

#: The running mean's reach: the last this many probed tokens of the setting in force.
WINDOW = 32


@dataclass(frozen=True)
class QualityFigure:
    """The running figure of the setting in force: top-1 agreement (0-1) and mean KL (nats) over ``tokens``."""

    top1: float
    kl: float
    tokens: int
    attention: str
    cache: str

    @property
    def percent(self) -> int:
        """Top-1 agreement in whole percent, rounded down (99.7% is not 'the same as the loaded model': 100 only
        when every token agreed)."""
        return int(self.top1 * 100 + 1e-9)


class QualityPlot(PlotPanel):
    """The quality probe against the loaded model: top-1 agreement (running mean, %, left) and KL (nats, right)."""

    key = "quality"
    row = 0
    #: Under the KV plot, in the top row's column (``beside`` panels go to its right).
    beside = False
    TOKEN_COLUMNS = ("quality_top1_mean", "quality_kl_mean")
    TOOLTIP = ("The quality probe: every token of the run compared with the model as loaded (its own attention, a "
               "full cache, the same tokens).\nGreen: how often the next token the run picks is the loaded model's "
               f"(mean of the last {WINDOW} tokens, %).\nRed (right axis): KL divergence of the next-token "
               f"distributions, loaded || run (mean of the last {WINDOW}, nats).\nA switch starts both means afresh.")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The left axis as wide as the KV plot's bytes axis, so that a token sits under the same token above.
        # Its bottom axis is the KV plot's token axis while it shows (``KVPlot.axis_below``).
        self.plot = self.add_plot({"left": SparseAxis("left")}, min_height=34, left_sample=BYTES_TICK_SAMPLE,
                                  right_sample="0.888", bottom_label="token")
        self.plot.getAxis("left").enableAutoSIPrefix(False)
        self.kl_view = self.add_right_view(self.plot)
        self.plot.showAxis("right")
        t = self.tokens
        self.add_curve("quality_top1_mean", self.plot, t, "token", "quality_top1_mean", "top-1 %", z=2,
                       color="allocated", legend=False)
        self.add_curve("quality_kl_mean", self.kl_view, t, "token", "quality_kl_mean", "KL", "dash", z=1,
                       color="error_total", legend=False)
        self._recent: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._setting: tuple[str, str] | None = None
        self.figure: QualityFigure | None = None  # the running figure of the newest probed token
        self.seen = False  # a Sample carried the probe's figures in this run
        self._titles_shown: tuple[str, ...] = ()
        self.empty_ranges()

    def titles(self) -> tuple[str, ...]:
        """The title is the readout (one header line: the strip is short): the running figure in the curves'
        colours, what it is compared with where it fits."""
        c, f = self.theme.curves, self.figure

        def span(key: str, text: str) -> str:
            return f"<span style='color:{c[key]}'>{text}</span>"

        if f is None:
            top1, kl = span("allocated", "top-1"), span("error_total", "KL")
            return (f"Quality vs the loaded model: {top1} &amp; {kl}", f"Quality: {top1} &amp; {kl}", f"{top1} &amp; {kl}")
        top1, kl = span("allocated", f"top-1 {f.percent}%"), span("error_total", f"KL {f.kl:.2g}")
        return (f"vs the loaded model: {top1} \u00b7 {kl}", f"{top1} \u00b7 {kl}", top1)

    # ---- data in

    def take(self, s: Sample) -> None:
        if s.is_event:
            if s.event == "switch":
                self._restart(None)
            return
        setting = (s.attention, s.cache)
        if setting != self._setting:  # (a recording whose switch events are missing still starts afresh)
            self._restart(setting)

    def _restart(self, setting: tuple[str, str] | None) -> None:
        self._recent.clear()
        self._setting = setting

    def token_row(self, s: Sample) -> dict:
        if s.quality_top1 is None or s.quality_kl is None:
            return {"quality_top1_mean": None, "quality_kl_mean": None}
        self.seen = True
        self._recent.append((int(s.quality_top1), float(s.quality_kl)))
        n = len(self._recent)
        top1 = sum(a for a, _ in self._recent) / n
        kl = sum(k for _, k in self._recent) / n
        self.figure = QualityFigure(top1, kl, n, s.attention, s.cache)
        return {"quality_top1_mean": 100.0 * top1, "quality_kl_mean": kl}

    # ---- the run's start, drawing

    def empty_ranges(self) -> None:
        self.plot.setXRange(0, 256, padding=0.0)
        self.plot.setYRange(0, 105, padding=0.0)
        self.kl_view.setYRange(0, 1, padding=0.0)

    def reset(self) -> None:
        super().reset()
        self._restart(None)
        self.figure = None
        self.seen = False
        self.empty_ranges()
        self.refresh_labels()

    def fit_ranges(self, frame) -> None:
        # The x range is the KV plot's (linked by LivePlots): a token here is the token above.
        if self._stale(self.plot, "y") and frame.may_change(self):
            self.plot.setYRange(0, 105, padding=0.0)  # agreement is 0-100 %, always on one scale
        kl_top = self.top(("quality_kl_mean",))
        if kl_top is not None:
            self.set_y(frame, self.kl_view, 0.0, max(kl_top, 0.1), 1.15)

    def refresh_labels(self) -> None:
        titles = self.titles()
        if titles != self._titles_shown:  # (the figure as printed changed: fit the header again)
            self._titles_shown = titles
            self.fit_type(force=True)

    def apply_theme(self, theme: Theme) -> None:
        right = self.plot.getAxis("right")
        right.setTextPen(theme.curves["error_total"])
        right.setPen(mix(theme.background, theme.curves["error_total"], 0.6))
        right.setStyle(tickTextOffset=6, tickLength=-6)
        super().apply_theme(theme)
        left = self.plot.getAxis("left")
        left.setTextPen(theme.curves["allocated"])
        self._titles_shown = ()
        self.refresh_labels()

"""A complete live plot in one module, as docs/extending.md's "a new plot" recipe writes one: the KV cache's bytes
per token of context, observed and predicted (a switch to fewer K/V heads, a latent or a window moves it; a growing
cache keeps it flat). ``tests/test_plot_recipe.py`` adds it to the window with one line."""

from __future__ import annotations

from kvscope.core.base.sample import Sample
from kvscope.ui.axes import BytesAxis
from kvscope.ui.plots.panel import PlotPanel


def per_token(held: int | None, context_tokens: int) -> float:
    """Bytes per token of context, or NaN (not available: drawn as a gap, never as 0)."""
    return float(held) / context_tokens if held is not None and context_tokens > 0 else float("nan")


class KVPerTokenPlot(PlotPanel):
    """KV bytes per token of context vs token, observed (solid) and predicted (dashed)."""

    key = "kv_per_token"
    row = 1  # the bottom row, beside the memory and total plots
    TOKEN_COLUMNS = ("kv_per_token_observed", "kv_per_token_predicted")
    TOOLTIP = "KV cache bytes per token of context after each token: observed (solid) and predicted (dashed)."

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plot = self.add_plot({"left": BytesAxis(orientation="left")}, min_height=40, bottom_label="token")
        t = self.tokens
        self.add_curve("kv_per_token_observed", self.plot, t, "token", "kv_per_token_observed", "observed", z=1,
                       color="kv_observed")
        self.add_curve("kv_per_token_predicted", self.plot, t, "token", "kv_per_token_predicted", "predicted", "dash",
                       z=2, color="kv_predicted")

    def titles(self) -> tuple[str, ...]:
        return ("KV bytes per token of context", "KV per token", "KV/token")

    def token_row(self, s: Sample) -> dict:
        return {"kv_per_token_observed": per_token(s.kv_bytes_held, s.context_tokens),
                "kv_per_token_predicted": per_token(s.kv_bytes_predicted, s.context_tokens)}

    def fit_ranges(self, frame) -> None:
        tok = self.tokens.column("token")
        if len(tok):
            self.set_x(frame, self.plot, float(tok[0]), float(tok[-1]))
        top = self.top(("kv_per_token_observed", "kv_per_token_predicted"))
        if top is not None:
            self.set_y(frame, self.plot, 0.0, top, 1.15)

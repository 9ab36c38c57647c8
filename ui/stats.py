"""The live numbers panel (KV now, bytes per token, KV at max context, free memory, tokens that fit).

``compute_stats`` is a pure function of the newest sample, the measured slope and the model; the
panel shows its result and is refreshed by a slow (about 1 Hz) timer, so text never competes with
the curves for the UI thread. The growth per token it falls back on is the engine's own prediction
(the session's ``predicted_slope``); the one number the engine does not send, the KV at max
context, is predicted once per settings in force (``kv_at_max_context``, memoised), not every second.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from kvscope.core import runtimes
from kvscope.core.base.sample import Sample
from kvscope.core.model.attention import parse_attention
from kvscope.core.model.caches import parse_cache
from kvscope.core.model.settings import RunSettings, parse_attn_impl
from kvscope.core.model.spec import ModelSpec, SpecError, human_bytes
from kvscope.core.prediction.forecast import format_duration
from kvscope.core.prediction.predict import kv_bytes
from kvscope.ui.axes import format_tokens


@dataclass(frozen=True)
class LiveStats:
    """What the panel shows. Bytes are ints; None means not available."""

    kv_now: int | None = None
    bytes_per_token: float | None = None
    bytes_per_token_source: str = ""  # "measured" (slope of the last tokens) or "predicted"
    kv_at_max: int | None = None
    max_context: int | None = None
    free: int | None = None
    free_source: str = ""  # "GPU (NVML)" or "host"
    tokens_fit: int | None = None
    fit_limit: str = ""  # what stops the run first: "memory" or "max context"
    tokens: int | None = None
    tokens_per_s: float | None = None
    kv_error_pct: float | None = None
    prepaid: bool = False  # the runtime allocated the whole context's KV at load (kv_now is that allocation)


@functools.lru_cache(maxsize=256)
def kv_at_max_context(spec: ModelSpec, attention: str, cache: str, attn_impl: str, dtype: str, batch: int,
                      kv_dtype: str | None, max_context: int) -> int | None:
    """The predictor's KV bytes at ``max_context`` for the settings a sample carries (its own
    spellings), or None for a spelling the predictor does not know (a newer recording's).
    Memoised: the settings change at a switch, not at every refresh."""
    try:
        settings = RunSettings(batch=batch, weight_dtype=dtype, kv_dtype=kv_dtype,
                               attention=parse_attention(attention), cache=parse_cache(cache),
                               attn_impl=parse_attn_impl(attn_impl), max_context=max_context)
        return kv_bytes(spec, settings, max_context)
    except (SpecError, ValueError):
        return None


def _reserves_at_load(runtime: str | None) -> bool:
    """Whether the runtime that made the sample reserves the whole context's KV at load (its registry entry)."""
    info = runtimes.find(runtime)
    return bool(info is not None and info.reserves_at_load)


def _free(last: Sample, host_available: int | None) -> tuple[int | None, str]:
    """Free memory and where it was read: the GPU's (NVML), else the host's available memory."""
    if last.device_total is not None and last.device_used is not None:
        return last.device_total - last.device_used, "GPU (NVML)"
    if host_available is not None:
        return host_available, "host available"
    return None, ""


def _kv_error_pct(last: Sample) -> float | None:
    if last.kv_bytes_reserved is not None and last.kv_bytes_predicted:
        return 100.0 * (last.kv_bytes_reserved - last.kv_bytes_predicted) / last.kv_bytes_predicted
    return None


def _prepaid_stats(last: Sample, max_ctx: int | None, host_available: int | None,
                   held_slope: float | None = None) -> LiveStats:
    """The runtime set the whole context's cache aside at load (reserves_at_load): the cache "now" and the KV at the max
    context are that reservation, the runtime's own allocation (issue 37: scaling held bytes per token by the
    context drifted from 72.0 to 30.9 MiB under a 27.0 MiB allocation, since sliding layers hold a window, not
    every token); a token adds no memory, it fills cells paid for already: KV per token is the growth of the held
    bytes over the last tokens (the full layers' cells once the windows are full), else held bytes / tokens; what
    stops the run is the context, not memory."""
    used, tokens = last.kv_bytes_held, last.context_tokens
    if held_slope is not None and held_slope >= 0:
        bpt, source = held_slope, "cells filled per token, prepaid"
    else:
        bpt = used / tokens if used is not None and tokens else None
        source = "held / tokens, prepaid" if bpt else ""
    free, free_source = _free(last, host_available)
    left = max(max_ctx - tokens, 0) if max_ctx else None
    kv_err = _kv_error_pct(last)
    return LiveStats(
        kv_now=last.kv_bytes_reserved, bytes_per_token=bpt, bytes_per_token_source=source,
        kv_at_max=last.kv_bytes_reserved,
        max_context=max_ctx, free=free, free_source=free_source,
        tokens_fit=left, fit_limit="the allocated context is full" if left is not None else "", tokens=last.token + 1,
        tokens_per_s=last.tokens_per_s, kv_error_pct=kv_err, prepaid=True)


def compute_stats(last: Sample | None, slope: float | None, spec: ModelSpec | None, *, batch: int = 1,
                  kv_dtype: str | None = None, max_context: int | None = None,
                  host_available: int | None = None, predicted_slope: float | None = None) -> LiveStats:
    """The panel's numbers for the newest token sample ``last``.

    ``slope`` is the measured KV growth (bytes/token over the last tokens, None if too few);
    without it ``predicted_slope`` (the engine's predicted growth over its last tokens) is used.
    ``host_available`` is the host's available memory, used for "free" when no GPU reports its memory.
    """
    if last is None:
        return LiveStats()
    max_ctx = max_context or (spec.max_position_embeddings if spec else None)
    if (last.kv_bytes_reserved is not None and last.kv_bytes_held is not None and last.kv_bytes_reserved > last.kv_bytes_held
            and _reserves_at_load(last.runtime)):
        # The whole context set aside ahead of the tokens. One that reserves ahead in steps (256 token slots at a
        # time) is not prepaid: its KV at the max context is still to be paid, and predicted below.
        return _prepaid_stats(last, max_ctx, host_available, slope)
    kv_at_max = None
    if spec is not None and max_ctx:
        kv_at_max = kv_at_max_context(spec, last.attention, last.cache, last.attn_impl, last.dtype, batch, kv_dtype,
                                      max_ctx)
    bpt, bpt_source = (slope, "measured") if slope is not None else (predicted_slope, "predicted")
    if bpt is not None and bpt < 0 and last.cache.startswith("quantized"):
        # Not a shrinking cache: the full-precision residual was just quantized (a drop every
        # residual-length tokens). Between two drops the cache grows by the full-precision size.
        bpt_source = "residual just quantized"

    free, free_source = _free(last, host_available)

    tokens_fit, limit = None, ""
    left_in_context = max(max_ctx - (last.token + 1), 0) if max_ctx else None
    if free is not None and bpt is not None and bpt > 0:
        by_memory = int(free // bpt)
        if left_in_context is not None and left_in_context <= by_memory:
            tokens_fit, limit = left_in_context, "max context"
        else:
            tokens_fit, limit = by_memory, "memory"
    elif left_in_context is not None:
        tokens_fit, limit = left_in_context, "max context"

    kv_err = _kv_error_pct(last)
    return LiveStats(
        kv_now=last.kv_bytes_held, bytes_per_token=bpt, bytes_per_token_source=bpt_source if bpt is not None else "",
        kv_at_max=kv_at_max, max_context=max_ctx, free=free, free_source=free_source, tokens_fit=tokens_fit,
        fit_limit=limit, tokens=last.token + 1, tokens_per_s=last.tokens_per_s, kv_error_pct=kv_err,
    )


class _Tile(QFrame):
    def __init__(self, name: str, tooltip: str) -> None:
        super().__init__()
        self.setObjectName("tile")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(0)
        self.name = QLabel(name)
        self.name.setObjectName("statName")
        self.value = QLabel("\u2014")
        self.value.setObjectName("statValue")
        self.value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.note = QLabel("")
        self.note.setObjectName("statNote")
        for w in (self.name, self.value, self.note):
            layout.addWidget(w)
        # A number that changes width must not re-lay out the window around it (several times a
        # second, every widget beside it repainted): the tile's width comes from its column.
        for w in (self.value, self.note):
            w.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
            w.setMinimumWidth(0)
        self.setToolTip(tooltip)
        self._style = ""

    def set(self, value: str, note: str = "") -> None:
        if self.value.text() != value:
            self.value.setText(value)
        if self.note.text() != note:
            self.note.setText(note)

    def set_value_style(self, style: str) -> None:
        """A style sheet for the number (a warning colour); re-polishing is costly, so only on a change."""
        if style != self._style:
            self._style = style
            self.value.setStyleSheet(style)


class StatsPanel(QWidget):
    """Tiles of live numbers; ``show_stats`` is called by the window's slow timer."""

    TILES = {
        "kv_now": ("KV cache now",
                   "Bytes the KV cache holds after the newest token, measured: element size x number of "
                   "elements of every K/V tensor the cache keeps, summed over layers."),
        "bytes_per_token": ("KV per token",
                            "How much the cache grows per generated token: the measured slope over the last "
                            "32 tokens since the last switch (the predictor's growth until there are enough)."),
        "kv_at_max": ("KV at max context",
                      "The predictor's bytes for a cache filled to the max context, with the settings in force now."),
        "free": ("Free memory",
                 "GPU: device total minus device used, from NVML. Without a GPU: the host's available memory "
                 "(psutil)."),
        "tokens_fit": ("Tokens that still fit",
                       "Free memory divided by KV per token, or what is left of the max context if that "
                       "comes first. A forecast for the KV cache alone."),
        "speed": ("Speed", "Generated tokens per second (wall clock, the model's forward and the measuring)."),
        "total": ("Observed total",
                  "Where the memory went (kvscope.core.live.breakdown): the observed total (GPU: NVML device used; CPU: process "
                  "RSS) and its parts,\neach measured (m), predicted (p) or n/a where the device does not say; the "
                  "stacked view below draws them."),
        "oom": ("Out of memory",
                "Forecast: free memory (GPU: NVML device free; CPU: host available) divided by the KV bytes per "
                "token\n(least squares over the last 32 tokens since the last switch), or the memory budget if "
                "that comes first.\nTurns into a warning when it is less than 10 s away at the current speed."),
    }

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.tiles: dict[str, _Tile] = {}
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(6)
        grid.setVerticalSpacing(6)
        self.grid = grid
        for i, (key, (name, tip)) in enumerate(self.TILES.items()):
            tile = _Tile(name, tip)
            self.tiles[key] = tile
        self.set_columns(1)
        self.stats = LiveStats()
        self.forecast = None

    def set_columns(self, columns: int) -> None:
        """Lay the tiles out in ``columns`` columns (1 in the side panel, more in presenter mode)."""
        for tile in self.tiles.values():
            self.grid.removeWidget(tile)
        tiles = list(self.tiles.values())
        for i, tile in enumerate(tiles):
            # A last tile alone on its row takes the whole row (the forecast: the longest text).
            span = columns - i % columns if i == len(tiles) - 1 else 1
            self.grid.addWidget(tile, i // columns, i % columns, 1, span)

    def show_stats(self, s: LiveStats) -> None:
        self.stats = s
        t = self.tiles
        t["kv_now"].set(human_bytes(s.kv_now), ("allocated at load" if s.prepaid else "measured")
                        if s.kv_now is not None else "not available")
        if s.bytes_per_token is not None and s.bytes_per_token < 0 and s.bytes_per_token_source == "residual just quantized":
            bpt = "\u2193 quantized"  # the drop, said in words: never a negative size per token
        else:
            bpt = None if s.bytes_per_token is None else human_bytes(s.bytes_per_token)
        t["bytes_per_token"].set(bpt or "n/a", s.bytes_per_token_source)
        t["kv_at_max"].set(human_bytes(s.kv_at_max),
                           (f"already paid, {format_tokens(s.max_context)} tokens" if s.prepaid else
                            f"predicted, {format_tokens(s.max_context)} tokens") if s.max_context else "")
        t["free"].set(human_bytes(s.free), s.free_source or "not available")
        fit = "n/a" if s.tokens_fit is None else f"{s.tokens_fit:,}"
        t["tokens_fit"].set(fit, f"until {s.fit_limit}" if s.fit_limit else "")
        # Three figures are enough, and a wide number would not fit a presenter-mode tile.
        speed = "n/a" if s.tokens_per_s is None else f"{s.tokens_per_s:{'.0f' if s.tokens_per_s >= 100 else '.1f'}} tok/s"
        t["speed"].set(speed, f"token {s.tokens:,}" if s.tokens is not None else "")

    def show_breakdown(self, b) -> None:
        """The observed-total tile from a ``kvscope.core.live.breakdown.Breakdown`` (None: nothing observed yet)."""
        if b is None or b.total is None:
            self.tiles["total"].set("n/a", "" if b is None else "the device does not say")
            return
        short = {"measured": "m", "predicted": "p", "measured remainder": "m"}
        parts = " \u00b7 ".join(f"{p.label} {human_bytes(p.bytes)} ({short.get(p.source, p.source)})"
                                 if p.bytes is not None else f"{p.label} n/a" for p in b.parts)
        self.tiles["total"].set(human_bytes(b.total), f"{b.total_source}: {parts}")
        self.tiles["total"].note.setWordWrap(True)

    def show_forecast(self, forecast, warning_color: str | None = None) -> None:
        """The OOM forecast tile (``kvscope.core.prediction.forecast.OomForecast`` or None); ``warning_color`` when it is near."""
        tile = self.tiles["oom"]
        self.forecast = forecast
        if forecast is None:
            tile.set("n/a", "memory not growing" if self.stats.kv_now is not None else "")
        else:
            when = f"about {format_duration(forecast.seconds)} · " if forecast.seconds is not None else ""
            if forecast.context_first is not None:  # the context ends first: that is the limit to show
                tile.set("context first", f"ends at token {_compact(forecast.context_first)}; {forecast.limit} "
                                          f"lasts to {_compact(forecast.token)}")
            else:
                tile.set(f"token {_compact(forecast.token)}", f"{when}{forecast.limit}")
        tile.set_value_style(f"color: {warning_color};" if warning_color else "")


def _compact(n: int) -> str:
    """A token count short enough for a big tile: 4,031 / 23.7M / 1.2B."""
    for size, suffix in ((1_000_000_000, "B"), (1_000_000, "M")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return f"{n:,}"

"""Axes and number formats of the plots: bytes in binary units with ticks on 1-2-2.5-5 steps that
print exactly, token counts, slopes, and an axis whose labels keep two text lines apart."""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtGui import QFont, QFontMetrics

from kvscope.core.model.spec import human_bytes

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float | None) -> str:
    """Human bytes for labels; None (not available) -> 'n/a'."""
    return human_bytes(n)


def format_slope(bytes_per_token: float) -> str:
    """'+128.0 KiB / token', '\u221219.9 KiB / token' (a cache that shrinks: a quantized cache's
    residual flush, a window filling up), '+0 B / token'."""
    sign = "\u2212" if bytes_per_token < 0 else "+"
    return f"{sign}{format_bytes(abs(bytes_per_token))} / token"


def format_count(n: float) -> str:
    """Parameter counts for people: 8_030_261_248 -> '8.03 B', 3_426_560 -> '3.43 M', 950 -> '950'."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)}"


def format_tokens(n: float | None) -> str:
    """Token counts for people: 4096 -> '4K', 131072 -> '128K', 1500 -> '1,500'."""
    if n is None:
        return "n/a"
    n = int(n)
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return f"{n:,}"


def _places(step: float) -> int:
    """Decimals that print every multiple of ``step`` exactly (2.5 -> 1, 0.25 -> 2, 20 -> 0), at most 3:
    a tick at 7.5 MiB must not read "8 MiB" (where an 8 MiB plateau would then sit above it)."""
    if not math.isfinite(step) or step <= 0:
        return 0
    for places in range(4):
        scaled = step * 10 ** places
        if abs(scaled - round(scaled)) < 1e-6 * max(1.0, scaled):
            return places
    return 3


class BytesAxis(pg.AxisItem):
    """A y axis in KiB/MiB/GiB: ticks at round multiples of a binary unit, labelled with the unit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.enableAutoSIPrefix(False)

    @staticmethod
    def _unit(value: float) -> tuple[float, str]:
        value = abs(value)
        for i, name in enumerate(_UNITS):
            if value < 1024 ** (i + 1) or i == len(_UNITS) - 1:
                return float(1024 ** i), name
        return 1.0, "B"  # pragma: no cover

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802 (pyqtgraph API)
        span = abs(maxVal - minVal)
        if not math.isfinite(span) or span <= 0:
            return super().tickSpacing(minVal, maxVal, size)
        unit, _ = self._unit(max(abs(minVal), abs(maxVal)))
        wanted = max(2.0, size / 70.0)  # about one label per 70 px
        raw = span / unit / wanted
        major = (_nice_step(raw) if raw > 0 else 1.0) * unit
        return [(major, 0.0), (major / 5.0, 0.0)]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph API)
        if not values:
            return []
        unit, name = self._unit(max(abs(v) for v in values))
        places = _places(spacing / unit if unit else spacing)
        out = []
        for v in values:
            if v == 0:
                out.append("0")
            elif v < 0:
                out.append("")  # memory is never negative; keep the axis clean
            else:
                out.append(f"{v / unit:.{places}f} {name}")
        return out


class SparseAxis(pg.AxisItem):
    """An axis whose labels never print over each other, however large the type: a vertical one keeps them two
    text lines apart (a short plot in presenter mode), a horizontal one its widest label and a gap (8,000 tokens
    on a narrow plot in presenter type read '2000400060008000': pyqtgraph spaces ticks by the plot's width
    alone)."""

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802 (pyqtgraph API)
        span = abs(maxVal - minVal)
        if not math.isfinite(span) or span <= 0 or size <= 0:
            return super().tickSpacing(minVal, maxVal, size)
        font = self.style.get("tickFont") or QFont()
        metrics = QFontMetrics(font)
        if self.orientation in ("bottom", "top"):
            guess = super().tickSpacing(minVal, maxVal, size)[0][0]  # for the labels' decimals
            widest = max(metrics.horizontalAdvance(text) for text in self.tickStrings([minVal, maxVal], 1.0, guess))
            wanted = max(1.0, size / (widest + 2.5 * metrics.horizontalAdvance("0")))
            return [(_nice_step(span / wanted), 0.0)]
        wanted = max(1.0, size / (2.2 * metrics.height()))
        return [(_nice_step(span / wanted), 0.0)]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph API)
        """Along the axis, thousands of tokens as '12k' from 10,000 up: a narrow plot keeps a label."""
        if self.orientation in ("bottom", "top") and values and max(abs(v * scale) for v in values) >= 10_000 \
                and spacing * scale >= 1000:
            return [f"{v * scale / 1000:g}k" for v in values]
        return super().tickStrings(values, scale, spacing)


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x a power of ten that is at least ``raw``."""
    power = 10.0 ** math.floor(math.log10(raw))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= raw:
            break
    return step * power

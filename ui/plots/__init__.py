"""The live plots: ``LivePlots`` (``kvscope.ui.plots.live``) holds one panel per plot, each in its own module (``kv``,
``memory``, ``total``) on the shared base ``kvscope.ui.plots.panel``."""

from kvscope.ui.plots.live import DEFAULT_CAPACITY, PANELS, LivePlots
from kvscope.ui.plots.memory import SpikeMark
from kvscope.ui.plots.panel import MAX_MARKS, Marker

__all__ = ["DEFAULT_CAPACITY", "MAX_MARKS", "PANELS", "LivePlots", "Marker", "SpikeMark"]

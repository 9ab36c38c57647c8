"""The live plots: ``LivePlots`` (``ui.plots.live``) holds one panel per plot, each in its own module (``kv``,
``memory``, ``total``) on the shared base ``ui.plots.panel``."""

from ui.plots.live import DEFAULT_CAPACITY, PANELS, LivePlots
from ui.plots.memory import SpikeMark
from ui.plots.panel import MAX_MARKS, Marker

__all__ = ["DEFAULT_CAPACITY", "MAX_MARKS", "PANELS", "LivePlots", "Marker", "SpikeMark"]

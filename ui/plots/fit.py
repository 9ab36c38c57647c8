"""Type that fits a live plot panel: its header (a title, and a readout beside it or under it), its legend row,
and the largest type size in which neither they, nor the axes, nor the plots' minimum heights clip.

A panel's type is the theme's (presenter mode: large) where the panel has room for it, and steps down a point at a
time where the title, the axes, the legend or the plots' minimum heights would not fit: nothing is clipped at
1024x768. ``FittedType`` is the part of ``kvscope.ui.plots.panel.PlotPanel`` that does it, on every resize, theme
change, new readout and new legend entry.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFont, QFontMetricsF
from PySide6.QtWidgets import QSizePolicy

from kvscope.ui.theme import Theme

#: The widest tick label a bytes axis is sized for (its width is fixed: a width that follows the labels
#: would re-lay out the plot at every range step).
BYTES_TICK_SAMPLE = "888.8 MiB"
#: Room around the panel's items (px): the layout's margins and spacing.
MARGIN = 4


@dataclass(frozen=True)
class PlotType:
    """Type sizes (points) of a panel: the theme's where they fit, smaller where they would clip."""

    title_pt: int
    axis_pt: int
    label_pt: int  # legends, marker and spike labels, small readouts
    readout_pt: int

    @staticmethod
    def of(theme: Theme, step: int = 0) -> "PlotType":
        """The theme's sizes ``step`` points smaller, never below the normal theme's smallest readable."""
        return PlotType(max(theme.title_pt - step, 9), max(theme.axis_pt - step, 8),
                        max(theme.font_pt - 1 - step, 8), max(theme.title_pt + 2 - step, 10))


def text_width(text: str, pt: float, bold: bool = False) -> float:
    font = QFont()
    font.setPointSizeF(pt)
    font.setBold(bold)
    return QFontMetricsF(font).horizontalAdvance(text)


def line_height(pt: float) -> float:
    font = QFont()
    font.setPointSizeF(pt)
    return QFontMetricsF(font).height()


def label_height(pt: float) -> float:
    """A LabelItem's height: its line and the text document's margins (4 px a side)."""
    return line_height(pt) + 8


@dataclass
class PlotSpec:
    """One plot item of a panel: how tall its data area must stay readable, and what its axes show."""

    item: pg.PlotItem
    min_height: float  # px of data area
    bottom_values: bool = True  # tick values on the bottom axis
    bottom_label: str = ""
    left_label: str = ""
    left_sample: str = BYTES_TICK_SAMPLE
    right_sample: str | None = None  # a right axis (its own scale) sized for this text, when shown
    marker_axis: str = "token"  # where a marker's line goes on this plot: "token" or "time"
    optional: bool = False  # hidden where the panel is too short for it (its figures are in the readout)
    stretch: int = 1  # its share of the height the header and legend leave


class FittedType:
    """The header, the legend row and the type of a panel (a ``pg.GraphicsLayoutWidget`` with ``plots``, the
    ``PlotSpec`` of each plot item, ``markers`` and ``style_marker_line``): ``_build_header`` makes the rows,
    ``fit_type`` chooses and applies the type, ``set_readout`` the header's readout."""

    plots: list
    markers: list

    def _build_header(self) -> None:
        """The header row (title, readout) over the plots and the legend row under them; the plots take the rest."""
        self._fit_key = None
        self.ci.layout.setContentsMargins(MARGIN, MARGIN, MARGIN, MARGIN)
        self.ci.layout.setVerticalSpacing(2)
        self.header = self.ci.addLayout(row=0, col=0)
        self.header.layout.setContentsMargins(0, 0, 0, 0)
        self.header.layout.setSpacing(0)
        self.title_label = pg.LabelItem("", justify="center")
        self.readout_label = pg.LabelItem("", justify="right")
        self.header.addItem(self.title_label, row=0, col=0)
        self.header.addItem(self.readout_label, row=0, col=1)
        # The header and the legend are as tall as their text; the plots take the rest.
        for item in (self.title_label, self.readout_label):
            item.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self._readout_below = False
        self.readout_text, self.readout_color = "", None
        self.legend = pg.LegendItem(colCount=4)
        self.legend.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)
        self.legend.layout.setContentsMargins(2, 0, 2, 0)  # its rows are all its height (as _layout_for counts)
        self._legend_row = 1  # moves under the plots as plots are added
        self.ci.addItem(self.legend, row=self._legend_row, col=0)
        self.ci.layout.setAlignment(self.legend, Qt.AlignmentFlag.AlignHCenter)

    def titles(self) -> tuple[str, ...]:
        """The title, longest first: the longest that fits is shown (rich text allowed)."""
        return ("",)

    def set_readout(self, text: str, color: str | None = None) -> None:
        """The header's readout (rich text), beside the title or under it where both do not fit."""
        if (text, color) == (self.readout_text, self.readout_color):
            return
        self.readout_text, self.readout_color = text, color
        self._fit_key = None
        self.fit_type(force=True)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name: the rows share the height 3:2, whatever the text
        return QSize(480, 300 if self.row == 0 else 200)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - never what sets the window's minimum; the type yields
        return QSize(120, 80)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if hasattr(self, "legend"):  # (GraphicsView's constructor resizes before ours has run)
            self.fit_type()

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().showEvent(event)
        self.fit_type()

    def legend_entries(self) -> list[str]:
        """The legend's entry names, in order (what the legend row must find room for)."""
        return [label.text for _, label in self.legend.items]

    def right_axes(self) -> list[tuple[pg.AxisItem, str]]:
        """The right axes shown now, with the text each is sized for."""
        return [(s.item.getAxis("right"), s.right_sample) for s in self.plots
                if s.right_sample is not None and s.item.getAxis("right").isVisible()]

    def _layout_for(self, t: PlotType, width: float, height: float, shown: list[PlotSpec],
                    labels: bool = True) -> dict | None:
        """How the panel lays out in type ``t`` within width x height px showing the plots ``shown`` (and their
        bottom axes' labels, with ``labels``), or None where something would clip."""
        self._labels = labels
        room = width - 2 * MARGIN - 4
        if room <= 0:
            return None
        title = next((text for text in self.titles() if _rich_width(text, t.title_pt) <= room), None)
        if title is None:
            return None
        readout = _rich_width(self.readout_text, self._readout_pt(t), bold=True) if self.readout_text else 0.0
        if readout > room:
            return None
        below = bool(readout) and _rich_width(title, t.title_pt) + readout + 16 > room
        ticks = max(text_width(s.left_sample, t.axis_pt) for s in self.plots) + 12
        left = ticks + (label_height(t.axis_pt) if any(s.left_label for s in shown) else 0)
        right = max([text_width(sample, t.axis_pt) + 12 for _, sample in self.right_axes()] or [0.0])
        if left + right + 80 > room:
            return None
        # The legend: as many entries a line as fit across (sample swatch 30 px, gaps), in order.
        entries = [text_width(name, t.label_pt) + 44 for name in self.legend_entries()]
        columns = len(entries) or 1
        while columns > 1 and any(sum(entries[i:i + columns]) > room for i in range(0, len(entries), columns)):
            columns -= 1
        if entries and max(entries) > room:
            return None
        legend_lines = math.ceil(len(entries) / columns) if entries else 0
        title_h = label_height(t.title_pt)
        readout_h = label_height(self._readout_pt(t)) if self.readout_text else 0.0
        header = title_h + readout_h if below else max(title_h, readout_h)
        plots_h = sum(s.min_height + self._axis_height(t, s, shown) + 2 for s in shown)
        legend_h = legend_lines * label_height(t.label_pt)
        need = header + plots_h + legend_h + 2 * MARGIN + 2 * (len(shown) + 1)
        if need > height:
            return None
        return {"title": title, "below": below, "left": math.ceil(ticks), "right": math.ceil(right),
                "columns": columns, "shown": shown, "labels": labels}

    def _axis_height(self, t: PlotType, spec: PlotSpec, shown: list[PlotSpec]) -> int:
        """The bottom axis's height: its tick values and its label, set (not left to pyqtgraph, which
        measures the values only when it paints them)."""
        values = line_height(t.axis_pt) + 6 if self._values(spec, shown) else 2
        # (pyqtgraph nudges the label 5 px down, into the room under the axis)
        return math.ceil(values + (label_height(t.axis_pt) + 5 if self._bottom_label(spec, shown) else 0))

    def _values(self, spec: PlotSpec, shown: list[PlotSpec]) -> bool:
        """Tick values on this plot's bottom axis: its own choice, and always on the lowest plot shown."""
        return spec.bottom_values or spec is shown[-1]

    def _bottom_label(self, spec: PlotSpec, shown: list[PlotSpec]) -> str:
        if not getattr(self, "_labels", True):
            return ""  # too short for them: the ticks stay ("token" and "time (s)" are in the tooltip)
        return spec.bottom_label or (self.plots[-1].bottom_label if spec is shown[-1] else "")

    def _readout_pt(self, t: PlotType) -> int:
        return t.readout_pt if self.READOUT_BIG else t.label_pt + 1

    def fit_type(self, force: bool = False) -> None:
        """The largest type (the theme's, then a point smaller at a time) in which nothing clips, applied."""
        width, height = float(self.width()), float(self.height())
        key = (width, height, self.theme, self.readout_text, tuple(self.legend_entries()),
               tuple(a.isVisible() for a, _ in self.right_axes()))
        if key == self._fit_key and not force:
            return
        self._fit_key = key
        every, needed = list(self.plots), [s for s in self.plots if not s.optional]
        # The theme's type before the optional plots, and they before the axes' labels: where both cannot be
        # had, the type stays. Each candidate the estimate lets through is applied and checked against the
        # layout's real minimum (the labels, axes and data areas as Qt sizes them).
        t = PlotType.of(self.theme)
        for step in range(0, 16):
            t = PlotType.of(self.theme, step)
            for shown, labels in ((every, True), (needed, True), (needed, False)):
                if shown is needed and needed == every and labels:
                    continue
                layout = self._layout_for(t, width, height, shown, labels)
                if layout is not None:
                    self._apply_type(t, layout)
                    least = self.ci.effectiveSizeHint(Qt.SizeHint.MinimumSize)
                    if least.height() <= height + 0.5 and least.width() <= width + 0.5:
                        return
            if t == PlotType.of(self.theme, step + 1):
                break
        # Too small even for the smallest type: the title that fits, the smallest type, what room there is.
        room = width - 2 * MARGIN - 4
        self._apply_type(t, {"title": next((x for x in self.titles() if _rich_width(x, t.title_pt) <= room),
                                           self.titles()[-1]),
                             "below": bool(self.readout_text), "columns": 1, "shown": needed, "labels": False,
                             "fits": False, "left": math.ceil(text_width(BYTES_TICK_SAMPLE, t.axis_pt) + 12),
                             "right": 0})

    def _apply_type(self, t: PlotType, layout: dict) -> None:
        theme = self.theme
        self._labels = layout["labels"]
        self.type = t
        axis_font = QFont()
        axis_font.setPointSize(t.axis_pt)
        label_style = {"color": theme.muted, "font-size": f"{t.axis_pt}pt"}
        for spec in self.plots:
            # The layout shares out the height by stretch and would squeeze one plot below its readable
            # minimum while another has room to spare: each data area asks for its minimum (where it fits).
            spec.item.getViewBox().setMinimumHeight(spec.min_height if layout.get("fits", True) else 0)
            if spec.item.isVisible() != (spec in layout["shown"]):
                spec.item.setVisible(spec in layout["shown"])
                # A hidden plot gives its row back (a hidden item keeps its place, and its minimum, otherwise).
                spec.item.setMinimumHeight(0)
                spec.item.setMaximumHeight(1e6 if spec in layout["shown"] else 0)
            for side in ("left", "bottom", "right"):
                spec.item.getAxis(side).setTickFont(axis_font)
            # A fixed axis width: tick labels that change width would re-lay out the plot every frame.
            spec.item.getAxis("left").setWidth(layout["left"])
            if spec.right_sample is not None:
                spec.item.getAxis("right").setWidth(max(layout["right"], 1) if layout["right"] else
                                                    math.ceil(text_width(spec.right_sample, t.axis_pt) + 12))
            shown = layout["shown"]
            if spec in shown:
                spec.item.getAxis("bottom").setStyle(showValues=self._values(spec, shown))
                label = self._bottom_label(spec, shown)
                if label:
                    spec.item.setLabel("bottom", label, **label_style)
                else:
                    spec.item.getAxis("bottom").showLabel(False)
                spec.item.getAxis("bottom").setHeight(self._axis_height(t, spec, shown))
            if spec.left_label:
                spec.item.setLabel("left", spec.left_label, **label_style)
        self.title_label.setText(layout["title"], color=theme.text, size=f"{t.title_pt}pt")
        if self.readout_text:
            self.readout_label.setText(self.readout_text, size=f"{self._readout_pt(t)}pt", bold=True,
                                       color=self.readout_color or theme.text)
        else:
            self.readout_label.setText("")
        if layout["below"] != self._readout_below:
            self._readout_below = layout["below"]
            self.header.removeItem(self.readout_label)
            if self._readout_below:
                self.header.addItem(self.readout_label, row=1, col=0)
            else:
                self.header.addItem(self.readout_label, row=0, col=1)
        self.readout_label.setVisible(bool(self.readout_text))
        listed = bool(self.legend.items)
        if self.legend.isVisible() != listed:
            self.legend.setVisible(listed)
        self.ci.layout.setRowMaximumHeight(len(self.plots) + 1, 1e6 if listed else 0)  # an empty legend: no row
        self.legend.setLabelTextSize(f"{t.label_pt}pt")
        if self.legend.columnCount != layout["columns"]:
            self.legend.setColumnCount(layout["columns"])
        for item, label in self.legend.items:  # labels keep the size they were made with: restyle them
            label.setText(label.text, size=f"{t.label_pt}pt", color=theme.text)
        self.legend.updateSize()
        for marker in self.markers:
            for line in marker.lines:
                if line.scene() is self.scene():
                    self.style_marker_line(marker, line)
        self.restyle_labels()

    def restyle_labels(self) -> None:
        """Labels a subclass draws in the panel's type (spike sizes): called whenever the type changes."""


def _rich_width(text: str, pt: float, bold: bool = False) -> float:
    """The width of a label's text, its markup (coloured spans) left out."""
    plain = re.sub(r"<[^>]+>", "", text).replace("&nbsp;", " ")
    return text_width(plain, pt, bold) + 6

"""Where the memory went: one stacked bar of the observed total, and a legend of its parts.

It renders ``kvscope.core.live.breakdown.Breakdown`` (the arithmetic lives there, without Qt): each part a segment of the
bar in its own colour, with its bytes and where the figure comes from (measured, predicted, a measured
remainder); a part the device does not say is listed as "n/a" and draws nothing; what the known parts leave
of the total is a hatched segment, "rest" (its row says how much, and when the parts count more than is resident, by
how much and why). Refreshed by the window's slow (about 1 Hz) timer.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPen
from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QSizePolicy, QVBoxLayout, QWidget

from kvscope.core.live.breakdown import LABELS, NA, PARTS, Breakdown
from kvscope.core.model.spec import human_bytes
from kvscope.ui.badges import ElidedLabel
from kvscope.ui.theme import Theme

#: Okabe-Ito colours, bottom of the stack first: apart for the common colour-vision deficiencies.
PART_COLORS = {
    "weights": "#7f8ea3",
    "kv_held": "#e69f00",
    "kv_reserved_free": "#f5c86a",
    "activations": "#cc79a7",
    "allocator_cache": "#009e73",
    "runtime": "#56b4e9",
    "other_processes": "#d55e00",
}
UNATTRIBUTED = "not attributed"
#: The legend's words, short enough for the side panel (its tooltip says them in full).
SHORT_LABELS = {"weights": "weights", "kv_held": "KV held", "kv_reserved_free": "KV reserved", "activations":
                "activations", "allocator_cache": "alloc. cache", "runtime": "runtime", "other_processes": "others"}
#: Where the box has room for only some rows, these stay, in this order, before the largest of the others.
KEPT_FIRST = ("kv_held", "weights")
SOURCE_SHORT = {"measured": "meas.", "predicted": "pred.", "measured remainder": "rest", NA: ""}


class _Bar(QWidget):
    """The stacked bar: each known part's share of the total, left to right in PARTS order."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[tuple[str, int]] = []
        self.total = 0
        self.background = "#20242b"
        self.setMinimumHeight(18)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_segments(self, segments: list[tuple[str, int]], total: int) -> None:
        if (segments, total) != (self.segments, self.total):
            self.segments, self.total = segments, total
            self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt's name
        p = QPainter(self)
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        p.fillRect(rect, QColor(self.background))
        if self.total > 0:
            x = rect.left()
            for name, size in self.segments:
                w = rect.width() * size / self.total
                color = PART_COLORS.get(name)
                brush = QBrush(QColor(color)) if color else QBrush(QColor("#9aa4b2"), Qt.BrushStyle.BDiagPattern)
                p.fillRect(QRectF(x, rect.top(), w, rect.height()), brush)
                x += w
        p.setPen(QPen(QColor("#9aa4b2")))
        p.drawRect(rect)
        p.end()


class BreakdownView(QGroupBox):
    """The observed total as a stacked bar, with one legend row per part (bytes and source, or n/a)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Where the memory went", parent)
        self.setToolTip("The observed total (GPU: NVML's device used; Apple: the MPS driver's allocation; CPU: this\n"
                        "process's RSS) split into weights, KV, activations, the allocator's cache (CPU: malloc's\n"
                        "free pages), the runtime's baseline (CUDA context, Python, libraries; CPU: the process at\n"
                        "the load less its weights) and other processes. Each figure says where it comes from:\n"
                        "meas. (measured), pred. (predicted), rest (the measured total less the parts above);\n"
                        "n/a where the device does not say.")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(3)
        # Elided where the column is narrow (presenter type at 1024 px), the whole text in the tooltip.
        self.total_label = ElidedLabel("\u2014")
        self.total_label.setObjectName("statNote")
        self.bar = _Bar()
        layout.addWidget(self.total_label)
        layout.addWidget(self.bar)
        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(6)
        grid.setVerticalSpacing(0)
        self.rows: dict[str, tuple[QLabel, QLabel, QLabel]] = {}
        self.swatches: dict[str, QLabel] = {}
        for i, name in enumerate((*PARTS, UNATTRIBUTED)):
            swatch = QLabel("\u25a0")
            color = PART_COLORS.get(name, "#9aa4b2")
            swatch.setStyleSheet(f"color: {color};")
            label = ElidedLabel(SHORT_LABELS.get(name, "rest"))
            label.min_shown = 2
            label.set_tip(LABELS.get(name, "rest: what the known parts leave of the observed total (on the CPU: "
                                           "Python's objects, the profiler's buffers, malloc's fragmentation)"))
            value = QLabel("n/a")
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            source = QLabel("")
            source.setObjectName("statNote")
            for col, w in enumerate((swatch, label, value, source)):
                grid.addWidget(w, i, col)
            self.rows[name] = (label, value, source)
            self.swatches[name] = swatch
        grid.setColumnStretch(1, 1)
        layout.addLayout(grid)
        self.grid = grid
        self.breakdown: Breakdown | None = None
        self._wanted: set[str] = set(PARTS)  # the rows the breakdown has something for
        self._tip = self.toolTip()
        # Never what sets the window's minimum (a 720p projector, presenter type): an explicit minimum keeps the
        # layout's own out of the window's. When the column is short, rows go whole (n/a ones first, then the
        # smallest parts; the tooltip names them), never squeezed over each other.
        self.setMinimumWidth(1)  # its height: the title and the bar (minimumSizeHint), which always show
        self._show_unattributed(False)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        """The title and the bar: in presenter type on 720 px the box was given no room for either (an empty
        frame under its title). The total's line and the rows come where there is more."""
        margins = self.layout().contentsMargins()
        frame = max(self.height() - self.contentsRect().height(), self.fontMetrics().height() + 8)
        return QSize(1, frame + margins.top() + margins.bottom() + self.bar.minimumHeight())

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        """Every row the breakdown has something for, shown or not: rows hidden for lack of room (presenter type)
        shrank the hint, the column then never gave the room back, and after F11 and back the legend was gone
        (issue 37)."""
        base = super().sizeHint()
        margins = self.layout().contentsMargins()
        frame = max(self.height() - self.contentsRect().height(), self.fontMetrics().height() + 8)
        rows = sum(name in self._wanted for name in (*PARTS, UNATTRIBUTED))
        want = (frame + margins.top() + margins.bottom() + self.total_label.sizeHint().height()
                + self.bar.minimumHeight() + 2 * self.layout().spacing() + rows * self._row_height())
        return QSize(base.width(), max(base.height(), want))

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._fit_rows()

    def _row_height(self) -> int:
        return max(w.sizeHint().height() for w in self.rows[PARTS[0]]) + self.grid.verticalSpacing()

    def _fit_rows(self) -> None:
        """Show the rows that fit in the box's height, whole: where they do not all fit, n/a rows go first, then
        the smallest parts, the KV cache and the weights last (``KEPT_FIRST``); the tooltip lists what is not shown."""
        layout = self.layout()
        # The layout's own rectangle: below the title, which the box's contentsRect does not leave out (the
        # total's line was drawn with its top under the title in presenter type).
        top = layout.contentsRect().height()
        if layout.geometry().isEmpty():  # not laid out yet: the box's own rectangle, as near as it is
            margins = layout.contentsMargins()
            top = self.contentsRect().height() - margins.top() - margins.bottom()
        label_h, bar_h = self.total_label.sizeHint().height(), self.bar.minimumHeight()  # (the bar has no size hint)
        # Shorter still: the total's line goes, then the bar (the tooltip and the numbers panel say it); the bar is
        # the picture, and the last to go.
        self.bar.setVisible(top >= bar_h)
        self.total_label.setVisible(top >= label_h + bar_h + layout.spacing())
        used = label_h + bar_h + 2 * layout.spacing()
        room = max(int((top - used) // max(self._row_height(), 1)), 0)
        wanted = [name for name in (*PARTS, UNATTRIBUTED) if name in self._wanted]
        sizes = {p.name: p.bytes for p in self.breakdown.parts} if self.breakdown is not None else {}
        if self.breakdown is not None and self.breakdown.unattributed:
            sizes[UNATTRIBUTED] = abs(self.breakdown.unattributed)
        # The KV cache (what the app is about) and the weights (what it is weighed against) first, then the largest.
        keep = set(sorted(wanted, key=lambda n: (KEPT_FIRST.index(n) if n in KEPT_FIRST else len(KEPT_FIRST),
                                                 -(sizes.get(n) if sizes.get(n) is not None else -1)))[:room])
        for name in (*PARTS, UNATTRIBUTED):
            on = name in keep
            for w in (*self.rows[name], self.swatches[name]):
                if w.isVisibleTo(self) != on:
                    w.setVisible(on)
        dropped = [SHORT_LABELS.get(n, "rest") for n in wanted if n not in keep]
        self.setToolTip(self._tip + (f"\nNot shown for lack of room: {', '.join(dropped)}." if dropped else ""))

    def apply_theme(self, theme: Theme) -> None:
        self.bar.background = theme.panel
        self.bar.update()

    def _show_unattributed(self, on: bool) -> None:
        (self._wanted.add if on else self._wanted.discard)(UNATTRIBUTED)
        self._fit_rows()

    def show_breakdown(self, b: Breakdown | None) -> None:
        """Show ``b`` (None: nothing observed yet)."""
        self.breakdown = b
        if b is None or b.total is None:
            self.total_label.setText("no observation yet" if b is None else "total: n/a (the device does not say)")
            self.bar.set_segments([], 0)
            for name in PARTS:
                self.rows[name][1].setText("n/a")
                self.rows[name][2].setText("")
            self._show_unattributed(False)
            return
        self.total_label.setText(f"{human_bytes(b.total)} observed \u00b7 {b.total_source}")
        segments = [(p.name, p.bytes) for p in b.parts if p.bytes]
        rest = b.unattributed
        if rest:
            segments.append((UNATTRIBUTED, max(rest, 0)))
        self.bar.set_segments(segments, max(b.total, sum(size for _, size in segments)))
        for p in b.parts:
            _, value, source = self.rows[p.name]
            value.setText(human_bytes(p.bytes) if p.bytes is not None else "n/a")
            source.setText(SOURCE_SHORT.get(p.source, p.source))
        self._show_unattributed(bool(rest))
        if rest:
            # Never a negative part (issue 37 showed "-399.4 MiB parts exceed"): the excess, said as one. On the CPU
            # the total is the resident set, and a runtime's weights mapped from their file (llama.cpp's mmap) count
            # whole in the parts while only the pages read are resident.
            self.rows[UNATTRIBUTED][1].setText(human_bytes(abs(rest)))
            why = "over the total: mapped, not resident" if b.total_source == "process RSS" else \
                "over the total: read at other instants"
            self.rows[UNATTRIBUTED][2].setText("rest" if rest > 0 else why)

"""The Live tab's layout: the controls on the left; the badges, the plots (an alert over them) and the events
under them in the centre; the numbers, where the memory went and the streamed text on the right.

It builds the columns and lays them out for the window's width and for presenter mode; it renders nothing that
a run says (the window wires the session to the widgets it holds).
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QFont, QFontMetrics
from PySide6.QtWidgets import QGroupBox, QHeaderView, QLabel, QScrollArea, QSizePolicy, QSplitter, QTabWidget, QVBoxLayout, QWidget

from kvscope.ui.alert import AlertOverlay
from kvscope.ui.badges import STATE_TEXT, BadgeRow
from kvscope.ui.breakdown_view import BreakdownView
from kvscope.ui.controls import ControlsPanel
from kvscope.ui.demo_banner import DemoBanner
from kvscope.ui.diagnose import EventsTable, GpuProcessesPanel
from kvscope.ui.plots import LivePlots
from kvscope.ui.stats import StatsPanel, compute_stats
from kvscope.ui.text_view import StreamView
from kvscope.ui.theme import HEADER_PAD_PX, HEADER_WEIGHT, Theme

#: Column widths (logical px) that let the window fit 1280x720 with every control reachable.
RIGHT_MIN_W, RIGHT_MAX_W = 200, 420
#: Narrower than this, the window lays itself out for a small screen (``fit_to_width``).
COMPACT_W = 1400
RIGHT_COMPACT_W = 230
#: A plots' column narrower than this stacks the memory plot over the predicted-vs-observed pair.
STACK_BELOW_W = 640
#: The bottom row's panels shown below ``COMPACT_W`` (the memory and total plots); a plot added after them waits.
BOTTOM_ROW_COMPACT = 2


def _column(*widgets, stretch_last: bool = False, margins=(4, 4, 4, 0)) -> QWidget:
    column = QWidget()
    layout = QVBoxLayout(column)
    layout.setContentsMargins(*margins)
    for i, w in enumerate(widgets):
        layout.addWidget(w, 1 if stretch_last and i == len(widgets) - 1 else 0)
    return column


class WholeTilesScroll(QScrollArea):
    """The numbers' scroll area: it shows whole tiles only. Squeezed by the column (presenter type at 1024x768, the
    speaker never scrolls), its viewport ended inside a tile and the audience saw a number cut at its bottom
    ("Free memory" with no value, issue 37); the viewport now ends under the last tile that fits whole, the rest
    of its height left blank, and the scroll bar reaches the others."""

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self.snap()

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt's name
        handled = super().eventFilter(watched, event)  # (QScrollArea follows its widget's resizes here)
        if watched is self.widget() and event.type() in (QEvent.Type.Resize, QEvent.Type.LayoutRequest):
            QTimer.singleShot(0, self, self.snap)  # the tiles moved (their columns, their type): after the layout
        return handled

    def snap(self) -> None:
        panel = self.widget()
        if panel is None:
            return
        room = self.height() - 2 * self.frameWidth()
        bottoms = sorted({t.geometry().bottom() + 1 for t in panel.findChildren(QWidget, "tile") if t.isVisibleTo(panel)})
        fits = [b for b in bottoms if b <= room]
        blank = room - fits[-1] if fits and bottoms[-1] > room else 0
        if self.viewportMargins().bottom() != blank:
            self.setViewportMargins(0, 0, 0, blank)


class LiveTab(QSplitter):
    """The three columns of the Live tab. ``sampler_label`` (the status line's) goes under the events table."""

    def __init__(self, theme: Theme, sampler_label: QLabel) -> None:
        super().__init__(Qt.Orientation.Horizontal)
        self.controls = ControlsPanel()
        self.badge_row = BadgeRow()
        self.plots = LivePlots(theme)
        self.plots.quality_changed.connect(self.badge_row.show_quality)  # the probe's running figure on the badge
        self.demo_banner = DemoBanner()
        self.alert = AlertOverlay(self.plots)
        self.events_table = EventsTable(theme)
        self.gpu_panel = GpuProcessesPanel(theme)
        self.diag_tabs = QTabWidget()
        self.diag_tabs.setDocumentMode(True)
        self.diag_tabs.addTab(self.events_table, "Events and spikes")
        self.diag_tabs.addTab(self.gpu_panel, "GPU processes")
        diag = _column(self.diag_tabs, sampler_label, margins=(0, 0, 0, 0))
        diag.layout().setSpacing(2)
        diag.layout().setStretch(0, 1)
        self.centre_splitter = QSplitter(Qt.Orientation.Vertical)
        self.centre_splitter.addWidget(self.plots)
        self.centre_splitter.addWidget(diag)
        self.centre_splitter.setStretchFactor(0, 4)
        self.centre_splitter.setStretchFactor(1, 1)
        self.centre_splitter.setSizes([700, 260])
        centre = _column(self.demo_banner, self.badge_row, self.centre_splitter, stretch_last=True)

        self.stats_panel = StatsPanel()
        self.text_view = StreamView()
        text_box = QGroupBox("Generated text")
        tl = QVBoxLayout(text_box)
        tl.setContentsMargins(4, 4, 4, 4)
        tl.addWidget(self.text_view)
        text_box.setMinimumHeight(120)
        # The numbers scroll rather than push the window taller than a 720p projector.
        self.stats_scroll = WholeTilesScroll()
        self.stats_scroll.setWidget(self.stats_panel)
        self.stats_scroll.setWidgetResizable(True)
        self.stats_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.stats_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.stats_scroll.setMinimumHeight(160)
        self.stats_scroll.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self.breakdown_view = BreakdownView()  # where the memory went (kvscope.core.live.breakdown), each slow tick
        self.right_panel = _column(self.stats_scroll, self.breakdown_view, text_box, stretch_last=True)
        self.right_panel.setMinimumWidth(RIGHT_MIN_W)
        self.right_panel.setMaximumWidth(RIGHT_MAX_W)

        for i, w in enumerate((self.controls, centre, self.right_panel)):
            self.addWidget(w)
            self.setStretchFactor(i, 1 if i == 1 else 0)
        self.setSizes([320, 1000, 280])
        self._layout_key: tuple | None = None
        self._normal_centre_sizes: list[int] | None = None

    # ---- what a run resets and marks

    def clear(self) -> None:
        """Clear plots, text and numbers (a new run or a new recording)."""
        self.plots.reset()
        self.text_view.reset()
        self.stats_panel.show_stats(compute_stats(None, None, None))
        self.stats_panel.show_forecast(None)
        self.events_table.clear_rows()

    def show_spike(self, spike, token: int | None) -> None:
        self.plots.add_spike(spike.time_s, spike.after, spike.rise_bytes, spike.cause)
        self.events_table.add_spike(spike, token)

    def reserve_badges(self, theme: Theme) -> None:
        """The attention and cache badges as wide as the longest choice they may show."""
        self.badge_row.reserve("attention", [c.upper() for c in self.controls.attention_choices], theme.title_pt)
        self.badge_row.reserve("cache", [k for k, _ in self.controls.cache_choices], theme.title_pt)
        # The kernels a CPU or GPU run names most (core/runtimes/transformers/kernels.py measures them); every run state, whole.
        self.badge_row.reserve("kernel", ["sdpa-flash-cpu", "sdpa-math", "sdpa-flash", "eager"], theme.title_pt)
        self.badge_row.reserve("state", list(STATE_TEXT.values()), theme.title_pt, most=400)

    def apply_theme(self, old: Theme, theme: Theme) -> None:
        self.text_view.recolor(old, theme)
        self.reserve_badges(theme)  # the type size changed (presenter mode): so did the widest choice
        self.plots.apply_theme(theme)
        self.breakdown_view.apply_theme(theme)
        self.events_table.recolor(old, theme)
        self.gpu_panel.theme = theme
        # The events table's titles are elided when a section resizes; the type changed under them (presenter mode:
        # "etail / likely ca." in the real window at 1024x768, issue 37): fit them again once the new type is in force.
        QTimer.singleShot(0, self.events_table, self._refit_event_titles)
        QTimer.singleShot(0, self.stats_scroll, self.stats_scroll.snap)

    def _refit_event_titles(self) -> None:
        """The events table's column titles elided again for the type now in force (``elide_headers``'s rule: the
        whole title in the section's tooltip once cut)."""
        table = self.events_table
        header = table.horizontalHeader()
        font = QFont(header.font())
        font.setWeight(QFont.Weight(HEADER_WEIGHT))
        metrics = QFontMetrics(font)
        for c, title in enumerate(table.HEADERS):
            item = table.horizontalHeaderItem(c)
            if item is None or header.sectionResizeMode(c) == QHeaderView.ResizeMode.ResizeToContents:
                continue
            shown = metrics.elidedText(title, Qt.TextElideMode.ElideRight, max(header.sectionSize(c) - 2 * HEADER_PAD_PX - 2, 1))
            if item.text() != shown:
                item.setText(shown)
                item.setToolTip(title if shown != title else "")

    # ---- layout

    def fit_to_width(self, width: int, presenter: bool) -> None:
        """Below ``COMPACT_W`` (1024x768, 1280x720, 1366x768) the numbers column narrows and the memory plot gets
        60 % of the bottom row; where the plots' column is still under ``STACK_BELOW_W`` (1024 px with the
        controls shown) the memory plot and the predicted-vs-observed pair go one above the other, each the
        column's whole width (side by side they got ~240 px each: titles, time axis and legend cut); a bottom-row panel
        of ``PANELS`` past those two shows from ``COMPACT_W`` up.
        Applied when the window crosses a width, so a splitter the user drags stays where it is meanwhile."""
        compact = width < COMPACT_W
        left = 0 if presenter else max(self.controls.minimumWidth(), 1)
        right = max(self.right_panel.minimumWidth(), RIGHT_COMPACT_W) if compact else None
        centre = width - left - (right or RIGHT_MAX_W)
        # Not in presenter type: stacked, its plots' minimum heights make the window taller than a 720p screen.
        stacked = compact and centre < STACK_BELOW_W and not presenter
        key = (compact, stacked, presenter)
        if key == self._layout_key:
            return
        self._layout_key = key
        bottom = self.plots.splitter.widget(1)
        if isinstance(bottom, QSplitter):  # the bottom row's panels, however many PANELS has
            bottom.setOrientation(Qt.Orientation.Vertical if stacked else Qt.Orientation.Horizontal)
            for i in range(bottom.count()):
                bottom.setCollapsible(i, False)
                # Compact, the row keeps its first two (the memory and total plots): a third squeezed the others' data
                # areas to a few pixels at 1024x768 and cut their legends at 1280x720. The rest wait off screen (File ›
                # Export and the summary image draw them there, LivePlots.rendered) until the window is wider.
                bottom.widget(i).setVisible(i < BOTTOM_ROW_COMPACT or not compact)
            bottom.setSizes([3000, 2000] + [0] * (bottom.count() - 2) if compact else [1000] * bottom.count())  # in proportion
        if stacked:
            self.centre_splitter.setSizes([8000, 2000])  # the plots take 80 % of the height, the events the rest
            self.plots.splitter.setSizes([3000, 5000])  # the KV plot over the two others
        else:
            self.plots.splitter.setSizes([3000, 2000])  # the KV plot 3:2 over the row of the others, as built
        if compact:
            total = max(sum(self.sizes()), width)
            self.setSizes([left, max(total - left - right, 1), right])

    def presenter_layout(self, on: bool, was: bool, wide: bool) -> None:
        """Presenter mode's columns: the controls and the first-start offer hide (keys drive); the numbers widen
        (two abreast on a wide screen, so the streamed text keeps some room; on 1280 px they stay one column and
        scroll); the events table yields some height to the plots. The controls come back in ``show_controls``."""
        if on:
            self.controls.setVisible(False)
            self.demo_banner.setVisible(False)  # the first-start offer is not for the audience (half a 768 px plot)
        self.right_panel.setMaximumWidth(600 if on else RIGHT_MAX_W)
        self.right_panel.setMinimumWidth((540 if wide else 340) if on else RIGHT_MIN_W)
        self.stats_panel.set_columns(2 if on and wide else 1)
        if on and not was:
            self._normal_centre_sizes = self.centre_splitter.sizes()
            total = max(sum(self._normal_centre_sizes), 1)
            self.centre_splitter.setSizes([int(total * 0.72), int(total * 0.28)])

    def restore_centre(self) -> None:
        """The events table's height from before presenter mode."""
        if self._normal_centre_sizes:
            self.centre_splitter.setSizes(self._normal_centre_sizes)

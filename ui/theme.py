"""Colours, type sizes and line widths for the dark, light and presenter looks.

One ``Theme`` value drives both the Qt style sheet and the pyqtgraph pens, so switching looks
is a single call (``MainWindow.apply_theme``). Curve colours are picked to stay apart for the
common colour-vision deficiencies and on a washed-out projector (Okabe-Ito based).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

@dataclass(frozen=True)
class Theme:
    name: str
    background: str  # window and plot background
    panel: str  # group boxes, inputs
    border: str
    text: str
    muted: str  # secondary text, axis labels
    grid_alpha: float  # 0..1, pyqtgraph grid
    accent: str  # buttons, selection
    warning: str
    error: str
    curves: dict[str, str] = field(default_factory=dict)
    font_pt: int = 10
    title_pt: int = 11
    stat_pt: int = 18  # the big numbers of the stats panel
    axis_pt: int = 10
    line_width: float = 2.0
    marker_width: float = 1.5
    presenter: bool = False

    def pen(self, key: str, style: str = "solid", width: float | None = None) -> dict:
        """Arguments for ``pg.mkPen`` of the curve ``key`` (see ``curves``)."""
        from PySide6.QtCore import Qt

        styles = {"solid": Qt.PenStyle.SolidLine, "dash": Qt.PenStyle.DashLine, "dot": Qt.PenStyle.DotLine}
        return {"color": self.curves.get(key, self.text), "width": width or self.line_width, "style": styles[style],
                "cosmetic": True}


_CURVES_DARK = {
    "kv_observed": "#56b4e9",  # sky blue
    "kv_predicted": "#f0e442",  # yellow, dashed on top
    "marker": "#ff7eb6",  # pink: switch markers
    "device_total": "#9aa4b2",
    "device_used": "#ff6b6b",
    "process": "#56b4e9",
    "process_gpu": "#56b4e9",
    "process_rss": "#56b4e9",
    "reserved": "#cc79a7",
    "allocated": "#66d9a0",
    "kv_share": "#e69f00",
    "total_observed": "#56b4e9",
    "total_predicted": "#f0e442",
    "error_total": "#ff6b6b",
    "error_kv": "#66d9a0",
    "weights": "#7f8ea3",
    "kv": "#e69f00",
    "activations": "#cc79a7",
    "budget": "#ff6b6b",
    "context": "#f0e442",
}

_CURVES_LIGHT = {
    "kv_observed": "#0060a8",
    "kv_predicted": "#d55e00",
    "marker": "#b0005a",
    "device_total": "#555d68",
    "device_used": "#c62828",
    "process": "#0060a8",
    "process_gpu": "#0060a8",
    "process_rss": "#0060a8",
    "reserved": "#8e3b78",
    "allocated": "#1b7a45",
    "kv_share": "#c77700",
    "total_observed": "#0060a8",
    "total_predicted": "#d55e00",
    "error_total": "#c62828",
    "error_kv": "#1b7a45",
    "weights": "#6b7889",
    "kv": "#d98a00",
    "activations": "#a4508b",
    "budget": "#c62828",
    "context": "#d55e00",
}

DARK = Theme(
    name="dark", background="#12151b", panel="#1b2029", border="#2c3340", text="#e8ecf1", muted="#9aa4b2",
    grid_alpha=0.18, accent="#3d8bfd", warning="#f0b429", error="#ff6b6b", curves=_CURVES_DARK,
)
LIGHT = Theme(
    name="light", background="#fbfbfd", panel="#eef1f5", border="#cdd3dc", text="#15191f", muted="#55606e",
    grid_alpha=0.25, accent="#1f6feb", warning="#8f5c00", error="#c62828", curves=_CURVES_LIGHT,
)


def theme(name: str = "dark", presenter: bool = False) -> Theme:
    """The theme called ``name``; ``presenter`` makes it high-contrast with large type and thick lines."""
    base = LIGHT if name == "light" else DARK
    if not presenter:
        return base
    if base.name == "dark":
        # Pure black and full-brightness text survive a projector's contrast loss.
        base = replace(base, background="#000000", panel="#0b0d11", border="#3a4250", text="#ffffff",
                       muted="#d0d6de", grid_alpha=0.28)
    else:
        base = replace(base, background="#ffffff", panel="#f2f4f7", text="#000000", muted="#2a2f36", grid_alpha=0.3)
    return replace(base, font_pt=16, title_pt=20, stat_pt=30, axis_pt=16, line_width=4.5, marker_width=3.0,
                   presenter=True)


#: A table header section's side padding and weight (``kvscope.ui.diagnose.elide_headers`` fits its labels with them).
HEADER_PAD_PX = 6
HEADER_WEIGHT = 600


def stylesheet(t: Theme) -> str:
    """Qt style sheet for the whole window."""
    return f"""
    QWidget {{ background: {t.background}; color: {t.text}; font-size: {t.font_pt}pt; }}
    QToolTip {{ background: {t.panel}; color: {t.text}; border: 1px solid {t.border}; padding: 6px;
                font-size: {max(t.font_pt - 1, 9)}pt; }}
    QGroupBox {{ border: 1px solid {t.border}; border-radius: 6px; margin-top: 1.3em; padding: 8px 6px 6px 6px; }}
    QGroupBox::title {{ subcontrol-origin: margin; left: 8px; padding: 0 4px; color: {t.muted};
                        font-weight: 600; }}
    QLineEdit, QPlainTextEdit, QTextEdit, QComboBox, QSpinBox, QAbstractSpinBox {{
        background: {t.panel}; border: 1px solid {t.border}; border-radius: 4px; padding: 3px 6px;
        selection-background-color: {t.accent}; }}
    QComboBox QAbstractItemView {{ background: {t.panel}; selection-background-color: {t.accent}; }}
    QComboBox:disabled, QLineEdit:disabled, QSpinBox:disabled {{ color: {t.muted}; }}
    QPushButton {{ background: {t.panel}; border: 1px solid {t.border}; border-radius: 5px; padding: 5px 14px; }}
    QPushButton:hover {{ border-color: {t.accent}; }}
    QPushButton:disabled {{ color: {t.muted}; }}
    QPushButton#primary {{ background: {t.accent}; color: #ffffff; border-color: {t.accent}; font-weight: 600; }}
    QPushButton#primary:disabled {{ background: {t.panel}; color: {t.muted}; border-color: {t.border}; }}
    QTabWidget::pane {{ border: none; }}
    QTabBar::tab {{ background: {t.panel}; color: {t.muted}; padding: 6px 18px; border: 1px solid {t.border};
                    border-bottom: none; border-top-left-radius: 5px; border-top-right-radius: 5px; }}
    QTabBar::tab:selected {{ background: {t.background}; color: {t.text}; font-weight: 600; }}
    QStatusBar {{ background: {t.panel}; color: {t.text}; border-top: 1px solid {t.border}; }}
    QStatusBar QLabel {{ background: transparent; padding: 0 8px; }}
    QMenuBar {{ background: {t.panel}; }}
    QMenuBar::item:selected, QMenu::item:selected {{ background: {t.accent}; color: #ffffff; }}
    QMenu {{ background: {t.panel}; border: 1px solid {t.border}; }}
    QSlider::groove:horizontal {{ height: 6px; background: {t.border}; border-radius: 3px; }}
    QSlider::handle:horizontal {{ background: {t.accent}; width: 16px; margin: -6px 0; border-radius: 8px; }}
    QSlider::sub-page:horizontal {{ background: {t.accent}; border-radius: 3px; }}
    QSplitter::handle {{ background: {t.border}; }}
    QScrollBar:vertical {{ background: {t.background}; width: 10px; }}
    QScrollBar::handle:vertical {{ background: {t.border}; border-radius: 5px; min-height: 24px; }}
    QTableView {{ background: {t.background}; alternate-background-color: {t.panel}; gridline-color: {t.border};
                  border: 1px solid {t.border}; selection-background-color: {t.accent}; }}
    QHeaderView::section {{ background: {t.panel}; color: {t.muted}; border: none;
                            border-bottom: 1px solid {t.border}; padding: 3px {HEADER_PAD_PX}px;
                            font-weight: {HEADER_WEIGHT}; }}
    QTableCornerButton::section {{ background: {t.panel}; border: none; }}
    QFrame#banner {{ background: {t.panel}; border: 1px solid {t.accent}; border-radius: 6px; }}
    QFrame#banner QLabel {{ background: transparent; }}
    QLabel#statValue {{ font-size: {t.stat_pt}pt; font-weight: 700; }}
    QLabel#statName {{ color: {t.muted}; font-size: {max(t.font_pt - 1, 9)}pt; }}
    QLabel#statNote {{ color: {t.muted}; font-size: {max(t.font_pt - 2, 8)}pt; }}
    QLabel#badge {{ background: {t.panel}; border: 1px solid {t.border}; border-radius: 6px; padding: 3px 10px;
                    font-weight: 700; font-size: {t.title_pt}pt; }}
    QLabel#modelName {{ font-weight: 700; font-size: {t.title_pt + 1}pt; padding: 3px 2px; }}
    QLabel#badgeName {{ color: {t.muted}; font-size: {max(t.font_pt - 1, 9)}pt; }}
    QLabel#error {{ color: {t.error}; }}
    QLabel#warning {{ color: {t.warning}; }}
    QLabel#formula {{ font-family: "DejaVu Sans Mono", monospace; font-size: {t.title_pt}pt; }}
    QLabel#headline {{ font-size: {t.stat_pt}pt; font-weight: 700; }}
    """

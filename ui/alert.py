"""The alert over the plots: the OOM forecast's warning, an out-of-memory error, the memory budget reached.

It floats over the top of its host (the plots) rather than pushing them down, so the layout never jumps when a
warning comes and goes mid-run; it follows the host's size itself.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject
from PySide6.QtWidgets import QLabel, QWidget

from kvscope.ui.theme import Theme


class AlertOverlay(QLabel):
    """A word-wrapped label across the top of ``host``, as tall as its text needs; hidden until ``show_alert``."""

    def __init__(self, host: QWidget) -> None:
        super().__init__("", host)
        self.host = host
        self.setObjectName("alert")
        self.setWordWrap(True)
        self.setVisible(False)
        host.installEventFilter(self)

    def show_alert(self, text: str, kind: str, theme: Theme) -> None:
        """``kind`` "error" in the error colour, anything else as a warning."""
        color = theme.error if kind == "error" else theme.warning
        self.setText(text)
        self.setStyleSheet(f"QLabel#alert {{ color: {color}; background: {theme.panel}; border: 2px solid {color}; "
                           f"border-radius: 6px; padding: 6px 10px; font-weight: 700; font-size: {theme.title_pt}pt; }}")
        self.setVisible(True)
        self.place()

    def place(self) -> None:
        """Across the top of the host, as tall as its text needs."""
        width = max(self.host.width() - 24, 100)
        self.setFixedWidth(width)
        self.setFixedHeight(self.heightForWidth(width))
        self.move(12, 6)
        self.raise_()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt's name
        if watched is self.host and event.type() == QEvent.Type.Resize and self.isVisible():
            self.place()
        return super().eventFilter(watched, event)

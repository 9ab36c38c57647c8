"""The first start's offer: a banner over the plots that plays the demo recording (non-modal: screenshots and
tests never wait on it)."""

from __future__ import annotations

from PySide6.QtCore import QSettings, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton

from kvscope.ui.file_actions import demo_recording_path

FIRST_START_KEY = "app/first_start_done"


class DemoBanner(QFrame):
    """``play``: the user asked for the demo (the banner has hidden itself)."""

    play = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.setObjectName("banner")
        row = QHBoxLayout(self)
        row.setContentsMargins(10, 4, 4, 4)
        text = QLabel("New here? Replay a run recorded with the embedded model: MHA \u2192 GQA \u2192 MQA, "
                      "flash off \u2192 on, dynamic \u2192 static cache. No model or GPU needed.")
        text.setWordWrap(True)
        self.text = text
        self.button = QPushButton("\u25b6 Play the demo recording")
        self.button.setObjectName("primary")
        self.button.clicked.connect(self._play)
        close = QPushButton("\u2715")
        close.setToolTip("Hide (File \u203a Open recording plays it later)")
        close.setFlat(True)
        close.clicked.connect(lambda: self.setVisible(False))
        row.addWidget(text, 1)
        row.addWidget(self.button)
        row.addWidget(close)
        self.setVisible(False)

    def set_compact(self, compact: bool) -> None:
        """On a short window (the 884x515 minimum) the offer is its button alone, one row: the text of three wrapped
        lines crushed the plots to about 30 px there (issue 37); its tooltip says the rest."""
        self.text.setVisible(not compact)
        self.button.setToolTip(self.text.text() if compact else "")

    def _play(self) -> None:
        self.setVisible(False)
        self.play.emit()

    def offer_once(self, settings: QSettings) -> None:
        """Shown at the first start only (remembered in ``settings``), and only where the demo is shipped."""
        if settings.value(FIRST_START_KEY, False, type=bool):
            return
        settings.setValue(FIRST_START_KEY, True)
        settings.sync()
        if demo_recording_path().is_file():
            self.setVisible(True)

"""The window as the README's screenshot scripts drive it: one place for the set-up they share.

A fresh QSettings file (no first-start demo banner, no remembered source), the size the command line
gives (``script.py OUT [WIDTH HEIGHT]``, default 1280x720), and a run started and waited for to its end.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any


def fresh_window(default_out: str) -> tuple[Any, Any, str]:
    """(the QApplication, a shown MainWindow with fresh settings, the output path) from ``sys.argv``."""
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from kvscope.ui.main_window import MainWindow

    out = sys.argv[1] if len(sys.argv) > 1 else default_out
    width, height = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (1280, 720)
    app = QApplication.instance() or QApplication(sys.argv)
    settings = QSettings(str(Path(tempfile.mkdtemp()) / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("app/first_start_done", True)  # no demo banner
    window = MainWindow(settings=settings)
    window.resize(width, height)
    window.show()
    return app, window, out


def run_to_end(window: Any, request: Any) -> None:
    """Start ``request`` in ``window`` and return when the run has finished."""
    from PySide6.QtCore import QEventLoop

    loop = QEventLoop()
    window.run_finished.connect(loop.quit)
    assert window.start_run(request)
    loop.exec()
    window.run_finished.disconnect(loop.quit)


def settle_and_save(app: Any, window: Any, out: str, ms: int = 800) -> None:
    """Let the last redraws land (``ms``), save the window as ``out``, close it."""
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()
    window.grab().save(out)
    window.close()
    app.processEvents()

"""The README's runtimes screenshot: the embedded model run by transformers, then by llama.cpp, in one window.

    Xvfb :94 -screen 0 1280x720x24 & DISPLAY=:94 QT_QPA_PLATFORM=xcb \\
        .venv/bin/python scripts/runtimes_screenshot.py docs/screenshot-runtimes.png [1280 720]

The first run's growing cache stays on the KV plot, dotted ("before: transformers"), under llama.cpp's
prepayment of the whole context and the cells it has filled.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from PySide6.QtCore import QEventLoop, QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from ui.main_window import MainWindow

    out = sys.argv[1] if len(sys.argv) > 1 else "docs/screenshot-runtimes.png"
    width, height = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (1280, 720)
    app = QApplication.instance() or QApplication(sys.argv)
    settings = QSettings(str(Path(tempfile.mkdtemp()) / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("app/first_start_done", True)  # no demo banner
    window = MainWindow(settings=settings)
    window.resize(width, height)
    window.show()

    def run(request) -> None:
        loop = QEventLoop()
        window.run_finished.connect(loop.quit)
        assert window.start_run(request)
        loop.exec()
        window.run_finished.disconnect(loop.quit)

    controls = window.controls
    controls.max_tokens_spin.setValue(1500)
    run(controls.build_request())
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("llamacpp"))
    run(controls.build_request())
    loop = QEventLoop()
    QTimer.singleShot(800, loop.quit)
    loop.exec()
    window.grab().save(out)
    print(f"saved {out}: {window.plots.previous_label}")
    window.close()
    app.processEvents()
    return 0


if __name__ == "__main__":  # the engine process is spawned: this module must not run again in it
    raise SystemExit(main())

"""Make the README's calculator screenshots: Llama-3-8B (fp16, 24 GiB GPU) at 4K, 32K and 128K tokens.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/readme_screenshots.py [out_dir]

The live-run screenshot comes from the app itself:
    python main.py --screenshot docs/screenshot-run.png --tokens 64 --switch 16:attention=gqa:2 ...
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEventLoop, QSettings, QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from kvscope.core.model.sources import load_spec  # noqa: E402
from kvscope.ui.main_window import MainWindow  # noqa: E402


def settle(ms: int = 300) -> None:
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs")
    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(sys.argv)
    ini = Path(tempfile.mkdtemp()) / "settings.ini"
    window = MainWindow(settings=QSettings(str(ini), QSettings.Format.IniFormat))
    window.resize(1600, 1000)
    window.show()
    window.tabs.setCurrentIndex(1)
    calc = window.calculator
    calc.set_spec(load_spec("llama-3-8b"), "llama-3-8b")
    calc.dtype.set_value("float16")
    calc.memory_combo.setCurrentText("24 GiB")
    for tokens, name in ((4096, "4k"), (32768, "32k"), (131072, "128k")):
        calc.set_context(tokens)
        settle()
        path = out / f"calculator-llama-3-8b-{name}.png"
        window.grab().save(str(path))
        print(f"saved {path}: KV {calc.state.kv:,} B, total {calc.state.total:,} B, fits {calc.state.max_fit}")
    window.shutdown() if hasattr(window, "shutdown") else window.close()
    app.processEvents()
    return 0


if __name__ == "__main__":
    sys.exit(main())

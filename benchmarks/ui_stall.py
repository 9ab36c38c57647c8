"""Worst UI-thread stall during a real run (target: never blocked > 50 ms by the model).

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/ui_stall.py [--tokens 200]

A 10 ms precise timer on the GUI thread measures its own lateness while the window runs the
embedded model through the real generation worker with switches every 40 tokens. Reported: the
worst lateness and how many ticks were more than 50 ms late, during the run only (after loading),
with the plots redrawing at their fixed rate, next to the same window idle for the same time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEventLoop, QSettings, QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from core.generate import RunRequest  # noqa: E402
from ui.main_window import MainWindow  # noqa: E402
from ui.stall import StallMeter  # noqa: E402


def wait(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    loop = QEventLoop()
    while time.monotonic() < end:
        if predicate():
            return True
        QTimer.singleShot(20, loop.quit)
        loop.exec()
    return predicate()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="override sys.setswitchinterval (the app's own setting otherwise)")
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    app = QApplication.instance() or QApplication(sys.argv)
    ini = Path(tempfile.mkdtemp()) / "s.ini"
    window = MainWindow(settings=QSettings(str(ini), QSettings.Format.IniFormat))
    window.resize(1600, 1000)
    window.show()
    wait(lambda: window.calculator.warm, 120)
    switches = tuple((t, "attention", m) for t, m in zip(range(40, args.tokens, 40), ["gqa:4", "gqa:2", "mqa", "mha"]))
    finished = {"done": False}
    window.run_finished.connect(lambda: finished.__setitem__("done", True))
    window.start_run(RunRequest(source="embedded", max_new_tokens=args.tokens, switches=switches))
    wait(lambda: window.decode_tokens >= 1, 120)  # loading done: measure generation only
    meter = StallMeter()
    meter.start()
    t0 = time.monotonic()
    wait(lambda: finished["done"], 600)
    run_s = time.monotonic() - t0
    meter.stop()
    idle = StallMeter()
    idle.start()
    wait(lambda: False, min(run_s, 5.0))
    idle.stop()
    print(f"run: {window.decode_tokens} tokens in {run_s:.1f} s; ticks {meter.ticks}; worst stall {meter.worst_ms:.1f} ms; "
          f"ticks > 50 ms late: {meter.late_over_50ms}")
    print(f"idle window: worst stall {idle.worst_ms:.1f} ms over {idle.ticks} ticks")
    print(f"target: worst stall during a run < 50 ms: {'OK' if meter.worst_ms < 50 else 'MISSED'}")
    window.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Worst UI-thread stall during a real run (target: never blocked > 50 ms by the model).

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/ui_stall.py [--tokens 200] [--engine both]

A 10 ms precise timer on the GUI thread measures its own lateness while the window runs the
embedded model with switches every 40 tokens: with the model in the engine process (the default)
and, side by side, on a thread of the window's own process (KVSCOPE_ENGINE=thread). Reported for
each: the worst lateness and how many ticks were more than 50 ms late, during the run only (after
loading), with the plots redrawing at their fixed rate, next to the same window idle afterwards.
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

from kvscope.core.model.request import RunRequest  # noqa: E402
from kvscope.ui.main_window import MainWindow  # noqa: E402
from tests.stall import StallMeter  # noqa: E402


def wait(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    loop = QEventLoop()
    while time.monotonic() < end:
        if predicate():
            return True
        QTimer.singleShot(20, loop.quit)
        loop.exec()
    return predicate()


def measure(app, engine: str, tokens: int) -> dict:
    """One window, one run of ``tokens`` tokens with the model in ``engine`` ('process' or 'thread')."""
    from kvscope.workers.generation import GenerationController

    ini = Path(tempfile.mkdtemp()) / "s.ini"
    controller = GenerationController() if engine == "thread" else None  # None: the window's default
    window = MainWindow(settings=QSettings(str(ini), QSettings.Format.IniFormat), controller=controller)
    window.resize(1600, 1000)
    window.show()
    wait(lambda: window.calculator.warm, 120)
    switches = tuple((t, "attention", m) for t, m in zip(range(40, tokens, 40), ["gqa:4", "gqa:2", "mqa", "mha"]))
    finished = {"done": False}
    window.run_finished.connect(lambda: finished.__setitem__("done", True))
    window.start_run(RunRequest(source="embedded", max_new_tokens=tokens, switches=switches))
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
    result = {"engine": engine, "tokens": window.decode_tokens, "run_s": run_s, "ticks": meter.ticks,
              "worst": meter.worst_ms, "late": meter.late_over_50ms, "idle_worst": idle.worst_ms,
              "idle_ticks": idle.ticks}
    window.close()
    app.processEvents()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--engine", choices=("both", "process", "thread"), default="both",
                    help="where the model runs: the engine process (the default), a thread of the window's "
                         "process, or both, one after the other (default)")
    args = ap.parse_args()
    app = QApplication.instance() or QApplication(sys.argv)
    engines = ("process", "thread") if args.engine == "both" else (args.engine,)
    results = [measure(app, engine, args.tokens) for engine in engines]
    for r in results:
        print(f"engine {r['engine']:7s}: {r['tokens']} tokens in {r['run_s']:.1f} s; worst UI stall {r['worst']:.1f} ms "
              f"over {r['ticks']} ticks, {r['late']} ticks > 50 ms late; idle window after it: worst "
              f"{r['idle_worst']:.1f} ms over {r['idle_ticks']} ticks")
    if len(results) == 2:
        print(f"worst stall, thread / process: {results[1]['worst'] / max(results[0]['worst'], 0.1):.1f}x")
    ok = results[0]["worst"] < 50
    print(f"target: worst stall during a run < 50 ms with the default engine ({results[0]['engine']}): "
          f"{'OK' if ok else 'MISSED'}")
    from kvscope.workers.engine_link import shared_host

    shared_host().shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

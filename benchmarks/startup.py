"""Start-up: seconds from launch to the window shown, to the first plotted token, and to a `calc` answer.

Each figure is measured in fresh processes, side by side in one run, against the same step with torch
and transformers imported first: what the window's process did before it stopped importing the ML
stack (the engine process imports it; the window only draws). Run:

    .venv/bin/python benchmarks/startup.py [--repeats 3]

Offscreen Qt; the embedded model must be built already (any earlier run builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WINDOW = """
import json, os, sys, tempfile, time
if os.environ.get("PRELOAD_ML"):
    import torch, transformers  # noqa: F401 - the old window's process
from PySide6.QtCore import QEventLoop, QSettings, QTimer
from PySide6.QtWidgets import QApplication

def main():
    launched = float(os.environ["LAUNCHED"])
    app = QApplication([])
    from kvscope.ui.main_window import MainWindow
    from kvscope.core.model.request import RunRequest
    window = MainWindow(settings=QSettings(tempfile.mktemp(suffix=".ini"), QSettings.Format.IniFormat))
    window.show()
    app.processEvents()
    shown = time.time() - launched
    loop = QEventLoop()
    window.samples_added.connect(lambda n: loop.quit() if n >= 1 else None)
    QTimer.singleShot(300_000, loop.quit)
    window.start_run(RunRequest(max_new_tokens=8))
    loop.exec()
    window._redraw()
    first = time.time() - launched
    print(json.dumps({"shown": shown, "first_token": first, "torch": "torch" in sys.modules}))
    window.stop_run()
    window.close()

if __name__ == "__main__":
    main()
"""

CALC = """
import json, os, sys, time
if os.environ.get("PRELOAD_ML"):
    import torch, transformers  # noqa: F401 - what calc imported before presets carried their view
from kvscope import main
main.main(["calc", "--model", "llama-3-8b", "--context", "4k,32k,128k"])
print(json.dumps({"answer": time.time() - float(os.environ["LAUNCHED"]), "torch": "torch" in sys.modules}))
"""


def measure(code: str, preload: bool) -> dict:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", LAUNCHED=repr(time.time()))
    if preload:
        env["PRELOAD_ML"] = "1"
    else:
        env.pop("PRELOAD_ML", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name, code, keys in (("window", WINDOW, ("shown", "first_token")), ("calc llama-3-8b", CALC, ("answer",))):
        for preload in (True, False):
            runs = [measure(code, preload) for _ in range(args.repeats)]
            for key in keys:
                values = [r[key] for r in runs]
                rows.append((name, key, preload, statistics.median(values), min(values), max(values),
                             any(r["torch"] for r in runs)))
    print(f"{'what':18} {'to':12} {'process':32} {'median s':>9} {'min':>6} {'max':>6}")
    for name, key, preload, med, lo, hi, torch_loaded in rows:
        how = "torch imported first (before)" if preload else ("now (torch: yes)" if torch_loaded else "now (no torch)")
        print(f"{name:18} {key:12} {how:32} {med:9.2f} {lo:6.2f} {hi:6.2f}")
    by = {(n, k, p): m for n, k, p, m, *_ in rows}
    for name, key in (("window", "shown"), ("window", "first_token"), ("calc llama-3-8b", "answer")):
        print(f"{name} {key}: {by[(name, key, True)] / by[(name, key, False)]:.1f}x sooner")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Start-up: seconds from launch to the window shown, to the first plotted token, and to a `calc` answer.

Each figure is measured in fresh processes, side by side in one run:

* window, before: the window starts the engine process when it is built (after its own imports: PySide6,
  pyqtgraph and the panels), and the engine then imports torch and loads the model on the first run;
* window, now: ``main.start_engine_early`` (what ``python main.py`` does first) spawns the engine process before
  the window's imports, and the engine loads the first run's model while the window builds;
* calc, with torch and transformers imported first (what calc did before presets carried their view) and now.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--load N] [--before TREE]

``--load N`` runs N busy processes (one Python loop each) beside every measurement: a machine that is
compiling, or a second app, as on a speaker's laptop.

Offscreen Qt; the embedded model must be built already (any earlier run builds it). Prints the load averages:
on a shared machine, compare the rows of one run, not runs.
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
from kvscope import main as kvscope_main
from kvscope.core.model.request import RunRequest
early = getattr(kvscope_main, "start_engine_early", None)  # an older tree (--before) has none
if early is not None and not os.environ.get("PRELOAD_ML"):  # 'before': the window starts the engine itself
    early(RunRequest(max_new_tokens=8))
from PySide6.QtCore import QEventLoop, QSettings, QTimer
from PySide6.QtWidgets import QApplication

def main():
    launched = float(os.environ["LAUNCHED"])
    app = QApplication([])
    from kvscope.ui.main_window import MainWindow
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


def measure(code: str, preload: bool, tree: Path = ROOT) -> dict:
    """One fresh process. ``preload``: the 'before' way (the window: engine started by the window, or with
    ``--before`` the other tree's own way; calc: torch imported first)."""
    if tree != ROOT and code is WINDOW:
        preload = False  # another checkout starts its engine as it does
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", LAUNCHED=repr(time.time()))
    # As installed (pip writes the bytecode): compiled modules are read, not the sources compiled at each start.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = str(tree)
    if preload:
        env["PRELOAD_ML"] = "1"
    else:
        env.pop("PRELOAD_ML", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, default=None, metavar="TREE",
                        help="the window 'before' from another checkout of KV Scope, started its own way: a folder whose "
                             "kvscope/ is that checkout (mkdir -p /tmp/b/kvscope && git archive REV | tar -x -C "
                             "/tmp/b/kvscope; --before /tmp/b); default: this tree with the engine started by the window")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="busy processes running beside every measurement (default 0: an idle machine)")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        return _run(args)
    finally:
        for p in busy:
            p.kill()
            p.wait()


def _run(args: argparse.Namespace) -> int:
    before_tree = (args.before or ROOT).resolve()
    rows = []
    for tree in {ROOT, before_tree}:  # untimed: writes the bytecode of each tree's modules, as an install has it
        measure(WINDOW, tree != ROOT, tree)
    if args.before:
        print(f"window before: {before_tree}; now: {ROOT}")
    print("load average %.2f %.2f %.2f; %d cores; %d busy processes beside" % (*os.getloadavg(), os.cpu_count(),
                                                                              args.load))
    for name, code, keys in (("window", WINDOW, ("shown", "first_token")), ("calc llama-3-8b", CALC, ("answer",))):
        runs: dict[bool, list] = {True: [], False: []}
        for _ in range(args.repeats):  # interleaved: a shared machine's load falls on both alike
            for preload in (True, False):
                runs[preload].append(measure(code, preload, before_tree if preload and name == "window" else ROOT))
        for preload in (True, False):
            for key in keys:
                values = [r[key] for r in runs[preload]]
                rows.append((name, key, preload, statistics.median(values), min(values), max(values),
                             any(r["torch"] for r in runs[preload])))
    print(f"{'what':18} {'to':12} {'process':40} {'median s':>9} {'min':>6} {'max':>6}")
    for name, key, preload, med, lo, hi, torch_loaded in rows:
        if name == "window":
            how = ("before" + (" (that tree)" if args.before else ": engine started by the window")) if preload \
                else "now: engine started first"
        else:
            how = "torch imported first (before)" if preload else ("now (torch: yes)" if torch_loaded else "now (no torch)")
        print(f"{name:18} {key:12} {how:40} {med:9.2f} {lo:6.2f} {hi:6.2f}")
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    by = {(n, k, p): m for n, k, p, m, *_ in rows}
    for name, key in (("window", "shown"), ("window", "first_token"), ("calc llama-3-8b", "answer")):
        print(f"{name} {key}: {by[(name, key, True)] / by[(name, key, False)]:.1f}x sooner")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Redraw rate of the live plots with 100,000 points on every curve of every plot, offscreen.

Each frame appends a few new points (so every curve really changes), pushes the buffers to the
curves (``LivePlots.redraw``, what the window's 30 Hz timer calls) and lets Qt process its events,
which paints the three plot views once, as on screen (paint events are counted to prove it).
Prints frames per second; the target is >= 30.

    python benchmarks/plot_fps.py [--points 100000] [--seconds 5] [--size 1600x1000] [--presenter]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000, help="points per curve (default 100000)")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to measure (default 5)")
    parser.add_argument("--size", default="1600x1000", help="widget size WxH (default 1600x1000)")
    parser.add_argument("--presenter", action="store_true", help="presenter look (thick lines, large type)")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))

    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    from kvscope.ui.plots import LivePlots
    from kvscope.ui.theme import theme
    from tests.synthetic import synthetic_samples

    n = args.points
    plots = LivePlots(theme("dark", args.presenter), capacity=n + 10_000)
    plots.resize(width, height)
    plots.show()

    # n points on every curve: a KV ramp with steps, memory series with noise, errors around 0.
    rng = np.random.default_rng(0)
    tok = np.arange(n, dtype=float)
    kv = 8192.0 * (tok % 30_000 + 16)
    plots.tokens.extend_arrays({
        "token": tok, "kv_observed": kv, "kv_predicted": kv,
        "total_observed": 6e6 + kv + rng.normal(0, 2e4, n), "total_predicted": 6e6 + kv,
        "error_total": rng.normal(0, 0.3, n), "error_kv": np.zeros(n),
    })
    t = tok / 200.0
    base = 6e8 + kv
    plots.times.extend_arrays({
        "time": t, "device_total": np.full(n, 141 * 2**30), "device_used": base + 2e8, "process_gpu": base + 1e8,
        "process_rss": base + rng.normal(0, 1e6, n), "reserved": base, "allocated": base - 5e7,
        "kv_share": kv, "weights": np.full(n, 6e6),
    })
    for k in range(0, n, max(n // 20, 1)):  # markers as a scripted demo would leave
        plots.add_samples([s for s in synthetic_samples(1, start_token=k, switches={k: "gqa:2"}) if s.is_event])
    curves = [key for key in plots._curves if len(plots.tokens) and plots._curves[key].buffer is not None]
    plots.redraw()
    app.processEvents()

    from PySide6.QtCore import QEvent, QObject

    class PaintCounter(QObject):
        paints = 0

        def eventFilter(self, obj, event):  # noqa: N802 (Qt API)
            if event.type() == QEvent.Type.Paint:
                PaintCounter.paints += 1
            return False

    counter = PaintCounter()
    for view in (plots.kv_widget, plots.mem_widget, plots.cmp_widget):
        view.viewport().installEventFilter(counter)
    frames = 0
    next_token = n
    worst = 0.0
    frame_s: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t0 = time.perf_counter()
        batch = synthetic_samples(5, start_token=next_token, gpu=True)
        next_token += 5
        plots.add_samples(batch)
        plots.redraw(settle=True)  # every view, every frame: stricter than the window's paced 30 Hz frames
        app.processEvents()  # Qt paints what changed, as it would on screen (once: no forced repaint)
        frame_s.append(time.perf_counter() - t0)
        worst = max(worst, frame_s[-1])
        frames += 1
    elapsed = time.perf_counter() - start
    fps = frames / elapsed
    visible = sum(1 for key in curves if plots.curve_visible(key))
    print(f"{fps:.1f} fps  ({frames} frames in {elapsed:.1f} s; {visible} curves x {len(plots.tokens):,} points, "
          f"{len(plots.markers)} markers, {PaintCounter.paints / max(frames, 1):.1f} view paints per frame, {width}x{height}{', presenter' if args.presenter else ''}; "
          f"median frame {np.median(frame_s) * 1000:.1f} ms, slowest {worst * 1000:.0f} ms)")
    return 0 if fps >= 30 else 1


if __name__ == "__main__":
    raise SystemExit(main())

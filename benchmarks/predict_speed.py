"""Time of one prediction (target < 1 ms): predict() for every preset, median of many calls.

    .venv/bin/python benchmarks/predict_speed.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvscope.core.model.settings import RunSettings  # noqa: E402
from kvscope.core.model.sources import load_spec  # noqa: E402
from kvscope.core.model.spec import preset_names  # noqa: E402
from kvscope.core.prediction.predict import predict  # noqa: E402


def main() -> None:
    settings = RunSettings()
    print(f"{'preset':<16} {'median us':>10} {'p99 us':>10}")
    worst = 0.0
    for name in preset_names():
        spec = load_spec(name)  # spec derivation (and its meta-device parameter count) is not timed
        predict(spec, settings, 32768)
        times = []
        for _ in range(2000):
            t = time.perf_counter()
            predict(spec, settings, 32768)
            times.append((time.perf_counter() - t) * 1e6)
        times.sort()
        med, p99 = statistics.median(times), times[int(len(times) * 0.99)]
        worst = max(worst, med)
        print(f"{name:<16} {med:>10.1f} {p99:>10.1f}")
    print(f"worst median {worst:.1f} us = {worst / 1000:.3f} ms per prediction (target < 1 ms): "
          f"{'OK' if worst < 1000 else 'SLOW'}")


if __name__ == "__main__":
    main()

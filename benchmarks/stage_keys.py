"""Keys on stage (issue 25, items 1-3 and 7): in the real window (the engine in its own process, as the app
runs), how long each key takes to show its switch, and the longest gap between two tokens during a
30-key mash.

* per key (1-5, F, C): from the key press to the badges / combos showing the engine's answer (the
  switch applied, or refused and put back), and the longest gap between two tokens meanwhile (a re-run,
  MLA's or leaving a window's, is prepared off the token path: the run goes on until it applies);
* a seeded 30-key mash of those keys: the longest gap between two arriving tokens until every answer
  is in, and how many answers (switch events) the engine gave per axis (presses coalesce: at most the
  one under way plus the last press per axis).

* ``--steady N`` first: N tokens with no key pressed, their longest gap, tokens/s, and the profiled decode steps
  (the CPU measures a step's allocator peak under the profiler now and then: kvscope.core.runtimes.transformers.peak_cadence)
  with the gap each stood in;
* ``--runtime llama.cpp --model x.gguf``: the same keys on a GGUF in llama.cpp (its switches reload into a second
  context while the first keeps generating);
* ``--model DIR`` a real pretrained folder instead of the embedded model (tests/real_models.smollm2_folder() is
  SmolLM2-135M), ``--lead N`` tokens before the first key (a cache that is large enough to matter), ``--cycle-cache``
  C pressed until every cache has run once, each answer its own row.

    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/stage_keys.py      # or on an X display
    QT_QPA_PLATFORM=offscreen .venv/bin/python benchmarks/stage_keys.py --model ~/.cache/kvscope-tests/smollm2-... \
        --steady 400 --lead 1000 --cycle-cache
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ["1", "2", "3", "4", "5", "F", "C"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="the run's model: embedded, or a pretrained folder")
    parser.add_argument("--runtime", default="transformers",
                        help="the runtime that runs it (a name in kvscope.core.runtimes' registry: llama.cpp for a GGUF)")
    parser.add_argument("--steady", type=int, default=0, help="first, this many tokens with no key pressed")
    parser.add_argument("--lead", type=int, default=40, help="tokens before the first key")
    parser.add_argument("--cycle-cache", action="store_true", help="press C until every cache has run once")
    parser.add_argument("--no-mash", action="store_true", help="leave out the 30-key mash")
    args = parser.parse_args()
    from PySide6.QtCore import QEventLoop, QSettings, Qt, QTimer
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    from kvscope.core.model.request import RunRequest
    from kvscope.ui.main_window import MainWindow

    settings = QSettings(tempfile.mktemp(suffix=".ini"), QSettings.Format.IniFormat)
    settings.setValue("app/first_start_done", True)
    window = MainWindow(settings=settings)
    window.resize(1280, 720)
    window.show()

    def wait_until(test, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 20)
            if test():
                return True
        return False

    arrivals: list[float] = []
    answers: list = []
    profiled: list[int] = []  # indices in arrivals of the decode steps measured under the profiler
    window.sample_observers.append(lambda s: arrivals.append(time.monotonic()) if s.phase == "decode" else None)
    window.sample_observers.append(lambda s: profiled.append(len(arrivals) - 1)
                                   if s.phase == "decode" and s.peak_bytes_observed is not None else None)
    window.sample_observers.append(lambda s: answers.append((time.monotonic(), s)) if s.is_event and s.switch_key else None)
    window.start_run(RunRequest(source=args.model, runtime=args.runtime, max_new_tokens=100_000))
    if not wait_until(lambda: window.decode_tokens >= 8, 600):
        print("the run did not start")
        return 1
    steady: dict = {}
    if args.steady:
        first, started = len(arrivals), time.monotonic()
        wait_until(lambda: len(arrivals) >= first + args.steady, 3600)
        times = arrivals[first - 1:first + args.steady]
        gaps = [b - a for a, b in zip(times, times[1:])]
        mine = [i - first for i in profiled if first <= i < first + args.steady]
        steady = {"tokens": len(gaps), "tokens_per_s": round(len(gaps) / (times[-1] - times[0]), 2),
                  "longest_gap_s": round(max(gaps), 3), "profiled_steps": len(mine),
                  "profiled_gaps_s": [round(gaps[i], 3) for i in mine if 0 <= i < len(gaps)]}
        print(f"steady {steady['tokens']} tokens: {steady['tokens_per_s']} tok/s, longest gap {steady['longest_gap_s']} s;"
              f" {len(mine)} profiled steps, their gaps {steady['profiled_gaps_s']}", flush=True)
    wait_until(lambda: window.decode_tokens >= args.lead, 3600)
    qt_key = {k: getattr(Qt.Key, f"Key_{k}") for k in KEYS}
    latencies: dict[str, float | None] = {}
    key_gaps: dict[str, float | None] = {}
    presses = list(KEYS)
    if args.cycle_cache:
        presses += ["C"] * 10  # to every cache and back (a press that offers nothing ends it)
    rows: list[tuple[str, float | None]] = []
    for n, k in enumerate(presses):
        before = len(answers)
        first = len(arrivals)
        pressed = time.monotonic()
        QTest.keyClick(window, qt_key[k])
        if window.session.switches_pending == 0:  # nothing sent (no change, or nothing offered here)
            latencies.setdefault(k, None)
            if n >= len(KEYS):  # C offers nothing more: the cycle is done
                break
            continue
        wait_until(lambda: window.session.switches_pending == 0, 600)
        if window.state != "running":
            print(f"key {k}: the run ended ({window.session.last_error or 'no error'}) after "
                  f"{window.decode_tokens:,} tokens", flush=True)
            return 1
        shown = answers[before][0] if len(answers) > before else time.monotonic()
        latencies[k] = shown - pressed
        wait_until(lambda: False, 0.5)
        # The run between the press and the answer: the longest gap between two tokens (a re-run prepared off
        # the token path leaves the tokens coming; one made between two tokens was one gap of its length).
        times = [pressed] + [t for t in arrivals[first:] if t <= shown + 0.5]
        key_gaps[k] = max((b - a for a, b in zip(times, times[1:])), default=None)
        what = answers[before][1].switch_after if len(answers) > before else "?"
        rows.append((f"{k}:{what}", None if key_gaps[k] is None else round(key_gaps[k], 3)))
        gap = f"{key_gaps[k]:.2f} s" if key_gaps[k] is not None else "n/a"
        print(f"key {k}: {latencies[k]:.2f} s to {answers[before][1].event if len(answers) > before else '?'} "
              f"(longest token gap meanwhile {gap}, {len(times) - 1} tokens): "
              f"{answers[before][1].text[:90] if len(answers) > before else ''}", flush=True)
    if args.no_mash:
        print(json.dumps({"model": args.model, "runtime": args.runtime, "steady": steady, "key_rows": rows}))
        window.stop_run()
        wait_until(lambda: window.state == "idle", 30)
        window.shutdown()
        QTimer.singleShot(0, app.quit)
        return 0
    rng = random.Random(25)
    start = len(answers)
    first_token = len(arrivals)
    mash_start = time.monotonic()
    for _ in range(30):
        QTest.keyClick(window, qt_key[rng.choice(KEYS)])
        app.processEvents()
    wait_until(lambda: window.session.switches_pending == 0, 600)
    mash_end = time.monotonic()
    wait_until(lambda: False, 1.0)
    times = [t for t in arrivals[max(first_token - 1, 0):] if t <= mash_end + 1.0]
    gaps = [b - a for a, b in zip(times, times[1:])] or [mash_end - mash_start]
    per_axis: dict[str, int] = {}
    for _, s in answers[start:]:
        per_axis[s.switch_key] = per_axis.get(s.switch_key, 0) + 1
    print(f"30-key mash: answers per axis {per_axis}; all answered after {mash_end - mash_start:.2f} s; "
          f"{len(times)} tokens meanwhile; longest gap between two tokens {max(gaps):.2f} s")
    print(json.dumps({"model": args.model, "runtime": args.runtime, "steady": steady, "key_rows": rows, "latency_s": latencies,
                      "key_longest_gap_s": key_gaps, "mash_longest_gap_s": max(gaps), "mash_answers": per_axis}))
    window.stop_run()
    wait_until(lambda: window.state == "idle", 30)
    window.shutdown()
    QTimer.singleShot(0, app.quit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

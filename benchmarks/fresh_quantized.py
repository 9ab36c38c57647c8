"""The first quantized cache on a fresh install (issue 25, item 1): how long the run goes without a token.

optimum-quanto builds its C++ extension the first time a cache quantizes (into its package's folder).
This points that build at an empty temporary folder, as on a machine where it never ran, starts a real
run of the embedded model (kvscope.core.live.engine_process.RunDriver, as the engine process drives it), asks for
``quantized:4`` at token 5 and reports: the longest gap between two tokens, how long the preparation
took, how many tokens were generated meanwhile, and the token the switch applied at.

    python benchmarks/fresh_quantized.py            # prints one line per figure; exit 1 if a gap > 2 s
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GAP_LIMIT_S = 2.0


def main() -> int:
    from optimum.quanto.library.extensions import get_extension

    from kvscope.core.live.engine_process import RunDriver
    from kvscope.core.model.request import RunRequest

    build = tempfile.mkdtemp(prefix="kvscope-quanto-build-")
    get_extension("quanto_cpp").build_directory = build  # nothing built there: the first use compiles
    messages: list[tuple[float, str, object]] = []
    lock = threading.Lock()

    def send(kind, payload):
        with lock:
            messages.append((time.monotonic(), kind, payload))

    def samples():
        with lock:
            return [(t, s) for t, kind, batch in messages if kind == "samples" for s in batch]

    driver = RunDriver(RunRequest(source="embedded", device="cpu", max_new_tokens=100_000), send)
    runner = threading.Thread(target=driver.run, name="kvscope-generation", daemon=True)
    runner.start()
    while len([s for _, s in samples() if s.phase == "decode"]) < 5:
        time.sleep(0.05)
    pressed = time.monotonic()
    driver.command("switch", "cache", "quantized:4")
    while not any(s.event in ("switch", "refused") for _, s in samples()):
        time.sleep(0.1)
    applied = time.monotonic()
    time.sleep(1.0)
    driver.stop()
    runner.join(60)
    answer = next(s for _, s in samples() if s.event in ("switch", "refused"))
    times = [t for t, s in samples() if s.phase == "decode" and t >= pressed - 1.0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = len([t for t in times if pressed <= t <= applied])
    print(f"quanto build folder: {build} ({len(list(Path(build).iterdir()))} files after)")
    print(f"switch: {answer.event} ({answer.text[:100]})")
    print(f"key to switch applied: {applied - pressed:.1f} s; tokens generated meanwhile: {during}")
    print(f"longest gap between two tokens: {max(gaps):.2f} s (limit {GAP_LIMIT_S} s)")
    return 0 if answer.event == "switch" and max(gaps) <= GAP_LIMIT_S else 1


if __name__ == "__main__":
    raise SystemExit(main())

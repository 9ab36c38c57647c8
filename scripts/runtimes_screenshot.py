"""The README's runtimes screenshot: the embedded model run by transformers, then by llama.cpp, in one window.

    Xvfb :94 -screen 0 1280x720x24 & DISPLAY=:94 QT_QPA_PLATFORM=xcb \\
        .venv/bin/python scripts/runtimes_screenshot.py docs/screenshot-runtimes.png [1280 720]

The first run's growing cache stays on the KV plot, dotted ("before: transformers"), under llama.cpp's
prepayment of the whole context and the cells it has filled.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from window_script import fresh_window, run_to_end, settle_and_save  # noqa: E402


def main() -> int:
    app, window, out = fresh_window("docs/screenshot-runtimes.png")

    run = functools.partial(run_to_end, window)

    controls = window.controls
    controls.max_tokens_spin.setValue(1500)
    run(controls.build_request())
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("llamacpp"))
    run(controls.build_request())
    settle_and_save(app, window, out)
    print(f"saved {out}: {window.plots.previous_label}")
    return 0


if __name__ == "__main__":  # the engine process is spawned: this module must not run again in it
    raise SystemExit(main())

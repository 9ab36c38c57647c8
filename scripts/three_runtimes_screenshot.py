"""The README's three-runtimes screenshot: the embedded model run by transformers, then MLX, then llama.cpp, in one
window, each curve labelled by its runtime.

    Xvfb :95 -screen 0 1280x720x24 & DISPLAY=:95 QT_QPA_PLATFORM=xcb \\
        .venv/bin/python scripts/three_runtimes_screenshot.py docs/screenshot-three-runtimes.png [1280 720]

On the KV plot: transformers' cache grows with every token (dash-dotted, "before: transformers"), MLX's KVCache
in 256-token steps (dotted, "before: mlx kv"), and llama.cpp reserves the whole context at load (the filled
curve), the cells it has filled drawn over it: context length is a prepayment, paid per token, per step or all
at once.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from window_script import fresh_window, run_to_end, settle_and_save  # noqa: E402

TOKENS = 1100  # past four MLX steps (256, 512, 768, 1024)
LLAMACPP_CONTEXT = 2048  # the prepayment, twice the tokens generated


def main() -> int:
    app, window, out = fresh_window("docs/screenshot-three-runtimes.png")

    run = functools.partial(run_to_end, window)

    controls = window.controls
    controls.max_tokens_spin.setValue(TOKENS)
    run(controls.build_request())  # transformers
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("mlx"))
    run(controls.build_request())  # MLX
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("llamacpp"))
    controls.max_context_spin.setValue(LLAMACPP_CONTEXT)
    run(controls.build_request())  # llama.cpp
    settle_and_save(app, window, out)
    print(f"saved {out}: {window.plots.previous_labels} under llama.cpp")
    return 0


if __name__ == "__main__":  # the engine process is spawned: this module must not run again in it
    raise SystemExit(main())

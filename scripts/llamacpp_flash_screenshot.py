"""The README's flash-attention screenshot: the embedded GGUF in llama.cpp at -c 4096, -fa off, switched to -fa on
mid-run (``attn-impl=fa-on``: the context reloaded, the tokens re-run), in one window.

    Xvfb :96 -screen 0 1280x720x24 & DISPLAY=:96 QT_QPA_PLATFORM=xcb \\
        .venv/bin/python scripts/llamacpp_flash_screenshot.py docs/screenshot-llamacpp-flash.png [1280 720]

The picture is the window at the end of the run (flash attention on) with, on its right, the "Where the memory
went" panel as it was before the switch (flash attention off), grabbed from the same window during the run: the
"activations" row is llama.cpp's compute buffer, measured (its own memory breakdown), and it is what moves.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from window_script import fresh_window  # noqa: E402

TOKENS = 1200
SWITCH_AT = 600  # the token at which -fa goes from off to on
CONTEXT = 4096


def main() -> int:
    from PySide6.QtCore import QEventLoop, QPoint, Qt, QTimer
    from PySide6.QtGui import QColor, QFont, QPainter, QPixmap

    app, window, out = fresh_window("docs/screenshot-llamacpp-flash.png")

    controls = window.controls
    controls.max_tokens_spin.setValue(TOKENS)
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("llamacpp"))
    controls.max_context_spin.setValue(CONTEXT)
    request = controls.build_request()
    request = request.with_options("llama.cpp", dataclasses.replace(request.options_for("llama.cpp"), flash_attn="off"))
    request = dataclasses.replace(request, switches=((SWITCH_AT, "attn-impl", "fa-on"),))

    before: dict[str, object] = {}

    def watch() -> None:
        """Grab the panel once the run is well into its -fa off half (the slow timer's refresh, forced)."""
        s = window.session.last_sample
        if "panel" in before or s is None or s.runtime != request.runtime:
            return
        if s.attn_impl == "fa-off" and s.phase == "decode" and s.token >= SWITCH_AT // 2:
            window.refresh_stats()
            app.processEvents()
            before["panel"] = window.breakdown_view.grab()
            before["sample"] = s

    timer = QTimer()
    timer.timeout.connect(watch)
    timer.start(20)
    loop = QEventLoop()
    window.run_finished.connect(loop.quit)
    assert window.start_run(request)
    loop.exec()
    timer.stop()
    loop = QEventLoop()
    QTimer.singleShot(1500, loop.quit)  # the slow timer shows the last sample
    loop.exec()
    after = window.session.last_sample
    if "panel" not in before:
        raise SystemExit("the run passed its -fa off half before the panel could be grabbed: raise TOKENS")
    shot = window.grab()
    panel: QPixmap = before["panel"]  # type: ignore[assignment]
    s0 = before["sample"]
    column, margin, caption = 330, 12, 64
    panel = panel.scaledToWidth(column - 2 * margin, Qt.TransformationMode.SmoothTransformation)
    canvas = QPixmap(shot.width() + column, max(shot.height(), panel.height() + 2 * caption + 3 * margin))
    canvas.fill(QColor("#15181d"))
    p = QPainter(canvas)
    p.drawPixmap(0, 0, shot)
    x, w = shot.width() + margin, column - 2 * margin
    p.setPen(QColor("#e6e6e6"))
    font = QFont()
    font.setPointSize(10)
    p.setFont(font)
    flags = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignBottom | Qt.TextFlag.TextWordWrap
    p.drawText(x, margin, w, caption, flags,
               f"Before the switch, token {s0.token}, -fa off: llama.cpp's compute buffer "  # type: ignore[attr-defined]
               f"{s0.activations_observed:,} B (predicted {s0.activations_predicted:,} B)")  # type: ignore[attr-defined]
    p.drawPixmap(QPoint(x, margin + caption + 4), panel)
    y = margin + caption + 4 + panel.height() + margin
    p.drawText(x, y, w, caption, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop | Qt.TextFlag.TextWordWrap,
               f"After (the window's panel), token {after.token}, -fa on: {after.activations_observed:,} B "
               f"(predicted {after.activations_predicted:,} B)")
    p.end()
    canvas.save(out)
    print(f"saved {out}: compute buffer {s0.activations_observed:,} B at token {s0.token} (-fa off) -> "  # type: ignore[attr-defined]
          f"{after.activations_observed:,} B at token {after.token} ({after.attn_impl}); predicted "
          f"{s0.activations_predicted:,} -> {after.activations_predicted:,} B")  # type: ignore[attr-defined]
    window.close()
    app.processEvents()
    return 0


if __name__ == "__main__":  # the engine process is spawned: this module must not run again in it
    raise SystemExit(main())

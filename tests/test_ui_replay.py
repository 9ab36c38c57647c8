"""Recordings in the window: the demo replays through the same plots, run_replay's screenshot and
its errors, exports (PNG/SVG per plot, the summary image, CSV from the File menu), first start."""

from __future__ import annotations

import csv
import json

import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import QFileDialog

from kvscope.core.records.recording import RecordingReader
from kvscope.ui.app import run_replay
from kvscope.ui.file_actions import demo_recording_path
from kvscope.ui.main_window import MainWindow
from kvscope.ui.screenshot import image_stats

DEMO = demo_recording_path()


def _demo_counts():
    with RecordingReader(DEMO) as reader:
        samples = list(reader)
    return samples


@pytest.fixture
def replayed(qtbot, window):
    with qtbot.waitSignal(window.run_finished, timeout=120_000):
        assert window.open_recording(str(DEMO), speed=50.0)
    window._redraw()
    return window


def test_demo_replays_through_the_window_with_every_switch_marked(replayed):
    w = replayed
    samples = _demo_counts()
    switches = [s for s in samples if s.event == "switch"]
    decode = [s for s in samples if s.phase == "decode"]
    prefill = [s for s in samples if s.phase == "prefill"]
    assert len(switches) == 6 and w.last_error == ""
    assert [m.kind for m in w.plots.markers] == ["switch"] * 6
    assert [m.token for m in w.plots.markers] == [s.token for s in switches]
    # One KV point per token sample in the file: every decode sample, plus the prefill's.
    x, y = w.plots.curve_data("kv_observed")
    assert len(x) == len(decode) + len(prefill)
    assert list(y[-len(decode):]) == [s.kv_bytes_reserved for s in decode]
    assert w.decode_tokens == len(decode)
    kinds = w.events_table.kinds()
    assert kinds.count("switch") == 6 and "prefill" in kinds and "load" in kinds
    assert w.badges["model"].text().endswith("replay")
    assert w.badges["cache"].text() == switches[-1].cache
    assert "gqa:2" in w.text_view.toPlainText()  # the switch markers in the streamed text
    assert w.state == "idle" and w.mode == "replay"
    assert len(w.plots.readings) == 0  # a replay shows what was recorded, not this machine's memory
    # "KV at max context" is about the recorded run (max context 1,024), not the model's 4,096.
    w.refresh_stats()
    assert w.info.max_context == 1024
    assert w.stats_panel.stats.max_context == 1024
    assert w.stats_panel.tiles["kv_at_max"].note.text() == "predicted, 1K tokens"


def test_export_plots_png_svg_and_summary_write_real_files(replayed, tmp_path):
    w = replayed
    pngs = w.export_plots(str(tmp_path / "talk.png"), fmt="png")
    assert [p.name for p in pngs] == ["talk-kv.png", "talk-memory.png", "talk-compare.png"]
    for path in pngs:
        width, height, spread = image_stats(path)
        assert width >= 400 and height > 100 and spread > 5
    svgs = w.export_plots(str(tmp_path / "talk"), fmt="svg")
    assert [p.name for p in svgs] == ["talk-kv.svg", "talk-memory.svg", "talk-compare.svg"]
    for path in svgs:
        text = path.read_text(encoding="utf-8")
        assert "<svg" in text and "</svg>" in text and len(text) > 2000
    summary = w.export_summary(str(tmp_path / "summary.png"))
    width, height, spread = image_stats(summary)
    assert (width, height) == (1920, 1080) and spread > 10


def test_csv_export_from_the_file_menu(replayed, tmp_path, monkeypatch):
    target = tmp_path / "demo.csv"
    # Only the file dialog is answered for the test; the action, the export and the file are real.
    monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(lambda *a, **k: (str(target), "")))
    replayed.export_csv_action.trigger()
    with open(target, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(_demo_counts())
    assert sum(1 for r in rows if r["event"] == "switch") == 6


def test_run_replay_screenshot_writes_a_png(qtbot, tmp_path, capsys):
    out = tmp_path / "replay.png"
    assert run_replay(str(DEMO), speed=50.0, screenshot=str(out)) == 0
    width, height, spread = image_stats(out)
    assert (width, height) == (1600, 1000) and spread > 10
    assert "112 tokens, 6 switches" in capsys.readouterr().out


def test_run_replay_on_garbage_is_one_line_and_non_zero(qtbot, tmp_path, capsys):
    bad = tmp_path / "garbage.jsonl"
    bad.write_bytes(b"\x00\x01 this is not a recording\n{]")
    assert run_replay(str(bad), screenshot=str(tmp_path / "x.png")) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvscope: ") and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()
    missing = tmp_path / "nope.jsonl"
    assert run_replay(str(missing)) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvscope: ") and "\n" not in err


def test_run_replay_on_a_truncated_recording_plays_it_and_says_so(qtbot, tmp_path, capsys):
    lines = DEMO.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:40]) + lines[40][: len(lines[40]) // 2])  # killed mid-write
    out = tmp_path / "cut.png"
    assert run_replay(str(cut), speed=50.0, screenshot=str(out)) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("kvscope: ") and "\n" not in err and "cut off" in err
    assert out.exists()  # what was recorded is still shown


def test_first_start_offers_the_demo_without_blocking(qtbot, tmp_path):
    fresh = QSettings(str(tmp_path / "fresh.ini"), QSettings.Format.IniFormat)
    w = MainWindow(settings=fresh)
    qtbot.addWidget(w)
    w.show()
    assert w.demo_banner.isVisible() and not w.isModal()
    assert fresh.value("app/first_start_done", False, type=bool)
    qtbot.mouseClick(w.demo_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: w.decode_tokens >= 1, timeout=120_000)  # the demo plays at its recorded pace
    assert w.mode == "replay" and not w.demo_banner.isVisible()
    with qtbot.waitSignal(w.run_finished, timeout=10_000):
        w.stop_run()
    assert w.state == "idle" and not w.replay.is_running()
    w.shutdown()
    again = MainWindow(settings=fresh)
    qtbot.addWidget(again)
    again.show()
    assert not again.demo_banner.isVisible()
    again.shutdown()


def test_demo_recording_header_is_readable():
    header = json.loads(DEMO.read_text(encoding="utf-8").splitlines()[0])
    assert header["format"] == "kvscope-recording"


def _observed_pixels(png) -> int:
    """Pixels of the observed-KV colour (dark theme) in a screenshot."""
    import numpy as np
    from PySide6.QtGui import QImage

    image = QImage(str(png)).convertToFormat(QImage.Format.Format_RGB32)
    pixels = np.frombuffer(image.constBits(), dtype=np.uint8).reshape(image.height(), image.bytesPerLine() // 4, 4)
    blue, green, red = (pixels[..., i].astype(int) for i in range(3))
    return int(((abs(red - 0x56) < 24) & (abs(green - 0xB4) < 24) & (abs(blue - 0xE9) < 24)).sum())


def test_size_and_scale_make_a_projector_screenshot_with_lines_in_logical_pixels(tmp_path):
    """Issue 12, item 4: `--size WxH --scale F` renders a scaled display, and curves are as thick in
    logical pixels as on a plain one (they were 1-device-pixel hairlines at 200%: the observed line
    then covered twice, not four times, the pixels of the 100% picture)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    counts = {}
    for scale in (1, 2):
        png = tmp_path / f"x{scale}.png"
        out = subprocess.run([sys.executable, "main.py", "replay", str(demo_recording_path()), "--speed", "50",
                              "--screenshot", str(png), "--size", "1280x720", "--scale", str(scale)],
                             cwd=root, env=dict(os.environ, QT_QPA_PLATFORM="offscreen"), capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        width, height, _ = image_stats(png)
        assert (width, height) == (1280 * scale, 720 * scale)
        counts[scale] = _observed_pixels(png)
    assert counts[1] > 500 and 3.2 < counts[2] / counts[1] < 4.8, counts
    bad = subprocess.run([sys.executable, "main.py", "replay", str(demo_recording_path()), "--screenshot",
                          str(tmp_path / "bad.png"), "--size", "1280by720"], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, QT_QPA_PLATFORM="offscreen"), timeout=60)
    assert bad.returncode == 2 and "write WxH" in bad.stderr

"""The dependency direction: core never imports Qt; ui never imports torch/transformers; and the
window's process (the window, a replay, calc of a preset) never loads torch or transformers at all."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(folder: str) -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((str(path.relative_to(ROOT)), node.module.split(".")[0]))
    return found


def test_core_has_no_qt():
    bad = {(f, m) for f, m in _imports("core") if m in {"PySide6", "pyqtgraph", "shiboken6", "ui", "workers"}}
    assert not bad, f"core must stay Qt-free: {sorted(bad)}"


def test_ui_has_no_torch():
    bad = {(f, m) for f, m in _imports("ui") if m in {"torch", "transformers", "optimum", "hqq"}}
    assert not bad, f"ui must not touch tensors: {sorted(bad)}"


def test_import_linter_contracts_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a dev dependency (make setup installs it)"
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def _run_python(code: str, tmp_path: Path, timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter (offscreen Qt, a private cache folder); it prints one JSON line last."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVSCOPE_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_window_process_loads_no_torch(tmp_path):
    """The window opens, its engine process starts and reports ready and its device, and a replay plays
    to the end: this process never imported torch or transformers (the engine process did)."""
    found = _run_python(f"""
        import json, sys
        from PySide6.QtCore import QEventLoop, QSettings, QTimer
        from PySide6.QtWidgets import QApplication

        def main():
            app = QApplication([])
            from kvscope.ui.main_window import MainWindow
            window = MainWindow(settings=QSettings({str(tmp_path / 'w.ini')!r}, QSettings.Format.IniFormat))
            window.show()
            loop = QEventLoop()
            window.controller.host.message.connect(lambda kind, *_: loop.quit() if kind == "device" else None)
            QTimer.singleShot(180_000, loop.quit)
            loop.exec()
            device = window.run.engine_device
            window.open_recording("assets/demo/demo.jsonl", speed=50.0)
            window.run_finished.connect(loop.quit)
            loop.exec()
            print(json.dumps({{"device": device, "tokens": window.decode_tokens, "engine_pid": window.controller.host.pid,
                              "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}}))
            window.close()

        if __name__ == "__main__":
            main()
    """, tmp_path)
    assert found["device"] == "cpu" and found["engine_pid"]  # the engine process answered, with torch
    assert found["tokens"] > 100  # the demo replay played to its end
    assert not found["torch"] and not found["transformers"], found


def test_replay_starts_no_engine_and_calc_of_a_preset_loads_no_torch(tmp_path):
    """``replay --screenshot`` spawns no engine process; ``calc`` of a preset reads the view the preset
    carries; a config calc has seen once is answered from the memo without torch the next time."""
    config = tmp_path / "m" / "config.json"
    config.parent.mkdir()
    preset = json.loads((ROOT / "assets" / "presets" / "mistral-7b.json").read_text())
    config.write_text(json.dumps({k: v for k, v in preset.items() if k != "_kvscope"} | {"num_hidden_layers": 5}))
    code = """
        import json, multiprocessing, sys
        from kvscope import main

        def main_():
            rc = main.main({args!r})
            print(json.dumps({{"rc": rc, "children": len(multiprocessing.active_children()),
                              "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}}))

        if __name__ == "__main__":
            main_()
    """
    shot = tmp_path / "replay.png"
    replay = _run_python(code.format(args=["replay", "assets/demo/demo.jsonl", "--speed", "50",
                                           "--screenshot", str(shot)]), tmp_path)
    assert replay == {"rc": 0, "children": 0, "torch": False, "transformers": False} and shot.stat().st_size > 10_000
    calc = _run_python(code.format(args=["calc", "--model", "llama-3-8b", "--context", "32k"]), tmp_path)
    assert calc == {"rc": 0, "children": 0, "torch": False, "transformers": False}
    first = _run_python(code.format(args=["calc", "--model", str(config), "--context", "4k"]), tmp_path)
    assert first["rc"] == 0 and first["transformers"]  # seen for the first time: transformers tells
    again = _run_python(code.format(args=["calc", "--model", str(config), "--context", "4k"]), tmp_path)
    assert again == {"rc": 0, "children": 0, "torch": False, "transformers": False}

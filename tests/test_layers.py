"""The dependency direction: core never imports Qt; ui never imports torch/transformers."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
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

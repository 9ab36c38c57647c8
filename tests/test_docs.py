"""The map names every module: a module added without a line in docs/map.md fails here."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_map_names_every_module():
    listed = subprocess.run(["git", "ls-files", "core", "ui", "workers"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    modules = {f for f in listed if f.endswith(".py") and (not f.endswith("__init__.py") or f.count("/") > 1)}
    modules |= set(str(p.relative_to(ROOT)) for d in ("core", "ui", "workers") for p in (ROOT / d).rglob("*.py")
                   if p.name != "__init__.py" and "__pycache__" not in p.parts)
    text = (ROOT / "docs" / "map.md").read_text(encoding="utf-8")
    missing = sorted(m for m in modules if f"`{m}`" not in text)
    assert not missing, f"docs/map.md does not name: {', '.join(missing)}"

"""The project's modules import each other in one direction (scripts/import_cycles.py): no cycle, function-level
imports included; and the one import from a room of core to a higher floor is the known one, deferred to keep torch
out of a process that does not need it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle():
    limit = sys.getrecursionlimit()
    assert _tool().cycles() == []
    assert sys.getrecursionlimit() == limit  # the walk leaves the process as it found it


def test_the_cycle_finder_sees_a_cycle(tmp_path):
    """The check could fail: two modules that import each other inside functions are a cycle."""
    for top in ("core", "ui", "workers"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "main.py").write_text("")
    (tmp_path / "core" / "a.py").write_text("def f():\n    from kvscope.core import b\n")
    (tmp_path / "core" / "b.py").write_text("import kvscope.core.a\n")
    assert _tool().cycles(tmp_path) == [["core.a", "core.b"]]


def test_imports_up_a_floor_are_the_known_ones():
    targets = {line.split(" -> ")[1] for line in _tool().up_a_floor()}
    # None: cache objects (the sink and h2o layers are torch modules) are built in core/runtimes/transformers/caches.py
    assert targets == set(), targets

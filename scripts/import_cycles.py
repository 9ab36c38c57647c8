#!/usr/bin/env python3
"""Import cycles among KV Scope's own modules, function-level imports included, and imports that go up a floor
of core's rooms (docs/map.md, "core's rooms").

    python3 scripts/import_cycles.py        # from the repository root; exit 1 on a cycle

A cycle closed by an import inside a function still ties the modules together: Python only hides it. Imports are
read by name (``kvscope.core...``), modules by file (``core/...``), so no module is imported to check them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: core's rooms, lowest floor first: a room imports only from its own floor or below.
FLOORS = {"base": 0, "model": 1, "prediction": 2, "records": 3, "runtimes": 4, "live": 5}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    files = [p for top in ("core", "ui", "workers") for p in sorted((root / top).rglob("*.py"))] + [root / "main.py"]
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def imports_of(path: Path, module: str, mods: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, deferred) for each import of a project module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    deferred_lines = {n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    # `if TYPE_CHECKING:` imports are read by type checkers only: no import at run time, no cycle.
    typing_only = {n.lineno for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(block) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            name = name.removeprefix("kvscope.")
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module and (name, node.lineno, node.lineno in deferred_lines) not in out:
                out.append((name, node.lineno, node.lineno in deferred_lines))
    return out


def cycles(root: Path = ROOT) -> list[list[str]]:
    mods = module_files(root)
    edges = {m: {n for n, _, _ in imports_of(p, m, mods)} for m, p in mods.items()}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    # Tarjan's walk recurses once per module on a chain; the limit is put back after, since the process (pytest)
    # goes on (json.loads and others read a raised limit as room to recurse).
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for m in sorted(mods):
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return found


def up_a_floor(root: Path = ROOT) -> list[str]:
    """Imports from a room of core to a room on a higher floor, as ``file:line -> module (deferred)``."""
    mods = module_files(root)
    out = []
    for m, p in mods.items():
        parts = m.split(".")
        if parts[0] != "core" or len(parts) < 3 or parts[1] not in FLOORS:
            continue
        for name, line, deferred in imports_of(p, m, mods):
            target = name.split(".")
            if target[0] == "core" and len(target) > 1 and FLOORS.get(target[1], -1) > FLOORS[parts[1]]:
                out.append(f"{p.relative_to(root)}:{line} -> {name}" + (" (deferred)" if deferred else ""))
    return out


def main() -> int:
    found = cycles()
    for comp in found:
        print("import cycle: " + " <-> ".join(comp))
    up = up_a_floor()
    for line in up:
        print("up a floor: " + line)
    print(f"{len(found)} import cycle(s), {len(up)} import(s) up a floor, among {len(module_files())} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

"""An install adds one name to site-packages: the wheel built from this checkout, installed into a fresh venv
outside it, gives ``kvscope`` (plus its dist-info) and a ``kvscope`` command that works from another folder.

The fresh venv gets its dependencies (torch, transformers, Qt...) from this environment's site-packages through
a ``.pth`` line, so nothing is downloaded; the wheel itself is installed with ``--no-deps --no-index``. A
``.pth`` line adds a folder to sys.path without running that folder's own ``.pth`` files, so this checkout's
editable install is not seen: what runs is the installed copy.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _declared_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_package_folder_is_declared_and_nothing_else():
    """pyproject.toml lists the packages by hand (the repository root is ``kvscope``): a new sub-package
    that is not listed would be missing from every install."""
    on_disk = {"kvscope"}
    for top in ("core", "ui", "workers"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            on_disk.add(".".join(("kvscope",) + rel.parts))
    assert set(_declared_packages()) == on_disk


def test_project_imports_use_the_one_name():
    """No module imports ``core``, ``ui``, ``workers`` or ``main`` by their bare names: installed, only
    ``kvscope.*`` exists."""
    bare = {"core", "ui", "workers", "main"}
    offenders = []
    files = [ROOT / "main.py", *(p for top in ("core", "ui", "workers", "tests", "scripts", "benchmarks")
                                 for p in (ROOT / top).rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in bare]
    assert offenders == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout's files (the build leaves nothing in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for rel in listed:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp / "dist"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                             "--no-build-isolation", "-w", str(out), str(src)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("kvscope-*.whl")
    return built


def test_wheel_holds_kvscope_and_its_assets_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvscope"}
    for needed in ("kvscope/main.py", "kvscope/core/model/spec.py", "kvscope/ui/main_window.py",
                   "kvscope/workers/sampler.py", "kvscope/assets/presets/llama-3-8b.json",
                   "kvscope/assets/embedded/model.safetensors", "kvscope/assets/demo/demo.jsonl",
                   "kvscope/assets/icons/kvscope-256.png"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith("kvscope/tests/") or "/build/" in n or "__pycache__" in n]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvscope = kvscope.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel installed; returns the venv's folder."""
    env_dir = tmp_path_factory.mktemp("venv") / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    before = set(os.listdir(site))
    result = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    added = set(os.listdir(site)) - before
    assert {a for a in added if not a.endswith(".dist-info")} == {"kvscope"}, added
    assert len([a for a in added if a.endswith(".dist-info")]) == 1, added
    # The dependencies, from this environment, appended after the fresh site-packages.
    (site / "zz_kvscope_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def _run_installed(env_dir: Path, *args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(QT_QPA_PLATFORM="offscreen", HOME=str(cwd))
    return subprocess.run([str(env_dir / "bin" / "kvscope"), *args], capture_output=True, text=True,
                          env=env, cwd=str(cwd), timeout=timeout)


def test_installed_calc_runs_from_another_folder(installed, tmp_path):
    result = _run_installed(installed, "calc", "--model", "llama-3-8b", "--context", "4k", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(result.stdout)["rows"]
    # Llama 3 8B in fp16: 128 KiB per token, 4,096 tokens.
    assert row["context"] == 4096 and row["kv_cache_bytes"] == 536_870_912


def test_installed_package_is_the_one_that_runs(installed, tmp_path):
    """The command imports kvscope from the fresh venv, never from this checkout."""
    python = installed / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(python), "-c", "import kvscope.core.model.spec as s, kvscope.main as m; "
                             "print(m.__file__); print(s.ASSETS)"],
                            capture_output=True, text=True, cwd=str(tmp_path), env=env, check=True)
    main_file, assets = result.stdout.split()
    assert Path(main_file).is_relative_to(installed) and Path(assets).is_relative_to(installed)
    assert (Path(assets) / "presets" / "llama-3-8b.json").is_file()


@pytest.mark.slow
def test_installed_self_test_passes_from_another_folder(installed, tmp_path):
    result = _run_installed(installed, "--self-test", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("self-test")][-1]
    assert line.startswith("self-test OK: 8 tokens, KV ") and "observed == predicted" in line

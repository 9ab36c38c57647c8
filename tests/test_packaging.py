"""The desktop-app packaging: PyInstaller spec, .desktop file, icons, and ``--self-test``.

PyInstaller itself is never run here (minutes); `make package` builds and self-tests the bundle.
These tests check what the build consumes and the self-test the bundle runs.
"""

from __future__ import annotations

import ast
import configparser
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "packaging" / "kvscope.spec"
DESKTOP = ROOT / "packaging" / "kvscope.desktop"
ICONS = ROOT / "assets" / "icons"
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
ICNS_SIZES = {b"icp4": 16, b"icp5": 32, b"icp6": 64, b"ic07": 128, b"ic08": 256, b"ic09": 512,
              b"ic10": 1024, b"ic11": 32, b"ic12": 64, b"ic13": 256, b"ic14": 512}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (which must come first)."""
    assert data[:8] == PNG_MAGIC, "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _qimage(data: bytes):
    from PySide6.QtGui import QImage

    image = QImage()
    assert image.loadFromData(data, "PNG"), "Qt cannot decode this PNG"
    return image


def parse_ico(data: bytes) -> list[tuple[int, bytes]]:
    """(size, PNG bytes) per ICO directory entry; asserts the container is consistent."""
    reserved, kind, count = struct.unpack_from("<HHH", data, 0)
    assert (reserved, kind) == (0, 1), "not an icon (ICONDIR reserved=0, type=1)"
    entries = []
    for i in range(count):
        w, h, colors, res, planes, bpp, size, offset = struct.unpack_from("<BBBBHHII", data, 6 + 16 * i)
        assert (colors, res, planes, bpp) == (0, 0, 1, 32)
        assert offset + size <= len(data)
        payload = data[offset:offset + size]
        dim = w or 256  # 0 means 256 in an ICO directory
        assert (w, h) == (dim % 256, dim % 256)
        entries.append((dim, payload))
    return entries


def parse_icns(data: bytes) -> list[tuple[bytes, bytes]]:
    """(OSType, payload) per ICNS element; asserts the lengths add up."""
    assert data[:4] == b"icns"
    assert struct.unpack(">I", data[4:8])[0] == len(data)
    pos, entries = 8, []
    while pos < len(data):
        kind, length = data[pos:pos + 4], struct.unpack(">I", data[pos + 4:pos + 8])[0]
        assert length > 8 and pos + length <= len(data)
        entries.append((kind, data[pos + 8:pos + length]))
        pos += length
    assert pos == len(data)
    return entries


# ------------------------------------------------------------------------------------------- spec

def test_spec_is_python_and_builds_a_one_folder_gui_app_from_main_with_assets_and_icons():
    text = SPEC.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(SPEC))
    calls = {node.func.id: node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    for needed in ("Analysis", "PYZ", "EXE", "COLLECT"):
        assert needed in calls, f"spec has no {needed}(...)"
    exe_kwargs = {kw.arg: kw.value for kw in calls["EXE"].keywords}
    assert isinstance(exe_kwargs["console"], ast.Constant) and exe_kwargs["console"].value is False
    assert isinstance(exe_kwargs["exclude_binaries"], ast.Constant) and exe_kwargs["exclude_binaries"].value is True
    assert ast.literal_eval(exe_kwargs["name"]) == "kvscope"
    assert ast.literal_eval({kw.arg: kw.value for kw in calls["COLLECT"].keywords}["name"]) == "kvscope"
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert "main.py" in strings
    assert "assets" in strings
    assert {"kvscope.ico", "kvscope.icns"} <= strings
    # Unused Qt modules and developer tools are excluded; the transformers models we build are kept.
    assert {"PySide6.QtQml", "PySide6.QtQuick", "PySide6.QtWebEngineCore", "tkinter", "pytest"} <= strings
    assert {"llama", "mistral", "deepseek_v3"} <= strings


def test_spec_places_assets_where_core_spec_looks_for_them():
    """core/spec.py finds assets at <folder holding core/>/assets; the bundle must put them there."""
    from core.spec import ASSETS

    assert ASSETS == (ROOT / "core" / "spec.py").resolve().parent.parent / "assets"
    text = SPEC.read_text(encoding="utf-8")
    # datas entries are (file, its folder relative to the repository root): assets/... -> _internal/assets/...
    assert 'datas.append((str(path), str(rel.parent)))' in text
    assert 'rel = path.relative_to(ROOT)' in text
    for needed in ("presets/embedded.json", "embedded/corpus.txt", "icons/kvscope-256.png"):
        assert (ASSETS / needed).is_file(), f"assets/{needed} is missing"


# ---------------------------------------------------------------------------------------- desktop

def test_desktop_file_has_the_required_keys():
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # desktop keys are case-sensitive
    parser.read(DESKTOP, encoding="utf-8")
    entry = parser["Desktop Entry"]
    assert entry["Type"] == "Application"
    assert entry["Name"] == "KV Scope"
    assert entry["Exec"].split()[0] == "kvscope"
    assert entry["Icon"] == "kvscope"
    assert entry["Terminal"] == "false"
    assert entry["Comment"].strip()
    categories = [c for c in entry["Categories"].split(";") if c]
    assert {"Development", "Science", "Education"} <= set(categories)
    assert entry["Categories"].endswith(";")  # the spec requires the list to be ;-terminated


# ------------------------------------------------------------------------------------------ icons

def test_master_svg_renders():
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(ICONS / "kvscope.svg"))
    assert renderer.isValid()
    assert renderer.viewBox().width() == renderer.viewBox().height() == 64


@pytest.mark.parametrize("size", PNG_SIZES)
def test_png_icon_exists_at_its_size(size):
    data = (ICONS / f"kvscope-{size}.png").read_bytes()
    assert _png_size(data) == (size, size)
    image = _qimage(data)
    assert (image.width(), image.height()) == (size, size)
    assert image.hasAlphaChannel()
    # Transparent outside the rounded square's corner, opaque in the middle: a drawing, not a blank.
    assert image.pixelColor(0, 0).alpha() == 0
    assert image.pixelColor(size // 2, size // 2).alpha() == 255


def test_ico_lists_every_size_as_png():
    entries = parse_ico((ICONS / "kvscope.ico").read_bytes())
    assert sorted(size for size, _ in entries) == list(ICO_SIZES)
    for size, payload in entries:
        assert _png_size(payload) == (size, size)
        assert _qimage(payload).width() == size


def test_icns_lists_every_size_as_png():
    entries = parse_icns((ICONS / "kvscope.icns").read_bytes())
    assert {kind for kind, _ in entries} == set(ICNS_SIZES)
    for kind, payload in entries:
        assert _png_size(payload) == (ICNS_SIZES[kind],) * 2, kind


def test_make_icons_regenerates_identical_files(tmp_path):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_icons.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    expected = [f"kvscope-{s}.png" for s in PNG_SIZES] + ["kvscope.ico", "kvscope.icns"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
    from PySide6.QtGui import QImage

    # Pixels, not bytes: zlib and the rasterizer may differ slightly from machine to machine.
    for name in expected[:len(PNG_SIZES)]:
        ours, shipped = QImage(str(tmp_path / name)), QImage(str(ICONS / name))
        assert not ours.isNull() and ours.size() == shipped.size(), name
        ours = ours.convertToFormat(QImage.Format.Format_ARGB32)
        shipped = shipped.convertToFormat(QImage.Format.Format_ARGB32)
        import numpy as np

        a = np.frombuffer(bytes(ours.constBits()), dtype=np.uint8).astype(int)
        b = np.frombuffer(bytes(shipped.constBits()), dtype=np.uint8).astype(int)
        # Qt's raster engine may pick another SIMD path on another CPU: antialiased edges differ by a few levels.
        assert np.abs(a - b).max() <= 8, f"{name} differs: run `make icons`"
    assert (tmp_path / "kvscope.ico").read_bytes()[:4] == (ICONS / "kvscope.ico").read_bytes()[:4] == b"\x00\x00\x01\x00"
    assert (tmp_path / "kvscope.icns").read_bytes()[:4] == (ICONS / "kvscope.icns").read_bytes()[:4] == b"icns"


def test_make_icons_refuses_a_missing_svg(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_icons.py"), "--svg",
                             str(tmp_path / "none.svg"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no such SVG" in result.stderr
    assert not list(tmp_path.glob("*.png"))


# -------------------------------------------------------------------------------------- self-test

def test_self_test_fails_with_a_reason_when_assets_are_missing(qapp, monkeypatch, capsys, tmp_path):
    """What a bundle built without assets/ would print, instead of a traceback."""
    import core.spec
    from ui.selftest import self_test

    monkeypatch.setattr(core.spec, "ASSETS", tmp_path / "no-assets")
    assert self_test() == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith("self-test FAILED: assets folder not found at ")
    assert "no-assets" in out


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "core" / "loading.py").exists(), reason="core/loading.py (model loading) not there yet")
def test_main_self_test_exits_0():
    """The same command the packaged app runs: embedded model, 8 tokens, observed == predicted KV bytes."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    result = subprocess.run([sys.executable, str(ROOT / "main.py"), "--self-test"], capture_output=True,
                            text=True, env=env, timeout=300, cwd=str(ROOT))
    assert result.returncode == 0, result.stdout + result.stderr
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("self-test")][-1]
    assert line.startswith("self-test OK: 8 tokens, KV ")
    assert "observed == predicted" in line and "embedded" in line


def test_self_test_failure_reasons_are_one_line():
    from ui.selftest import _one_line

    numpy_style = "\n\nIMPORTANT: PLEASE READ THIS\n\n  * details\n\nOriginal error was: libfoo.so: bad ELF\n"
    assert _one_line(numpy_style) == "IMPORTANT: PLEASE READ THIS ... Original error was: libfoo.so: bad ELF"
    assert _one_line("short") == "short"
    assert _one_line("") == ""

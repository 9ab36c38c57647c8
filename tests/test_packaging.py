"""The desktop-app packaging: PyInstaller spec, .desktop file, icons, and ``--self-test``.

PyInstaller itself is never run here (minutes); `make package` builds and self-tests the bundle.
These tests check what the build consumes and the self-test the bundle runs.
"""

from __future__ import annotations

import ast
import configparser
import os
import re
import shutil
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
    """core/model/spec.py finds assets at <the kvscope package>/assets; the bundle must put them there."""
    from kvscope.core.model.spec import ASSETS

    assert ASSETS == ROOT / "assets"
    text = SPEC.read_text(encoding="utf-8")
    # datas entries are (file, its folder in the bundle): assets/... -> _internal/kvscope/assets/...
    assert 'datas.append((str(path), str(Path("kvscope") / rel.parent)))' in text
    assert 'rel = path.relative_to(ROOT)' in text
    for needed in ("presets/embedded.json", "embedded/corpus.txt", "icons/kvscope-256.png"):
        assert (ASSETS / needed).is_file(), f"assets/{needed} is missing"


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
    # One main category (several put the app in several menus: desktop-file-validate's hint), and
    # Profiling, the additional category of memory and performance tools, under it.
    assert categories == ["Development", "Profiling"]
    assert entry["Categories"].endswith(";")  # the spec requires the list to be ;-terminated


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                    reason="desktop-file-validate not installed (apt-get install desktop-file-utils)")
def test_desktop_file_validates():
    result = subprocess.run(["desktop-file-validate", str(DESKTOP)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                    reason="desktop-file-validate not installed (apt-get install desktop-file-utils)")
def test_desktop_file_validate_catches_what_it_used_to_say(tmp_path):
    """The validator really checks: the entry as it was (Version 1.5, three main categories) fails."""
    old = DESKTOP.read_text(encoding="utf-8").replace("Version=1.4", "Version=1.5").replace(
        "Categories=Development;Profiling;", "Categories=Development;Science;Education;")
    (tmp_path / "kvscope.desktop").write_text(old, encoding="utf-8")
    result = subprocess.run(["desktop-file-validate", str(tmp_path / "kvscope.desktop")], capture_output=True,
                            text=True, timeout=60)
    assert 'value "1.5" for key "Version"' in result.stdout
    assert "more than one main category" in result.stdout


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
    import kvscope.core.model.spec
    from kvscope.ui.selftest import self_test

    monkeypatch.setattr(kvscope.core.model.spec, "ASSETS", tmp_path / "no-assets")
    assert self_test() == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith("self-test FAILED: assets folder not found at ")
    assert "no-assets" in out


@pytest.mark.slow
def test_main_self_test_exits_0():
    """The same command the packaged app runs: embedded model, 8 tokens, observed == predicted KV bytes; then
    the embedded model's GGUF in llama.cpp where llama-cpp-python is installed (the bundle has it)."""
    import importlib.util

    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    result = subprocess.run([sys.executable, str(ROOT / "main.py"), "--self-test"], capture_output=True,
                            text=True, env=env, timeout=300, cwd=str(ROOT))
    assert result.returncode == 0, result.stdout + result.stderr
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("self-test")][-1]
    assert line.startswith("self-test OK: 8 tokens, KV ")
    assert "observed == predicted" in line and "embedded" in line
    if importlib.util.find_spec("llama_cpp") is not None:
        match = re.search(r"llama\.cpp 4 tokens, KV ([\d,]+) B reserved == predicted, ([\d,]+) B used", line)
        assert match, line
        reserved, used = (int(g.replace(",", "")) for g in match.groups())
        assert 0 < used < reserved
    else:
        assert "llama.cpp skipped: " in line


def test_self_test_failure_reasons_are_one_line():
    from kvscope.ui.selftest import _one_line

    numpy_style = "\n\nIMPORTANT: PLEASE READ THIS\n\n  * details\n\nOriginal error was: libfoo.so: bad ELF\n"
    assert _one_line(numpy_style) == "IMPORTANT: PLEASE READ THIS ... Original error was: libfoo.so: bad ELF"
    assert _one_line("short") == "short"
    assert _one_line("") == ""


# ----------------------------------------------------------------------------------- licence, notices

NOTICES = ROOT / "packaging" / "THIRD_PARTY_NOTICES.txt"
sys.path.insert(0, str(ROOT / "scripts"))


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _bundle_requirements() -> list[str]:
    """Canonical names of what the bundle is built from: the dependencies and the quant and llamacpp extras."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = _pyproject()
    extras = project["optional-dependencies"]
    return sorted(canonicalize_name(Requirement(r).name)
                  for r in project["dependencies"] + extras["quant"] + extras["llamacpp"])


def _installed(name: str):
    import importlib.metadata

    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _notice_table(text: str) -> dict[str, tuple[str, str]]:
    """The notices file's summary table: canonical name -> (version, licence)."""
    from packaging.utils import canonicalize_name

    table = {}
    for line in text.split("\n\n", 3)[2].splitlines():
        name, version, licence = re.match(r"  (\S+)\s+(\S+)\s+(.*)$", line).groups()
        table[canonicalize_name(name)] = (version, licence)
    return table


def test_license_is_the_mit_licence_pyproject_declares():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert _pyproject()["license"] == "MIT"
    assert text.startswith("MIT License\n\nCopyright (c) 2026 KV Scope developers\n")
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text
    # The wheel carries the licence and the notices (setuptools' license-files -> .dist-info/licenses/).
    assert set(_pyproject()["license-files"]) == {"LICENSE", "packaging/THIRD_PARTY_NOTICES.txt"}


def test_notices_name_every_bundled_requirement_with_its_installed_licence():
    import make_notices

    table = _notice_table(NOTICES.read_text(encoding="utf-8"))
    assert table["python"][1] == "PSF-2.0"
    for name in _bundle_requirements():
        assert name in table, f"{name} has no entry in {NOTICES.name}: run python scripts/make_notices.py"
        dist = _installed(name)
        if dist is not None:
            # The licence is the distribution's own metadata's, not a guess (pinned: the same version here).
            assert table[name] == (dist.version, make_notices.license_of(dist)), name


def test_notices_carry_the_licence_texts_and_the_lgpl_terms():
    text = NOTICES.read_text(encoding="utf-8")
    # Qt for Python: LGPL-3.0's text (Debian's copy) and the relinking and source offer, once.
    assert text.count("You may replace them with your own build") == 1
    assert "GNU LESSER GENERAL PUBLIC LICENSE" in text and "Version 3, 29 June 2007" in text
    # Texts from the dist-info: torch's BSD-3 ("From PyTorch:"), transformers' Apache-2.0; nvidia-ml-py's
    # notice from pynvml.py's header; PyInstaller's bootloader exception.
    for needed in ("From PyTorch:", "Apache License", "Version 2.0, January 2004",
                   "Copyright (c) 2011-2025, NVIDIA Corporation", "unlimited permission to link or embed compiled"):
        assert needed in text, needed
    for section in ("torch", "transformers", "PySide6_Essentials", "pyqtgraph", "llama_cpp_python", "gguf", "numpy"):
        assert re.search(rf"^{section} \S+  --  ", text, re.M), section


def test_make_notices_writes_each_text_once(tmp_path):
    import make_notices

    same = "Permission is hereby granted, free of charge ..."
    notices = [make_notices.Notice("a", "1", "MIT", [("LICENSE", same)]),
               make_notices.Notice("b", "2", "MIT", [("LICENSE.txt", same)]),
               make_notices.Notice("c", "3", "BSD-3-Clause", [])]
    text = make_notices.render(notices, missing=["zzz"])
    assert text.count(same) == 1
    assert "--- LICENSE.txt: the same text as a's LICENSE, above" in text
    assert "(no licence text shipped with this distribution" in text
    assert "not installed when this file was generated" in text and "zzz" in text


def test_make_notices_reads_this_environment(tmp_path):
    """A fresh run over the installed distributions lists every installed bundled requirement, with a text."""
    import make_notices

    text = make_notices.write_notices(tmp_path / "notices.txt").read_text(encoding="utf-8")
    table = _notice_table(text)
    for name in _bundle_requirements():
        if _installed(name) is not None:
            assert name in table, name
    assert "(no licence text shipped" not in text  # every one found a text (its dist-info's or FALLBACK's)


def test_spec_ships_llama_cpp_the_licence_and_the_notices():
    text = SPEC.read_text(encoding="utf-8")
    tree = ast.parse(text)
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    # Beside the package's assets (_internal/kvscope/), as in a checkout and a wheel: Help > About finds them there.
    assert {"kvscope/LICENSE", "kvscope/packaging/THIRD_PARTY_NOTICES.txt"} <= strings
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert "make_notices.write_notices" in calls
    # llama_cpp's ctypes libraries (llama_cpp/lib/*.so) go in as binaries of the Analysis.
    assert 'collect_dynamic_libs("llama_cpp")' in text
    analysis = next(node for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and ast.unparse(node.func) == "Analysis")
    assert ast.unparse({kw.arg: kw.value for kw in analysis.keywords}["binaries"]) == "LLAMA_CPP_LIBS"
    # The bundle's layout mirrors the repository's, which is where Help > About looks.
    from kvscope.ui.menus import LICENSE_FILE, NOTICES_FILE

    assert (LICENSE_FILE, NOTICES_FILE) == ("LICENSE", "packaging/THIRD_PARTY_NOTICES.txt")


def test_about_shows_the_licence_and_opens_the_notices(qtbot):
    from PySide6.QtWidgets import QMainWindow

    from kvscope.ui.menus import NOTICES_FILE, about_box, legal_file, text_dialog

    window = QMainWindow()
    qtbot.addWidget(window)
    box = about_box(window)
    assert "MIT licence" in box.text() and "LGPL-3.0" in box.text()
    assert box.license_button.isEnabled() and box.notices_button.isEnabled()
    assert legal_file(NOTICES_FILE) == NOTICES
    dialog = text_dialog(window, "Third-party notices", NOTICES_FILE)
    shown = dialog.view.toPlainText()
    assert shown == NOTICES.read_text(encoding="utf-8")
    assert dialog.view.isReadOnly()
    missing = text_dialog(window, "x", "packaging/NO_SUCH_FILE.txt").view.toPlainText()
    assert missing == "packaging/NO_SUCH_FILE.txt was not found"


# ------------------------------------------------------------------------------------------------ .deb

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb not installed (not Debian)")


def _fake_bundle(folder: Path) -> Path:
    """A three-file stand-in for dist/kvscope: a real ELF program (/bin/true), a data file, the notices."""
    (folder / "_internal" / "packaging").mkdir(parents=True)
    shutil.copy2(shutil.which("true"), folder / "kvscope")
    (folder / "_internal" / "base_library.txt").write_text("data\n")
    shutil.copy2(NOTICES, folder / "_internal" / "packaging" / "THIRD_PARTY_NOTICES.txt")
    return folder


def _glibc_needed(path: str) -> tuple[int, ...]:
    """The highest GLIBC_ version in a file's dynamic symbols, by objdump -T (the deb builder uses readelf)."""
    out = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    return max(tuple(map(int, v.split("."))) for v in re.findall(r"\bGLIBC_([0-9]+(?:\.[0-9]+)+)\b", out))


@needs_dpkg
def test_make_deb_packages_a_bundle(tmp_path):
    bundle = _fake_bundle(tmp_path / "bundle")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_deb.py"), "--bundle", str(bundle),
                             "--out", str(tmp_path / "out"), "--compression", "gzip"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    version = _pyproject()["version"]
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    deb = tmp_path / "out" / f"kvscope_{version}_{arch}.deb"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [deb.name]  # the staging folder is gone
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True).stdout
    rows = {line.split()[5].lstrip("."): line for line in listing.splitlines()}
    expected = ["/opt/kvscope/kvscope", "/opt/kvscope/_internal/base_library.txt",
                "/opt/kvscope/_internal/packaging/THIRD_PARTY_NOTICES.txt", "/usr/share/applications/kvscope.desktop",
                "/usr/share/doc/kvscope/copyright", "/usr/share/doc/kvscope/changelog.gz",
                "/usr/share/man/man1/kvscope.1.gz", "/usr/share/icons/hicolor/scalable/apps/kvscope.svg"]
    expected += [f"/usr/share/icons/hicolor/{s}x{s}/apps/kvscope.png" for s in PNG_SIZES]
    for path in expected:
        assert path in rows, path
        assert "root/root" in rows[path]
    assert rows["/opt/kvscope/kvscope"].startswith("-rwxr-xr-x")
    assert rows["/opt/kvscope/_internal/base_library.txt"].startswith("-rw-r--r--")
    assert "/usr/bin/kvscope -> /opt/kvscope/kvscope" in listing
    fields = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
    control = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line and not line.startswith(" "))
    assert (control["Package"], control["Version"], control["Architecture"]) == ("kvscope", version, arch)
    # libc6 at the highest glibc symbol version the program needs, as objdump -T reads it.
    glibc = ".".join(map(str, _glibc_needed(str(bundle / "kvscope"))))
    assert control["Depends"] == f"libc6 (>= {glibc})"
    # The files inside are the bundle's and the repository's, byte for byte.
    unpacked = tmp_path / "unpacked"
    subprocess.run(["dpkg-deb", "--extract", str(deb), str(unpacked)], check=True)
    assert (unpacked / "opt/kvscope/kvscope").read_bytes() == (bundle / "kvscope").read_bytes()
    assert (unpacked / "usr/share/applications/kvscope.desktop").read_bytes() == DESKTOP.read_bytes()
    assert (unpacked / "usr/share/icons/hicolor/48x48/apps/kvscope.png").read_bytes() == \
        (ICONS / "kvscope-48.png").read_bytes()
    copyright_file = (unpacked / "usr/share/doc/kvscope/copyright").read_text()
    assert "Copyright: 2026 KV Scope developers\nLicense: Expat\n" in copyright_file
    assert "/opt/kvscope/_internal/packaging/THIRD_PARTY_NOTICES.txt" in copyright_file
    # Each lintian override has its reason above it, as a comment.
    overrides = (unpacked / "usr/share/lintian/overrides/kvscope").read_text().splitlines()
    assert len(overrides) % 2 == 0 and overrides
    for reason, tag in zip(overrides[::2], overrides[1::2]):
        assert re.fullmatch(r"# [a-z0-9-]+: .{20,}", reason) and re.fullmatch(r"kvscope: [a-z0-9-]+", tag)
        assert reason.split(":")[0][2:] == tag.split(": ")[1]
    if shutil.which("lintian"):
        lint = subprocess.run(["lintian", "--no-cfg", str(deb)], capture_output=True, text=True, timeout=300)
        tags = [line for line in lint.stdout.splitlines() if re.match(r"[EW]: ", line)]
        assert tags == [], lint.stdout


@needs_dpkg
def test_make_deb_refuses_a_folder_without_the_program(tmp_path):
    (tmp_path / "empty").mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_deb.py"), "--bundle",
                             str(tmp_path / "empty"), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"make_deb: {tmp_path / 'empty' / 'kvscope'} is not an executable program: "
                                     "build the bundle first (make package)")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


BUILT_DEBS = sorted((ROOT / "dist").glob("kvscope_*.deb"))


@pytest.mark.skipif(not BUILT_DEBS, reason="no dist/kvscope_*.deb (make deb builds one: minutes)")
def test_built_deb_has_the_bundle_llama_cpp_and_the_notices():
    listing = subprocess.run(["dpkg-deb", "--contents", str(BUILT_DEBS[-1])], capture_output=True, text=True,
                             check=True).stdout
    paths = {line.split()[5].lstrip(".") for line in listing.splitlines()}
    for needed in ("/opt/kvscope/kvscope", "/opt/kvscope/_internal/LICENSE",
                   "/opt/kvscope/_internal/packaging/THIRD_PARTY_NOTICES.txt",
                   "/opt/kvscope/_internal/llama_cpp/lib/libllama.so", "/usr/share/applications/kvscope.desktop",
                   "/usr/share/icons/hicolor/256x256/apps/kvscope.png", "/usr/share/doc/kvscope/copyright"):
        assert needed in paths, needed
    assert "/usr/bin/kvscope -> /opt/kvscope/kvscope" in listing


@needs_dpkg
def test_notices_attribute_system_libraries_to_their_debian_packages():
    """The bundle's notices name the Debian package of each library PyInstaller took from the system, with
    its copyright file, whichever of /lib and /usr/lib (merged /usr) the loader reported."""
    import make_notices

    libz = next((p for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1",
                             "/lib/aarch64-linux-gnu/libz.so.1") if Path(p).exists()), None)
    if libz is None:
        pytest.skip("no libz.so.1 in the usual places")
    owner = subprocess.run(["dpkg-query", "-S", "libz.so.1*"], capture_output=True, text=True).stdout.split(":")[0]
    for path in {libz, str(Path(libz).resolve())}:
        assert make_notices.debian_owner(path) == owner
    (notice,) = make_notices.system_library_notices([libz])
    assert notice.name == owner and "libz.so.1" in notice.note
    assert notice.texts and "zlib" in notice.texts[0][1].lower()


@needs_dpkg
def test_deb_depends_on_what_carried_libraries_read():
    """A bundled libfontconfig needs /etc/fonts (fontconfig-config); a bundled library is never a dependency."""
    import make_deb

    scan = make_deb.ElfScan(needed={"libfontconfig.so.1": ["x"], "libc.so.6": ["x"]}, glibc=(2, 34),
                            provided={"libfontconfig.so.1"})
    entries, unresolved = make_deb.depends(scan)
    assert entries == ["libc6 (>= 2.34)", "fontconfig-config"] and unresolved == []
    assert make_deb.policy_package("libxkbcommon-x11.so.0") == "libxkbcommon-x11-0"
    assert make_deb.policy_package("libEGL.so.1") == "libegl1"
    assert make_deb.policy_package("not-a-library") is None

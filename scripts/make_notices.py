#!/usr/bin/env python3
"""Write the third-party notices of what the desktop bundle ships: packaging/THIRD_PARTY_NOTICES.txt.

    python scripts/make_notices.py            # (re)write packaging/THIRD_PARTY_NOTICES.txt from this environment
    python scripts/make_notices.py --check    # exit 1 if the file would change

Which distributions: the closure of kvscope's requirements (pyproject.toml's dependencies and the extras
the bundle ships, ``quant`` and ``llamacpp``) over the distributions installed in the running Python, read
from their metadata: what PyInstaller can find is what pip installed for those requirements. Each one's
licence is its own metadata's (``License-Expression``, else ``License``, else the trove classifiers) and
its licence texts are the files its dist-info carries (``License-File``); the few wheels that carry none
(PySide6's, shiboken6's, tokenizers', nvidia-ml-py's) get the text named in ``FALLBACK``: Debian's copy of
the licence (/usr/share/common-licenses) or the notice in the package's own source. Identical texts are
written once.

The PyInstaller spec calls :func:`write_notices` with the shared libraries it collected from the build
system (``system_libraries``): each is attributed to its Debian package (``dpkg -S``) and that package's
copyright file is appended, so the bundle's copy also covers libffi, libssl and the like.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
DEFAULT_OUT = ROOT / "packaging" / "THIRD_PARTY_NOTICES.txt"
#: The optional extras the bundle is built with (`make package`); dev and package are build tools only.
BUNDLE_EXTRAS = ("quant", "llamacpp")
COMMON_LICENSES = Path("/usr/share/common-licenses")
#: Wheels whose dist-info carries no licence text: where the text comes from instead.
#: ("common", NAME): Debian's copy in /usr/share/common-licenses; ("header", MODULE): the licence comment
#: at the top of that module's source, as the package ships it.
FALLBACK: dict[str, list[tuple[str, str]]] = {
    "pyside6-essentials": [("common", "LGPL-3"), ("common", "GPL-3")],
    "shiboken6": [("common", "LGPL-3"), ("common", "GPL-3")],
    "tokenizers": [("common", "Apache-2.0")],
    "sentencepiece": [("common", "Apache-2.0")],
    "nvidia-ml-py": [("header", "pynvml")],
}
#: Components a wheel vendors without their own licence file in its dist-info: (title, text) added after the
#: wheel's own texts. llama-cpp-python's wheel is built from the llama.cpp (ggml) sources it vendors.
VENDORED: dict[str, list[tuple[str, str]]] = {
    "llama-cpp-python": [("llama.cpp's LICENSE (vendored in llama-cpp-python; https://github.com/ggml-org/llama.cpp)",
                          """MIT License

Copyright (c) 2023-2024 The ggml authors

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.""")],
}
#: Said once, above the notices of Qt's Python bindings (LGPL-3.0: the user may replace the libraries).
LGPL_NOTE = """\
Qt 6 and Qt for Python (PySide6, shiboken6) are used under the GNU Lesser General Public License
version 3 (LGPL-3.0-only; the LGPL-3.0 text and the GPL-3.0 text it builds on follow). KV Scope does
not modify them: the bundle ships the unmodified shared libraries of the PySide6-Essentials and
shiboken6 wheels named here, in _internal/PySide6/ (Qt's libraries in _internal/PySide6/Qt/lib) and
_internal/shiboken6/, loaded at run time. You may replace them with your own build of the same
versions (or a compatible one) by overwriting those files: nothing in the bundle is statically linked
to Qt. The source code of these versions is published by The Qt Company at https://download.qt.io/
(Qt 6 and the matching pyside-setup release); on request, for at least three years from the date you
received this bundle, the KV Scope developers will provide a copy of that corresponding source code
at no charge beyond the cost of media and shipping (ask on the project's issue tracker). Qt's own
third-party components (for example HarfBuzz, FreeType, libpng, PCRE2, zlib, double-conversion) are
listed with their licences in Qt's documentation, "Licenses Used in Qt"
(https://doc.qt.io/qt-6/licenses-used-in-qt.html).
"""
PYINSTALLER_NOTE = """\
The program file (kvscope) is PyInstaller's bootloader. PyInstaller is distributed under the GNU
General Public License version 2 or later with a special exception that allows its bootloader to be
linked into, and distributed with, programs under any licence: "In addition to the permissions in
the GNU General Public License, the authors give you unlimited permission to link or embed compiled
bootloader and related files into combinations with other programs, and to distribute those
combinations without any restriction coming from the use of those files."
(https://github.com/pyinstaller/pyinstaller/blob/develop/COPYING.txt)
"""


@dataclass
class Notice:
    """One third-party component: its name, version, licence and licence texts (title, text)."""

    name: str
    version: str
    license: str
    texts: list[tuple[str, str]] = field(default_factory=list)
    note: str = ""


def _requirements(pyproject: Path, extras: tuple[str, ...]) -> list[Requirement]:
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    reqs = list(data.get("dependencies", []))
    for extra in extras:
        reqs += data.get("optional-dependencies", {}).get(extra, [])
    return [Requirement(r) for r in reqs]


def _installed() -> dict[str, md.Distribution]:
    found: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)
    return found


def requirement_closure(pyproject: Path = PYPROJECT, extras: tuple[str, ...] = BUNDLE_EXTRAS
                        ) -> tuple[list[md.Distribution], list[str]]:
    """The installed distributions kvscope's requirements reach (sorted by name), and the requirements
    that are not installed here (names)."""
    installed = _installed()
    seen: dict[str, md.Distribution] = {}
    missing: list[str] = []
    todo: list[tuple[Requirement, tuple[str, ...]]] = [(r, ()) for r in _requirements(pyproject, extras)]
    while todo:
        req, active_extras = todo.pop()
        env_extras = active_extras or ("",)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
            continue
        key = canonicalize_name(req.name)
        dist = installed.get(key)
        if dist is None:
            if key not in missing:
                missing.append(key)
            continue
        if key in seen and not req.extras:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            todo.append((Requirement(text), tuple(req.extras)))
    return sorted(seen.values(), key=lambda d: canonicalize_name(d.metadata["Name"])), sorted(missing)


def license_of(dist: md.Distribution) -> str:
    """The licence a distribution declares: License-Expression, else a one-line License, else classifiers."""
    meta = dist.metadata
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return expression
    declared = (meta.get("License") or "").strip()
    if declared and "\n" not in declared and len(declared) <= 80:
        return declared
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return " / ".join(classifiers)
    return declared.splitlines()[0] if declared else "not declared"


def _dist_info(dist: md.Distribution) -> Path | None:
    path = getattr(dist, "_path", None)  # importlib.metadata.PathDistribution: its .dist-info folder
    return Path(path) if path is not None else None


def _license_files(dist: md.Distribution) -> list[tuple[str, str]]:
    folder = _dist_info(dist)
    if folder is None:
        return []
    texts = []
    declared = dist.metadata.get_all("License-File") or []
    for rel in declared:
        for candidate in (folder / "licenses" / rel, folder / rel):
            if candidate.is_file():
                texts.append((rel, candidate.read_text(encoding="utf-8", errors="replace")))
                break
    if not texts:  # older metadata: LICENSE files in the dist-info without a License-File field
        for candidate in sorted(folder.rglob("*")):
            if candidate.is_file() and re.search(r"LICEN[CS]E|COPYING|NOTICE", candidate.name, re.I):
                texts.append((str(candidate.relative_to(folder)), candidate.read_text(encoding="utf-8",
                                                                                   errors="replace")))
    return texts


def _module_header(module: str) -> str:
    """The leading comment block of a module's source (where nvidia-ml-py keeps its BSD licence)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    lines = []
    for line in Path(spec.origin).read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").rstrip()[1:] if line.startswith("# ") else line.lstrip("#").rstrip())
    return "\n".join(lines).strip("\n")


def _fallback_texts(key: str) -> list[tuple[str, str]]:
    texts = []
    for kind, what in FALLBACK.get(key, []):
        if kind == "common":
            path = COMMON_LICENSES / what
            text = path.read_text(encoding="utf-8") if path.is_file() else ""
            texts.append((f"{what} (Debian's copy: {path})", text))
        elif kind == "header":
            texts.append((f"the notice at the top of {what}.py", _module_header(what)))
    return [(title, text) for title, text in texts if text.strip()]


def notice_of(dist: md.Distribution) -> Notice:
    key = canonicalize_name(dist.metadata["Name"])
    texts = (_license_files(dist) or _fallback_texts(key)) + VENDORED.get(key, [])
    return Notice(name=dist.metadata["Name"], version=dist.version, license=license_of(dist), texts=texts)


def python_notice() -> Notice:
    """The Python interpreter the bundle embeds (libpython and the standard library)."""
    candidates = [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
                  Path(f"/usr/share/doc/python{sys.version_info.major}.{sys.version_info.minor}/copyright")]
    texts = [(str(p), p.read_text(encoding="utf-8", errors="replace")) for p in candidates if p.is_file()][:1]
    return Notice(name="Python", version=".".join(map(str, sys.version_info[:3])), license="PSF-2.0", texts=texts)


def debian_owner(path: str) -> str | None:
    """The Debian package that installed ``path`` (``dpkg -S``), trying the path as given, its resolved target,
    and each with and without the /usr prefix: with merged /usr, dpkg knows a library by the path its package
    installed it at (/lib/x86_64-linux-gnu/libz.so.1.2.13), which may not be the one a loader reports."""
    candidates = []
    for p in (str(path), str(Path(path).resolve())):
        candidates += [p, p[4:] if p.startswith("/usr/") else "/usr" + p]
    for candidate in dict.fromkeys(candidates):
        try:
            out = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0 and out.stdout:
            return out.stdout.split(":", 1)[0].split(",")[0].strip()
    return None


def system_library_notices(paths: list[str]) -> list[Notice]:
    """Debian packages that own the given shared libraries (``dpkg -S``), with their copyright files."""
    owners: dict[str, list[str]] = {}
    for path in sorted(set(paths)):
        package = debian_owner(path)
        owners.setdefault(package or "(no Debian package)", []).append(Path(path).name)
    notices = []
    for package, libs in sorted(owners.items()):
        copyright_file = Path("/usr/share/doc") / package / "copyright"
        version = ""
        if package != "(no Debian package)":
            version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True,
                                     text=True).stdout.strip()
        texts = [(str(copyright_file), copyright_file.read_text(encoding="utf-8", errors="replace"))] \
            if copyright_file.is_file() else []
        notices.append(Notice(name=package, version=version, license="see the copyright file below", texts=texts,
                              note="shared libraries from the build system: " + ", ".join(sorted(libs))))
    return notices


def render(notices: list[Notice], missing: list[str], system: list[Notice] = ()) -> str:
    """The notices file's text: a summary table, then each component with its licence texts (each
    distinct text written once; a repeat names where it was written)."""
    rule = "=" * 100
    out = ["KV Scope: third-party notices", "",
           "KV Scope itself is under the MIT licence (the LICENSE file; Copyright (c) 2026 KV Scope developers).",
           "The desktop bundle (PyInstaller folder, .deb) also contains the components below, each under its own",
           "licence, read from the metadata of the installed distributions by scripts/make_notices.py.", ""]
    width = max([len(n.name) for n in notices + list(system)] + [10])
    for n in notices + list(system):
        out.append(f"  {n.name:<{width}}  {n.version:<16}  {n.license}")
    if missing:
        out += ["", "Required but not installed when this file was generated (not in a bundle built here): "
                + ", ".join(missing)]
    out += ["", rule, "PyInstaller bootloader", rule, PYINSTALLER_NOTE]
    written: dict[str, str] = {}
    for n in notices + list(system):
        out += [rule, f"{n.name} {n.version}".rstrip() + f"  --  {n.license}", rule]
        if canonicalize_name(n.name) == "pyside6-essentials":
            out += [LGPL_NOTE]
        if n.note:
            out += [n.note, ""]
        if not n.texts:
            out += ["(no licence text shipped with this distribution; its licence is named above)", ""]
        for title, text in n.texts:
            digest = hashlib.sha256(text.strip().encode()).hexdigest()
            if digest in written:
                out += [f"--- {title}: the same text as {written[digest]}, above", ""]
                continue
            written[digest] = f"{n.name}'s {title}"
            out += [f"--- {title}", text.rstrip(), ""]
    return "\n".join(out).rstrip() + "\n"


def shipped_distributions(top_level_names: set[str]) -> list[md.Distribution]:
    """The installed distributions that provide these top-level modules or folders (``torch``, ``PySide6``,
    ``yaml``): what a bundle holding them ships, whatever pulled them in."""
    providers = md.packages_distributions()
    installed = _installed()
    found: dict[str, md.Distribution] = {}
    for name in top_level_names:
        for dist_name in providers.get(name, []):
            dist = installed.get(canonicalize_name(dist_name))
            if dist is not None:
                found[canonicalize_name(dist_name)] = dist
    return sorted(found.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def build_text(system_libraries: list[str] = (), shipped: set[str] | None = None) -> str:
    """The notices of the requirement closure (the wheel's copy), or of the distributions providing the
    top-level modules ``shipped`` (the bundle's copy: what PyInstaller collected, whatever imported it)."""
    if shipped is None:
        dists, missing = requirement_closure()
    else:
        dists, missing = shipped_distributions(shipped), []
    notices = [python_notice()] + [notice_of(d) for d in dists if canonicalize_name(d.metadata["Name"]) != "kvscope"]
    system = system_library_notices(list(system_libraries)) if system_libraries else []
    return render(notices, missing, system)


def write_notices(out: Path = DEFAULT_OUT, system_libraries: list[str] = (), shipped: set[str] | None = None) -> Path:
    """Write the notices to ``out`` (folders made as needed); returns ``out``. See ``build_text``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_text(system_libraries, shipped), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not what would be written")
    args = parser.parse_args(argv)
    text = build_text()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run python scripts/make_notices.py", file=sys.stderr)
            return 1
        return 0
    write_notices(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

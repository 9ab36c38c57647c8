#!/usr/bin/env python3
"""Package the PyInstaller folder (dist/kvscope) as a Debian package: ``make deb``.

    python scripts/make_deb.py                          # dist/kvscope -> dist/kvscope_<version>_<arch>.deb
    python scripts/make_deb.py --bundle DIR --out DIR   # any one-folder bundle with a `kvscope` program in it

What the package installs:

    /opt/kvscope/                      the bundle as it is (kvscope and _internal/)
    /usr/bin/kvscope                   -> /opt/kvscope/kvscope (a symlink: PyInstaller's bootloader finds
                                          _internal/ from /proc/self/exe, the link's target)
    /usr/share/applications/kvscope.desktop
    /usr/share/icons/hicolor/NxN/apps/kvscope.png, .../scalable/apps/kvscope.svg
    /usr/share/doc/kvscope/copyright   MIT (machine-readable), pointing at the bundle's third-party notices
    /usr/share/doc/kvscope/changelog.gz
    /usr/share/man/man1/kvscope.1.gz
    /usr/share/lintian/overrides/kvscope   the lintian tags a PyInstaller bundle in /opt raises, each with its reason

``Depends`` is worked out as dpkg-shlibdeps would for a prebuilt folder: every ELF file's DT_NEEDED libraries
that the bundle does not carry itself are looked up on this (the build) system with ``ldconfig -p`` and
attributed to their Debian packages with ``dpkg -S``; libc6 gets the highest GLIBC_ symbol version any
file needs (``readelf -V``). Ownership is root:root (``dpkg-deb --root-owner-group``, no fakeroot).
"""

from __future__ import annotations

import argparse
import email.utils
import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvscope"
DESKTOP = ROOT / "packaging" / "kvscope.desktop"
ICONS = ROOT / "assets" / "icons"
LICENSE = ROOT / "LICENSE"
PREFIX = Path("opt") / PACKAGE
#: The bundle's notices file, relative to the bundle (where packaging/kvscope.spec puts it).
NOTICES_IN_BUNDLE = Path("_internal") / "packaging" / "THIRD_PARTY_NOTICES.txt"
DEFAULT_MAINTAINER = "KV Scope developers <kvscope@example.org>"
ELF_MAGIC = b"\x7fELF"
#: The packages that provide glibc's own libraries: versioned by the GLIBC_ symbols, never looked up.
GLIBC_SONAMES = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libutil.so.1",
                 "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libresolv.so.2", "libanl.so.1"}

#: lintian tags a PyInstaller folder in /opt raises (lintian 2.116, Debian 12, on the bundle built here), and
#: why each is right for this package: written into the package's lintian overrides, and said in the README.
LINTIAN_OVERRIDES = {
    "dir-or-file-in-opt": "a self-contained third-party bundle: /opt is the FHS place for add-on software that is "
                          "not part of the distribution, and the bundle finds its files relative to its program",
    "embedded-library": "the bundle carries the libraries it was built and tested with (zlib, expat, libpng, "
                        "freetype ... collected by PyInstaller, listed with their copyright in the notices)",
    "binary-has-unneeded-section": "prebuilt libraries of wheels and of the build system, shipped as built",
    "hardening-no-bindnow": "prebuilt libraries of wheels and of the build system, shipped as built",
    "hardening-no-fortify-functions": "prebuilt libraries of wheels and of the build system, shipped as built",
    "hardening-no-pie": "PyInstaller's prebuilt bootloader (the kvscope program) and torch's torch_shm_manager",
    "spelling-error-in-binary": "text inside prebuilt third-party libraries",
    "custom-library-search-path": "wheels' libraries find their neighbours through $ORIGIN run paths",
    "shared-library-lacks-prerequisites": "Python extension modules take their symbols from libpython, which "
                                          "the bundle's program loads first",
    "library-not-linked-against-libc": "extension modules and libraries that call no libc function themselves",
    "unstripped-binary-or-object": "libraries auditwheel vendored (numpy.libs/): stripping a patchelf'd file "
                                   "breaks it (see packaging/kvscope.spec); two stdlib modules strip refused",
    "extra-license-file": "the bundled Python distributions' licence files, kept in their .dist-info folders",
    "package-contains-documentation-outside-usr-share-doc": "the bundled distributions' metadata files "
                                                           "(.dist-info), which importlib.metadata reads",
    "script-not-executable": "Python modules of bundled packages with a #! line, imported, never run",
    "wrong-path-for-interpreter": "torch's module sources with a '#!/usr/bin/env/python3' line, imported, "
                                  "never run (mode 0644)",
    "unusual-interpreter": "transformers' module sources with a '#!python' line, imported, never run",
    "missing-depends-on-sensible-utils": "libmount and libblkid (collected with GTK's dependencies) name "
                                         "sensible-pager for util-linux's own tools; the app never pages",
}


class DebError(Exception):
    """The package could not be built; the message says why, in one line."""


@dataclass
class ElfScan:
    """What the bundle's ELF files need from the system."""

    needed: dict[str, list[str]] = field(default_factory=dict)  # soname -> files that need it
    glibc: tuple[int, ...] = (2, 2, 5)
    glibcxx: tuple[int, ...] | None = None
    provided: set[str] = field(default_factory=set)  # file names (sonames) the bundle carries
    elf_files: int = 0


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def project_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]


def dpkg_architecture() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


def scan_elf(folder: Path, batch: int = 64) -> ElfScan:
    """DT_NEEDED and glibc/libstdc++ symbol versions of every ELF file under ``folder`` (``readelf -dVW``)."""
    scan = ElfScan()
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and _is_elf(p)]
    scan.elf_files = len(files)
    scan.provided = {p.name for p in folder.rglob("*") if p.is_file()}
    for start in range(0, len(files), batch):
        chunk = files[start:start + batch]
        out = subprocess.run(["readelf", "-dVW", *map(str, chunk)], capture_output=True, text=True).stdout
        current = str(chunk[0])
        for line in out.splitlines():
            if line.startswith("File: "):
                current = line[6:].strip()
                continue
            m = re.search(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", line)
            if m:
                scan.needed.setdefault(m.group(1), []).append(current)
                continue
            m = re.search(r"Name: (GLIBC|GLIBCXX)_([0-9.]+)\b", line)
            if m and re.fullmatch(r"[0-9]+(\.[0-9]+)*", m.group(2)):
                version = _version_tuple(m.group(2))
                if m.group(1) == "GLIBC":
                    scan.glibc = max(scan.glibc, version)
                else:
                    scan.glibcxx = max(scan.glibcxx or version, version)
    return scan


def _ldconfig_paths() -> dict[str, str]:
    """soname -> path of this system's x86-64/arm64 (the running architecture's) libraries."""
    out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
    bits = "x86-64" if os.uname().machine == "x86_64" else os.uname().machine
    paths: dict[str, str] = {}
    for line in out.splitlines()[1:]:
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
        if m and (bits in m.group(2) or "64" in m.group(2)):
            paths.setdefault(m.group(1), m.group(3))
    return paths


def _owner(path: str) -> str | None:
    for candidate in dict.fromkeys((path, str(Path(path).resolve()))):
        out = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout:
            return out.stdout.split(":", 1)[0].split(",")[0].strip()
    # usrmerge: /lib/x86_64-linux-gnu/... is owned as /usr/lib/... or the other way round
    alt = path[4:] if path.startswith("/usr/") else "/usr" + path
    out = subprocess.run(["dpkg", "-S", alt], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout:
        return out.stdout.split(":", 1)[0].split(",")[0].strip()
    return None


#: Data packages that a library the bundle carries reads at run time (not a DT_NEEDED): its configuration.
#: Seen on a minbase Debian 12: "Fontconfig error: Cannot load default config file" without /etc/fonts.
CARRIED_LIBRARY_NEEDS = {"libfontconfig.so.1": "fontconfig-config"}


def policy_package(soname: str) -> str | None:
    """The Debian package name for a shared library's soname by policy 8.1 (libfoo.so.1 -> libfoo1,
    libfoo-x11.so.0 -> libfoo-x11-0, lowercased), or None for a name that is not libNAME.so.N."""
    m = re.fullmatch(r"lib(.+)\.so\.([0-9]+)", soname)
    if not m:
        return None
    name, major = m.group(1).lower().replace("_", "-"), m.group(2)
    return f"lib{name}{'-' if name[-1].isdigit() else ''}{major}"


def _apt_knows(package: str) -> bool:
    if shutil.which("apt-cache") is None:
        return False
    out = subprocess.run(["apt-cache", "show", "--no-all-versions", package], capture_output=True, text=True)
    return out.returncode == 0 and f"Package: {package}" in out.stdout


def depends(scan: ElfScan) -> tuple[list[str], list[str]]:
    """(Depends entries, sonames not found on this system). The bundle's own libraries are skipped."""
    system = _ldconfig_paths()
    packages: set[str] = set()
    unresolved: list[str] = []
    for soname in sorted(scan.needed):
        if soname in scan.provided:
            continue
        if soname in GLIBC_SONAMES:
            continue
        path = system.get(soname)
        package = _owner(path) if path else None
        if package is None:
            # Not installed on the build system (the Qt xcb plugin's libraries on a headless builder): the
            # package that Debian's library naming gives it, when apt knows one of that name.
            package = policy_package(soname)
            if package is None or not _apt_knows(package):
                unresolved.append(soname)
                continue
        packages.add(package)
    packages.update(need for lib, need in CARRIED_LIBRARY_NEEDS.items() if lib in scan.provided)
    packages.discard("libc6")
    entries = [f"libc6 (>= {'.'.join(map(str, scan.glibc))})"]
    if "libstdc++6" in packages and scan.glibcxx:
        packages.discard("libstdc++6")
        entries.append(f"libstdc++6 (>= {_gcc_for_glibcxx(scan.glibcxx)})")
    entries += sorted(packages)
    return entries, unresolved


def _gcc_for_glibcxx(version: tuple[int, ...]) -> str:
    """The libstdc++6 package version that first provides GLIBCXX_<version> (GCC's ABI table)."""
    table = {(3, 4, 28): "10", (3, 4, 29): "11", (3, 4, 30): "12", (3, 4, 31): "13", (3, 4, 32): "14",
             (3, 4, 33): "14", (3, 4, 26): "9", (3, 4, 25): "8", (3, 4, 24): "7", (3, 4, 23): "7",
             (3, 4, 22): "6", (3, 4, 21): "5"}
    return table.get(version, "5")


def _normalise_modes(folder: Path) -> None:
    """Folders 0755; files 0755 when they are programs (an ELF executable or a #! script that was
    executable in the bundle), else 0644 (shared libraries included, as Debian policy asks)."""
    for path in folder.rglob("*"):
        if path.is_symlink():
            continue
        if path.is_dir():
            path.chmod(0o755)
            continue
        mode = path.stat().st_mode
        executable = bool(mode & stat.S_IXUSR)
        if executable:
            with open(path, "rb") as f:
                head = f.read(20)
            is_program = head[:2] == b"#!" or (head[:4] == ELF_MAGIC and head[16] == 2)  # ET_EXEC
            if head[:4] == ELF_MAGIC and head[16] == 3:  # ET_DYN: a PIE program or a shared library
                is_program = ".so" not in path.name
            executable = is_program
        path.chmod(0o755 if executable else 0o644)


def _gz(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as f:
        f.write(data)
    return buf.getvalue()


def _write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    path.chmod(mode)


def copyright_text() -> str:
    license_body = LICENSE.read_text(encoding="utf-8").split("\n", 3)[3].strip("\n")  # after the title
    body = "\n".join(" " + (line if line.strip() else ".") for line in license_body.splitlines())
    return (
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
        "Upstream-Name: KV Scope\n"
        "\n"
        "Files: *\n"
        "Copyright: 2026 KV Scope developers\n"
        "License: Expat\n"
        "\n"
        "Files: opt/kvscope/_internal/*\n"
        "Copyright: the respective authors of each bundled component\n"
        "License: other\n"
        " The bundle in /opt/kvscope carries Python, Qt (PySide6, LGPL-3.0), torch, transformers,\n"
        " llama.cpp and other components, each under its own licence. Their licence texts are in\n"
        f" /{PREFIX / NOTICES_IN_BUNDLE}, and the LGPL-3.0 relinking and source offer\n"
        " is written there above Qt's entry.\n"
        "\n"
        "License: Expat\n"
        f"{body}\n"
    )


def changelog_text(version: str, maintainer: str, when: float) -> str:
    return (f"{PACKAGE} ({version}) unstable; urgency=medium\n\n"
            f"  * Release {version}: the PyInstaller desktop bundle packaged for Debian.\n\n"
            f" -- {maintainer}  {email.utils.formatdate(when)}\n")


def manpage_text(version: str) -> str:
    return (f'.TH KVSCOPE 1 "" "kvscope {version}" "User Commands"\n'
            ".SH NAME\nkvscope \\- see and predict the KV cache of a local LLM\n"
            ".SH SYNOPSIS\n.B kvscope\n.RI [ command ] \" [\" options ]\n"
            ".SH DESCRIPTION\nWithout a command, \\fBkvscope\\fR opens the window: live plots of KV-cache growth "
            "and predicted versus observed memory while a model generates.\n"
            ".SH COMMANDS\n.TP\n.B calc\npredict the memory of a model and context without loading it\n"
            ".TP\n.B run\ngenerate in the terminal, one row per token\n"
            ".TP\n.B replay\nplay a recording\n"
            ".TP\n.B watch\nread inference servers' /metrics pages\n"
            ".TP\n.B \\-\\-self\\-test\nrun the embedded model for a few tokens offscreen and check the KV bytes\n"
            ".PP\n\\fBkvscope \\fIcommand\\fB \\-\\-help\\fR lists each command's options.\n"
            ".SH FILES\n.TP\n.I /opt/kvscope/_internal/packaging/THIRD_PARTY_NOTICES.txt\n"
            "the licences of the bundled components\n")


def overrides_text() -> str:
    lines = [f"# {tag}: {why}\n{PACKAGE}: {tag}\n" for tag, why in sorted(LINTIAN_OVERRIDES.items())]
    return "".join(lines)


def control_text(version: str, arch: str, maintainer: str, installed_kib: int, depends_list: list[str]) -> str:
    return (f"Package: {PACKAGE}\n"
            f"Version: {version}\n"
            f"Architecture: {arch}\n"
            f"Maintainer: {maintainer}\n"
            f"Installed-Size: {installed_kib}\n"
            f"Depends: {', '.join(depends_list)}\n"
            "Section: science\n"
            "Priority: optional\n"
            "Description: see and predict the KV cache of a local LLM\n"
            " KV Scope shows live plots of KV-cache growth, device memory and predicted\n"
            " versus observed bytes while a local language model generates, token by\n"
            " token, and predicts what a model and context will need before anything is\n"
            " loaded. Runs with transformers (torch) or llama.cpp (GGUF files).\n"
            " .\n"
            " This package installs the self-contained desktop bundle in /opt/kvscope.\n")


def md5sums_text(stage: Path) -> str:
    """DEBIAN/md5sums: one line per regular file (not links), paths relative to the root."""
    lines = []
    for path in sorted(stage.rglob("*")):
        rel = path.relative_to(stage)
        if rel.parts[0] == "DEBIAN" or path.is_symlink() or not path.is_file():
            continue
        digest = hashlib.md5()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        lines.append(f"{digest.hexdigest()}  {rel.as_posix()}\n")
    return "".join(lines)


def _du_kib(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        if path.is_symlink() or path.is_dir():
            total += 1
        else:
            total += (path.stat().st_size + 1023) // 1024
    return total


def build(bundle: Path, out: Path, version: str | None = None, arch: str | None = None,
          compression: str = "xz", maintainer: str | None = None, keep_stage: bool = False) -> Path:
    """Build ``<out>/kvscope_<version>_<arch>.deb`` from a one-folder bundle; the .deb's path."""
    bundle = Path(bundle)
    program = bundle / PACKAGE
    if not program.is_file() or not os.access(program, os.X_OK):
        raise DebError(f"{program} is not an executable program: build the bundle first (make package)")
    if shutil.which("dpkg-deb") is None:
        raise DebError("dpkg-deb not found: install dpkg (Debian/Ubuntu) to build a .deb")
    version = version or project_version()
    arch = arch or dpkg_architecture()
    maintainer = maintainer or (f"{os.environ['DEBFULLNAME']} <{os.environ['DEBEMAIL']}>"
                                if os.environ.get("DEBFULLNAME") and os.environ.get("DEBEMAIL") else DEFAULT_MAINTAINER)
    when = float(os.environ.get("SOURCE_DATE_EPOCH", time.time()))
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f"{PACKAGE}-deb-", dir=out))
    try:
        stage.chmod(0o755)
        target = stage / PREFIX
        shutil.copytree(bundle, target, symlinks=True)
        _normalise_modes(target)
        scan = scan_elf(target)
        depends_list, unresolved = depends(scan)
        if unresolved:
            print(f"make_deb: not found on this system (left out of Depends): {', '.join(unresolved)}",
                  file=sys.stderr)
        (stage / "usr" / "bin").mkdir(parents=True)
        os.symlink(f"/{PREFIX}/{PACKAGE}", stage / "usr" / "bin" / PACKAGE)
        share = stage / "usr" / "share"
        _write(share / "applications" / f"{PACKAGE}.desktop", DESKTOP.read_bytes())
        for png in sorted(ICONS.glob(f"{PACKAGE}-*.png")):
            size = png.stem.rsplit("-", 1)[1]
            _write(share / "icons" / "hicolor" / f"{size}x{size}" / "apps" / f"{PACKAGE}.png", png.read_bytes())
        _write(share / "icons" / "hicolor" / "scalable" / "apps" / f"{PACKAGE}.svg",
               (ICONS / f"{PACKAGE}.svg").read_bytes())
        doc = share / "doc" / PACKAGE
        _write(doc / "copyright", copyright_text())
        _write(doc / "changelog.gz", _gz(changelog_text(version, maintainer, when).encode()))
        _write(share / "man" / "man1" / f"{PACKAGE}.1.gz", _gz(manpage_text(version).encode()))
        _write(share / "lintian" / "overrides" / PACKAGE, overrides_text())
        for path in stage.rglob("*"):
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        _write(stage / "DEBIAN" / "md5sums", md5sums_text(stage))
        control = stage / "DEBIAN" / "control"
        _write(control, control_text(version, arch, maintainer, _du_kib(stage), depends_list))
        deb = out / f"{PACKAGE}_{version}_{arch}.deb"
        cmd = ["dpkg-deb", "--root-owner-group", f"-Z{compression}", "--build", str(stage), str(deb)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise DebError(f"dpkg-deb failed: {result.stderr.strip() or result.stdout.strip()}")
        print(f"make_deb: {deb} ({deb.stat().st_size:,} B; {scan.elf_files} ELF files, needs glibc "
              f"{'.'.join(map(str, scan.glibc))}; Depends: {', '.join(depends_list)})")
        return deb
    finally:
        if keep_stage:
            print(f"make_deb: staging folder kept at {stage}")
        else:
            shutil.rmtree(stage, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=ROOT / "dist" / PACKAGE, help="the PyInstaller folder")
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="where the .deb is written")
    parser.add_argument("--version", default=None, help="package version (default: pyproject.toml's)")
    parser.add_argument("--arch", default=None, help="Debian architecture (default: dpkg --print-architecture)")
    parser.add_argument("--compression", default="xz", choices=("xz", "gzip", "zstd", "none"))
    parser.add_argument("--keep-stage", action="store_true", help="keep the staging folder (to inspect it)")
    args = parser.parse_args(argv)
    try:
        build(args.bundle, args.out, args.version, args.arch, args.compression, keep_stage=args.keep_stage)
    except DebError as exc:
        print(f"make_deb: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

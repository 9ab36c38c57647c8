"""Generate every app icon from the one master drawing, ``assets/icons/kvscope.svg``.

    python scripts/make_icons.py [--svg assets/icons/kvscope.svg] [--out assets/icons]

Writes ``kvscope-<N>.png`` for each size in ``PNG_SIZES``, ``kvscope.ico`` (Windows) and
``kvscope.icns`` (macOS). The SVG is rendered by Qt's own SVG renderer (QtSvg ships with
PySide6-Essentials), so no extra dependency is needed. ICO and ICNS are simple containers of
PNG images, written here by hand: both formats accept PNG payloads (ICO since Windows Vista,
ICNS since macOS 10.7), so each entry is the same PNG bytes as the loose file of that size.
The output is deterministic: the same SVG and Qt version give byte-identical files.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ICON_DIR = ROOT / "assets" / "icons"
MASTER_SVG = ICON_DIR / "kvscope.svg"
NAME = "kvscope"

#: Loose PNGs: the sizes desktop environments and installers ask for (hicolor theme sizes).
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
#: ICO entries. An ICO directory stores width/height in one byte each (0 means 256), so 256 is the cap.
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
#: ICNS entries: (OSType, pixel size). The "@2x" types are the Retina variants of the size half as big.
ICNS_TYPES = (
    (b"icp4", 16), (b"icp5", 32), (b"icp6", 64), (b"ic07", 128), (b"ic08", 256), (b"ic09", 512),
    (b"ic11", 32), (b"ic12", 64), (b"ic13", 256), (b"ic14", 512), (b"ic10", 1024),
)


def png_name(size: int) -> str:
    return f"{NAME}-{size}.png"


def _app():
    """Qt needs a (GUI) application object before it paints; offscreen, so no display is needed."""
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance()
    if app is None:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        app = QGuiApplication(sys.argv[:1])
    return app


def render_png(svg: Path, size: int) -> bytes:
    """The SVG rendered to a ``size`` x ``size`` RGBA PNG (transparent outside the drawing)."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRectF
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app()
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"make_icons: {svg} is not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(0)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    renderer.render(painter, QRectF(0, 0, size, size))
    painter.end()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    # Straight (not premultiplied) alpha is what PNG stores; convert explicitly so it is exact.
    if not image.convertToFormat(QImage.Format.Format_ARGB32).save(buffer, "PNG"):
        raise SystemExit(f"make_icons: Qt could not encode a {size} px PNG")
    buffer.close()
    return bytes(data.data())


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """An ICO file holding one PNG entry per size (ICONDIR + ICONDIRENTRYs + payloads)."""
    sizes = sorted(pngs)
    header = struct.pack("<HHH", 0, 1, len(sizes))  # reserved, type 1 = icon, count
    offset = len(header) + 16 * len(sizes)
    entries, payloads = b"", b""
    for size in sizes:
        data = pngs[size]
        dim = 0 if size == 256 else size
        # width, height, palette colours, reserved, colour planes, bits per pixel, bytes, offset
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset)
        payloads += data
        offset += len(data)
    return header + entries + payloads


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """An ICNS file: b"icns", total length, then (OSType, length incl. 8-byte header, PNG) per entry."""
    body = b"".join(kind + struct.pack(">I", 8 + len(pngs[size])) + pngs[size] for kind, size in ICNS_TYPES)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def make_icons(svg: Path = MASTER_SVG, out_dir: Path = ICON_DIR) -> list[Path]:
    """Render every PNG size, the ICO and the ICNS from ``svg`` into ``out_dir``; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = sorted(set(PNG_SIZES) | set(ICO_SIZES) | {size for _, size in ICNS_TYPES})
    pngs = {size: render_png(svg, size) for size in sizes}
    written: list[Path] = []
    for size in PNG_SIZES:
        path = out_dir / png_name(size)
        path.write_bytes(pngs[size])
        written.append(path)
    for path, data in ((out_dir / f"{NAME}.ico", ico_bytes({s: pngs[s] for s in ICO_SIZES})),
                       (out_dir / f"{NAME}.icns", icns_bytes(pngs))):
        path.write_bytes(data)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate KV Scope's PNG/ICO/ICNS icons from the master SVG.")
    parser.add_argument("--svg", type=Path, default=MASTER_SVG, help=f"master drawing (default {MASTER_SVG})")
    parser.add_argument("--out", type=Path, default=ICON_DIR, help=f"output folder (default {ICON_DIR})")
    args = parser.parse_args(argv)
    if not args.svg.is_file():
        print(f"make_icons: no such SVG: {args.svg}", file=sys.stderr)
        return 2
    for path in make_icons(args.svg, args.out):
        print(f"{path.stat().st_size:>8,} B  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Saving the window as a PNG, and checking that an image is not blank."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QStandardPaths
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QWidget

from kvscope.core.base.errors import UNAVAILABLE, KVScopeError
from kvscope.core.records.outputs import STDOUT, Output, OutputError, check_output_path, write_output


class ScreenshotError(KVScopeError, RuntimeError):
    """The PNG could not be written. The message is for the user."""

    category = UNAVAILABLE


def png_bytes(pixmap) -> bytes:
    """A QPixmap or QImage encoded as PNG, in memory. Raises ScreenshotError."""
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    ok = pixmap.save(buffer, "PNG")
    buffer.close()
    if not ok:
        raise ScreenshotError("cannot encode the image as PNG")
    return bytes(data)


def write_png(pixmap, path: str | Path | Output) -> Path:
    """Save ``pixmap`` as a PNG at ``path`` by the rule of ``kvscope.core.records.outputs`` and return the file written.

    ``path`` is an ``Output`` the caller checked (the command line, with its ``--force``) or a path
    the user chose in a file dialog (which asked before replacing): a folder, a device or a
    read-only file is refused, a missing folder is not created, ``-`` is standard output (returned
    as ``Path("-")``), a symbolic link is written through to its file. Atomic (temporary file,
    renamed). Raises ScreenshotError.
    """
    try:
        out = check_output_path(path, force=True)
        write_output(out, png_bytes(pixmap))
    except OutputError as exc:
        raise ScreenshotError(str(exc)) from None
    return Path(STDOUT) if out.path is None else out.path


def save_widget(widget: QWidget, path: str | Path | Output) -> Path:
    """Render ``widget`` (and its children) to ``path`` (PNG, see ``write_png``); raise ScreenshotError."""
    if not isinstance(path, Output) and str(path) != STDOUT:
        path = Path(path).expanduser()
    pixmap = widget.grab()
    if pixmap.isNull():
        raise ScreenshotError("the window has no pixels to save (is it shown?)")
    return write_png(pixmap, path)


def default_path() -> Path:
    """``~/Pictures/kvscope-YYYYmmdd-HHMMSS.png``: the Pictures folder, made if there is none yet (issue 37: Ctrl+S
    without one wrote into the current folder, wherever the app was started from: / for a packaged app), else the
    home folder when it cannot be made."""
    folder = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.PicturesLocation)
    base = Path(folder) if folder else Path.home() / "Pictures"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        base = Path.home()
    return base / time.strftime("kvscope-%Y%m%d-%H%M%S.png")


def image_stats(path: str | Path) -> tuple[int, int, float]:
    """(width, height, standard deviation of the grey levels) of an image; a blank image has ~0."""
    image = QImage(str(path))
    if image.isNull():
        raise ScreenshotError(f"{path} is not a readable image")
    grey = image.convertToFormat(QImage.Format.Format_Grayscale8)
    w, h = grey.width(), grey.height()
    stride = grey.bytesPerLine()
    data = np.frombuffer(grey.constBits(), dtype=np.uint8, count=stride * h).reshape(h, stride)[:, :w]
    return w, h, float(data.std())

"""Saving the window as a PNG, and checking that an image is not blank."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from PySide6.QtCore import QStandardPaths
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QWidget


class ScreenshotError(RuntimeError):
    """The PNG could not be written. The message is for the user."""


def save_widget(widget: QWidget, path: str | Path) -> Path:
    """Render ``widget`` (and its children) to ``path`` (PNG); raise ScreenshotError with the reason."""
    target = Path(path).expanduser()
    if target.parent and not target.parent.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ScreenshotError(f"cannot create {target.parent}: {exc.strerror or exc}") from exc
    pixmap = widget.grab()
    if pixmap.isNull():
        raise ScreenshotError("the window has no pixels to save (is it shown?)")
    if not pixmap.save(str(target), "PNG"):
        raise ScreenshotError(f"cannot write {target}")
    return target


def default_path() -> Path:
    """``~/Pictures/kvscope-YYYYmmdd-HHMMSS.png`` (or the current folder without a Pictures folder)."""
    folder = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.PicturesLocation)
    base = Path(folder) if folder and Path(folder).is_dir() else Path.cwd()
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

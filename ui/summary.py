"""A one-page summary image for slides: the plots and the key numbers on one 16:9 PNG (the KV plot across the top,
with the quality strip under it and the frontier beside it where the run had the quality probe)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QRect, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QImage, QPainter, QPen

from kvscope.ui.screenshot import ScreenshotError, write_png
from kvscope.ui.theme import Theme


def render_summary(path: str | Path, theme: Theme, title: str, subtitle: str, numbers: list[tuple[str, str, str]],
                   plots: list, size: tuple[int, int] = (1920, 1080)) -> Path:
    """Paint ``title``, ``subtitle``, the ``numbers`` (name, value, note) and the ``plots`` (widgets,
    grabbed as they are on screen) onto one ``size`` PNG at ``path``. Raises ScreenshotError.

    The first plot goes across the top, the others side by side below it; a panel whose ``key`` is "quality" (the
    strip) goes under the first, one whose key is "frontier" beside it, a third of the width."""
    width, height = size
    image = QImage(width, height, QImage.Format.Format_RGB32)
    image.fill(QColor(theme.background))
    painter = QPainter(image)
    try:
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
        margin = 36
        # ---- title
        font = QFont()
        font.setPixelSize(40)
        font.setBold(True)
        painter.setFont(font)
        painter.setPen(QColor(theme.text))
        painter.drawText(QRect(margin, 20, width - 2 * margin, 54), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         title)
        font.setPixelSize(22)
        font.setBold(False)
        painter.setFont(font)
        painter.setPen(QColor(theme.muted))
        painter.drawText(QRect(margin, 74, width - 2 * margin, 32), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         subtitle)
        top = 120
        # ---- numbers, a column on the right
        col_w = 420
        x0 = width - margin - col_w
        y = top
        tile_h = max(min((height - top - margin) // max(len(numbers), 1) - 12, 140), 70)
        for name, value, note in numbers:
            rect = QRectF(x0, y, col_w, tile_h)
            painter.setPen(QPen(QColor(theme.border), 2))
            painter.setBrush(QColor(theme.panel))
            painter.drawRoundedRect(rect, 10, 10)
            font.setPixelSize(20)
            font.setBold(False)
            painter.setFont(font)
            painter.setPen(QColor(theme.muted))
            painter.drawText(QRect(x0 + 18, y + 8, col_w - 36, 28), Qt.AlignmentFlag.AlignLeft, name)
            font.setPixelSize(min(44, tile_h // 2))
            font.setBold(True)
            painter.setFont(font)
            painter.setPen(QColor(theme.text))
            painter.drawText(QRect(x0 + 18, y + 34, col_w - 36, tile_h // 2 + 4), Qt.AlignmentFlag.AlignLeft, value)
            if note:
                font.setPixelSize(17)
                font.setBold(False)
                painter.setFont(font)
                painter.setPen(QColor(theme.muted))
                painter.drawText(QRect(x0 + 18, y + tile_h - 28, col_w - 36, 24), Qt.AlignmentFlag.AlignLeft, note)
            y += tile_h + 12
        # ---- plots: the first across the top, the others side by side below it
        area = QRect(margin, top, x0 - 2 * margin, height - top - margin)
        strip = [w for w in plots if getattr(w, "key", "") == "quality"]
        beside = [w for w in plots if getattr(w, "key", "") == "frontier"]
        row = [w for w in plots if w not in strip and w not in beside]
        grabs = [w.grab() for w in row + strip + beside]
        if any(g.isNull() for g in grabs):
            raise ScreenshotError("the plots have no pixels to save (is the window shown?)")
        if grabs:
            first_h = int(area.height() * (0.6 if strip or beside else 0.55))
            first_w = area.width() - (area.width() * 35 // 100 + 16 if beside else 0)
            strip_h = (first_h - 8) * 2 // 7 if strip else 0
            rects = [QRect(area.left(), area.top(), first_w, first_h - 8 - (strip_h + 8 if strip else 0))]
            rest = row[1:]
            if rest:
                w_each = (area.width() - 16 * (len(rest) - 1)) // len(rest)
                for i in range(len(rest)):
                    rects.append(QRect(area.left() + i * (w_each + 16), area.top() + first_h + 8, w_each,
                                       area.height() - first_h - 8))
            if strip:
                rects.append(QRect(area.left(), area.top() + first_h - 8 - strip_h, first_w, strip_h))
            if beside:
                rects.append(QRect(area.left() + first_w + 16, area.top(), area.width() - first_w - 16, first_h - 8))
            for pixmap, rect in zip(grabs, rects):
                # Keep the aspect (stretched text reads badly on a slide); centre in the slot.
                scaled = pixmap.scaled(rect.size(), Qt.AspectRatioMode.KeepAspectRatio,
                                       Qt.TransformationMode.SmoothTransformation)
                x = rect.left() + (rect.width() - scaled.width()) // 2
                y_top = rect.top() + (rect.height() - scaled.height()) // 2
                painter.drawPixmap(x, y_top, scaled)
                painter.setPen(QPen(QColor(theme.border), 1))
                painter.setBrush(Qt.BrushStyle.NoBrush)
                painter.drawRect(QRect(x, y_top, scaled.width(), scaled.height()))
    finally:
        painter.end()
    # The file dialog asked before replacing; the rest of the rule (no folders created, no devices,
    # atomic) is kvscope.core.records.outputs'.
    return write_png(image, Path(path).expanduser())

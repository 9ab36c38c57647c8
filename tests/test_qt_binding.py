"""Guard for the pinned Qt binding: PySide6-Essentials 6.12.0 on Python 3.11 returns None from void
methods without taking a reference, so a window painting at 30 Hz aborts within seconds
("Fatal Python error: none_dealloc"). 6.11.3 does not; this test fails if an upgrade brings it back."""

from __future__ import annotations

import sys

from PySide6.QtGui import QImage, QPainter, QPen


def test_void_and_bool_calls_keep_singleton_refcounts():
    pen = QPen()
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    before = (sys.getrefcount(None), sys.getrefcount(True), sys.getrefcount(False))
    for _ in range(2000):
        pen.setWidth(2)
        pen.isCosmetic()
        painter = QPainter(image)
        painter.drawLine(0, 0, 7, 7)
        painter.end()
    after = (sys.getrefcount(None), sys.getrefcount(True), sys.getrefcount(False))
    assert all(abs(a - b) < 100 for a, b in zip(after, before)), (before, after)

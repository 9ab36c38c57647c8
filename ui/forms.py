"""A titled form: the one way the controls panel and the calculator lay out labelled rows."""

from __future__ import annotations

from PySide6.QtWidgets import QFormLayout, QGroupBox, QLayout, QWidget


def form_box(title: str, rows: list[tuple[str, QWidget | QLayout] | QWidget]) -> QGroupBox:
    """A group box titled ``title`` with one row per ``(label, widget or layout)``; a bare widget
    spans both columns."""
    box = QGroupBox(title)
    form = QFormLayout(box)
    for row in rows:
        if isinstance(row, tuple):
            form.addRow(*row)
        else:
            form.addRow(row)
    return box

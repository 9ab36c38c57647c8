"""Issue 25, item 4: every screen from 1024x768 up, normal and presenter mode (offscreen Qt, the real window).

The window's minimum size fits 1024x768; at each size the window is that size, every visible widget of
the live tab lies inside it, and the memory plot keeps a readable width (its time axis and legend were
cut at 1280x720)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QAbstractScrollArea, QWidget

from kvscope.ui.main_window import MainWindow
from tests.synthetic import synthetic_samples

SIZES = [(1024, 768), (1280, 720), (1366, 768), (1920, 1080)]


@pytest.mark.parametrize("presenter", [False, True], ids=["normal", "presenter"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_the_window_fits_and_nothing_lies_outside_it(qtbot, settings, size, presenter):
    w = MainWindow(settings=settings)
    qtbot.addWidget(w)
    w.show()
    if presenter:
        w.set_presenter(True, fullscreen=False)
    w.resize(*size)
    qtbot.wait(50)
    w.add_samples(synthetic_samples(300, switches={80: "gqa:2", 200: "window:256"}))
    w._redraw()
    qtbot.wait(50)
    hint = w.minimumSizeHint()
    assert hint.width() <= 1024 and hint.height() <= 768, (hint.width(), hint.height())
    assert (w.width(), w.height()) == size
    inside = QRect(QPoint(0, 0), w.size())
    outside = []
    for child in w.tabs.currentWidget().findChildren(QWidget):
        if not child.isVisibleTo(w) or child.width() <= 0 or child.height() <= 0 or child.window() is not w:
            continue
        top_left = child.mapTo(w, QPoint(0, 0))
        rect = QRect(top_left, child.size())
        # A widget inside a scroll area may lie beyond the window: its viewport clips it (a scroll bar says so).
        scrolled = any(isinstance(p, QAbstractScrollArea) for p in _parents(child, w))
        if not scrolled and not inside.contains(rect):
            outside.append((type(child).__name__, child.objectName(), rect.getRect()))
    assert not outside, outside[:5]
    # The plots: each readable, and the memory plot's time axis and legend are not cut.
    for view, least in ((w.plots.kv_widget, 450), (w.plots.mem_widget, 400), (w.plots.cmp_widget, 250)):
        assert view.width() >= least and view.height() >= 110, (type(view).__name__, view.width(), view.height())
    w.close()


def _parents(widget, top):
    p = widget.parentWidget()
    while p is not None and p is not top:
        yield p
        p = p.parentWidget()


@pytest.mark.parametrize("size", [(1024, 768), (1280, 720), (1920, 1080)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_switch_marker_labels_never_print_over_each_other_or_the_slope(qtbot, settings, size):
    """Several switches at one token and at neighbouring tokens (the issue: one unreadable block)."""
    w = MainWindow(settings=settings)
    qtbot.addWidget(w)
    w.resize(*size)
    w.show()
    qtbot.wait(50)
    switches = {80: "gqa:2", 81: "mqa", 82: "mla", 83: "window:256", 84: "mha", 150: "gqa:4", 152: "mqa", 290: "mha"}
    w.add_samples(synthetic_samples(300, switches=switches))
    w.plots.redraw(settle=True)
    qtbot.wait(50)
    w.plots.redraw(settle=True)
    labels = [m.lines[0].label for m in w.plots.markers]
    shown = [label for label in labels if label.isVisible()]
    assert len(shown) >= 3
    rects = [label.sceneBoundingRect() for label in shown]
    for i, a in enumerate(rects):
        for b in rects[i + 1:]:
            assert not a.intersects(b), (a.getRect(), b.getRect())
        slope = w.plots.slope_label
        if slope.isVisible() and slope.sceneBoundingRect().width() > 0:
            assert not a.intersects(slope.sceneBoundingRect())
    hidden = [m.label for m in w.plots.markers if not m.lines[0].label.isVisible()]
    tips = "\n".join(label.toolTip() for label in shown)
    assert all(name in tips for name in hidden)  # a label without room is named in its neighbour's tooltip
    w.close()


def test_the_calculator_fits_1024_px_without_a_sideways_scroll(qtbot, settings):
    from kvscope.core.model.sources import load_spec

    w = MainWindow(settings=settings)
    qtbot.addWidget(w)
    w.resize(1024, 768)
    w.show()
    w.tabs.setCurrentIndex(1)
    w.calculator.set_spec(load_spec("embedded"), source="embedded")
    w.calculator.memory_combo.setCurrentText("24 GiB")
    w.calculator.recompute()
    qtbot.wait(50)
    assert "1,635,930" in w.calculator.fits_label.text() or w.calculator.state.max_fit > 4096
    scroll = w.tabs.currentWidget()
    assert not scroll.horizontalScrollBar().isVisible(), (w.calculator.minimumSizeHint().width(), scroll.viewport().width())
    w.close()

"""The frontier's labels at 1024x768 in presenter mode (issue 34, item 5): every setting the run visited is a point
with a label that names it, readable (no label over another, over a dot or over a leader line, all inside the data
area), however the points crowd. Real Qt (offscreen), the real window; the Samples are made here, with the figures a
probed run of the embedded model gave (mha, mqa, mla, window:16, gqa:2, mqa:mean: two of them left unlabelled before).
"""

from __future__ import annotations

import math

import pyqtgraph as pg
import pytest
from PySide6.QtCore import QRectF

from kvscope.core.base.sample import Sample
from kvscope.ui.main_window import MainWindow
from tests.synthetic import synthetic_samples

#: (attention, KV bytes per token, top-1 %, KL), about what the embedded model's probed run of 240 tokens showed
#: (main.py --screenshot --presenter --quality-probe with a switch every 40 tokens).
EMBEDDED = [("mha", 8192, 100, 0.0), ("mqa", 1024, 85, 0.3), ("mla", 4096, 100, 0.001),
            ("window:16", 1300, 62, 1.1), ("gqa:2", 2048, 95, 0.08), ("mqa:mean", 1024, 77, 0.35)]
#: A crowded run: seven settings, three of them at one KV size and close in quality.
CROWDED = EMBEDDED + [("mla:64", 1024, 80, 0.3)]


def _probed(settings: list[tuple[str, int, int, float]], tokens: int = 40) -> list[Sample]:
    """``tokens`` judged decode Samples per setting, in order: held bytes growing at its bytes per token, top-1
    agreeing at its rate (spread over the tokens), KL its figure."""
    template = synthetic_samples(1)[-1]
    out, token = [], 16
    for name, per_token, top1, kl in settings:
        for i in range(tokens):
            token += 1
            agreed = int((i * top1) // 100 != ((i + 1) * top1) // 100)
            held = per_token * (token + 1)
            out.append(template.replace(token=token, context_tokens=token + 1, attention=name, cache="dynamic",
                                        kv_bytes_held=held, kv_bytes_reserved=held, quality_top1=agreed,
                                        quality_kl=kl, time_s=token * 0.05))
    return out


def _window(qtbot, settings, samples):
    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    w.show()
    w.set_presenter(True, fullscreen=False)
    w.resize(1024, 768)
    qtbot.wait(50)
    w.add_samples(samples)
    for _ in range(3):
        w.plots.redraw(settle=True)
        qtbot.wait(30)
    return w


def _segment_hits(line, rect: QRectF) -> bool:
    (x0, y0), (x1, y1) = line
    n = max(2, int(math.hypot(x1 - x0, y1 - y0)))
    return any(rect.contains(x0 + (x1 - x0) * i / n, y0 + (y1 - y0) * i / n) for i in range(1, n))


@pytest.mark.parametrize("runs", [EMBEDDED, CROWDED], ids=["six", "seven-crowded"])
def test_every_setting_is_a_labelled_point_at_1024_presenter(qtbot, settings, runs):
    w = _window(qtbot, settings, _probed(runs))
    frontier = w.plots.frontier
    assert frontier.isVisible() and w.theme.presenter
    view = frontier.plot.getViewBox()
    assert view.width() < 320  # the frontier is narrow here: the case the labels must survive
    assert [label for label, *_ in frontier.shown_points()] == [name for name, *_ in runs]
    assert frontier.unlabelled == []
    # Each point's name is in exactly one shown label (its own, or its group's), whole or elided with a tooltip
    # that says it whole.
    shown = [item for item in frontier.labels.values() if item.isVisible()]
    named = {}
    for item in shown:
        lines = item.textItem.toPlainText().split("\n")
        if item.joined:  # a group's names on one line
            lines = lines[0].split(", ")
        assert len(lines) >= len(item.names)
        for name, line in zip(item.names, lines):
            assert line == name or (line.endswith("\u2026") and name.startswith(line[:-1])), (name, line)
            assert name in item.toolTip()
            named[name] = item
    assert sorted(named) == sorted(name for name, *_ in runs)
    # Readable: inside the data area, over no other label and no dot, and no leader line runs under a label.
    area = view.sceneBoundingRect()
    boxes = {id(item): item.mapRectToScene(item.boundingRect()) for item in shown}
    radius = frontier.scatter.opts["size"] / 2
    dots = [view.mapViewToScene(pg.Point(math.log2(x), y))
            for _, x, y, _ in frontier.shown_points()]
    leaders = []
    for key, leader in frontier.leaders.items():
        if leader.isVisible():
            xs, ys = leader.getData()
            a, b = view.mapViewToScene(pg.Point(xs[0], ys[0])), \
                view.mapViewToScene(pg.Point(xs[1], ys[1]))
            leaders.append((frontier.labels[key], ((a.x(), a.y()), (b.x(), b.y()))))
    for item in shown:
        box = boxes[id(item)]
        assert area.contains(box), (item.names, box, area)
        for other in shown:
            if other is not item:
                assert not box.intersects(boxes[id(other)]), (item.names, other.names)
        for dot in dots:
            assert not box.intersects(QRectF(dot.x() - radius + 2, dot.y() - radius + 2, 2 * radius - 4,
                                             2 * radius - 4)), (item.names, dot)
        for owner, line in leaders:
            if owner is not item:
                assert not _segment_hits(line, box.adjusted(1, 1, -1, -1)), (owner.names, item.names)
    # Readable type: no name under 7 pt.
    for item in shown:
        assert "font-size:6pt" not in item.textItem.toHtml() and "font-size:5pt" not in item.textItem.toHtml()
    w.shutdown()


def test_points_on_one_dot_share_one_label(qtbot, settings):
    """Two settings that cost the same and keep the same (mqa and mqa:mean, both 1 KiB and 80 %): one dot, one
    label naming both."""
    runs = [("mha", 8192, 100, 0.0), ("mqa", 1024, 80, 0.3), ("mqa:mean", 1024, 80, 0.4)]
    w = _window(qtbot, settings, _probed(runs))
    frontier = w.plots.frontier
    shown = [item for item in frontier.labels.values() if item.isVisible()]
    assert frontier.unlabelled == []
    both = [item for item in shown if len(item.names) == 2]
    assert len(both) == 1 and both[0].names == ["mqa", "mqa:mean"], [item.names for item in shown]
    assert both[0].textItem.toPlainText().split("\n")[:2] == ["mqa", "mqa:mean"]
    assert len(shown) == 2
    w.shutdown()


def test_labels_follow_the_points_on_a_slow_clock_and_settle_on_the_last(qtbot, settings):
    """A placement costs tens of ms: while tokens come it runs at most every RELABEL_S, and once they stop the last
    positions are placed too (a timer), every label still clear of the others."""
    runs = EMBEDDED
    samples = _probed(runs)
    w = _window(qtbot, settings, samples)
    frontier = w.plots.frontier
    view = frontier.plot.getViewBox()
    placed_at = frontier._placed_at
    last = samples[-1]
    more = [last.replace(token=last.token + i, context_tokens=last.context_tokens + i, quality_top1=0,
                         kv_bytes_held=last.kv_bytes_held + 1024 * i, kv_bytes_reserved=last.kv_bytes_held + 1024 * i,
                         time_s=last.time_s + 0.05 * i) for i in range(1, 25)]
    w.add_samples(more)  # the last setting's top-1 falls from 75 % to 47 %: its dot moves down
    w.plots.redraw(settle=True)
    assert frontier._placed_geometry != frontier._geometry(view) or frontier._placed_at > placed_at
    qtbot.waitUntil(lambda: frontier._placed_geometry == frontier._geometry(view),
                    timeout=int(4000 * frontier.RELABEL_S))
    assert frontier.unlabelled == []
    shown = [item for item in frontier.labels.values() if item.isVisible()]
    boxes = [item.mapRectToScene(item.boundingRect()) for item in shown]
    assert all(not a.intersects(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    w.shutdown()

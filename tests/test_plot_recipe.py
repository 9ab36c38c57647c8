"""docs/extending.md's "a new plot" recipe, done: a plot is one module (``tests/tiny_plot.py``) and one line in
``PANELS``. Added so, it takes its columns from every Sample, draws the shipped demo recording (recorded from the
embedded model) through the real window, marks the switches, is laid out beside the bottom row's plots at 1600x1000
and waits off screen below 1400 px with nothing cut, and is exported by File > Export plots and drawn in the summary
image either way."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvscope.core.base.sample import PHASE_EVENT
from kvscope.core.records.recording import iter_samples
from kvscope.ui.file_actions import demo_recording_path
from kvscope.ui.plots import live
from kvscope.ui.screenshot import image_stats
from tests.test_stage_screens import _clips
from tests.tiny_plot import KVPerTokenPlot, per_token

ENTRY = "tests.tiny_plot:KVPerTokenPlot"


@pytest.fixture
def with_plot(monkeypatch):
    monkeypatch.setattr(live, "PANELS", live.PANELS + (ENTRY,))  # the recipe's one line


def test_a_plot_is_its_module_and_one_line(qtbot, settings, tmp_path, with_plot):
    from kvscope.ui.main_window import MainWindow

    assert ENTRY not in live.PANELS[:-1]  # nothing else in the tree names it
    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    w.resize(1600, 1000)
    w.show()
    qtbot.waitExposed(w)
    with qtbot.waitSignal(w.run_finished, timeout=60_000):
        assert w.open_recording(str(demo_recording_path()), speed=math.inf)
    w._redraw()
    panel = w.plots.panel("kv_per_token")
    assert isinstance(panel, KVPerTokenPlot) and panel.isVisible()
    bottom = w.plots.splitter.widget(1)
    assert [bottom.widget(i).key for i in range(bottom.count())] == ["memory", "compare", "kv_per_token"]

    # Its columns, from every token Sample of the recording, drawn (decimation keeps every bin's min and max).
    samples = [s for s in iter_samples(demo_recording_path()) if s.phase != PHASE_EVENT]
    switches = [s for s in iter_samples(demo_recording_path()) if s.event in ("switch", "error", "oom", "budget")]
    want = np.array([per_token(s.kv_bytes_held, s.context_tokens) for s in samples])
    x, y = w.plots.curve_data("kv_per_token_observed")
    assert len(x) and w.plots.curve_visible("kv_per_token_observed")
    assert np.nanmax(y) == pytest.approx(np.nanmax(want)) and np.nanmin(y) == pytest.approx(np.nanmin(want))
    assert np.nanmax(want) > 1.5 * np.nanmin(want)  # the switches moved it: the figure is not flat
    predicted = w.plots.curve_data("kv_per_token_predicted")[1]
    assert np.nanmax(predicted) == pytest.approx(np.nanmax([per_token(s.kv_bytes_predicted, s.context_tokens)
                                                            for s in samples]))
    # The switches marked on it, as on every panel.
    assert len(switches) >= 4 and len(w.plots.markers) == len(switches)
    ours = [line for m in w.plots.markers for line in m.lines if line.scene() is panel.scene()]
    assert len(ours) == len(switches)
    assert not _clips(w), _clips(w)

    # File > Export plots writes it, and the summary image draws it.
    written = w.export_plots(str(tmp_path / "plots"))
    target = tmp_path / "plots-kv_per_token.png"
    assert target in written
    width, height, spread = image_stats(target)
    assert width >= 400 and height > 0 and spread > 1.0, (width, height, spread)
    assert "kv_per_token" in [p.key for p in w.plots.summary_panels()]
    assert w.export_summary(str(tmp_path / "summary.png")) is not None and (tmp_path / "summary.png").stat().st_size

    # Below 1400 px (1024x768: the bottom row stacks; 1280x720: side by side) the row keeps the memory and total plots
    # and this one waits off screen: nothing is cut, and File > Export and the summary image still draw it.
    from PySide6.QtCore import Qt

    for size, orientation in (((1280, 720), Qt.Orientation.Horizontal), ((1024, 768), Qt.Orientation.Vertical)):
        w.resize(*size)
        qtbot.waitUntil(lambda: w.width() == size[0])
        qtbot.wait(50)
        w._redraw()
        assert bottom.orientation() == orientation and panel.isHidden(), size
        assert w.plots.panel("memory").isVisible() and w.plots.panel("compare").isVisible()
        assert not _clips(w), (size, _clips(w))
    written = w.export_plots(str(tmp_path / "small"))
    assert tmp_path / "small-kv_per_token.png" in written
    width, height, spread = image_stats(tmp_path / "small-kv_per_token.png")
    assert width >= 400 and spread > 1.0, (width, height, spread)
    assert "kv_per_token" in [p.key for p in w.plots.summary_panels()]
    # Wide again, it is back, drawn with the others.
    w.resize(1600, 1000)
    qtbot.waitUntil(lambda: w.width() == 1600)
    qtbot.wait(50)
    w._redraw()
    assert panel.isVisible() and not _clips(w), _clips(w)
    assert np.nanmax(w.plots.curve_data("kv_per_token_observed")[1]) == pytest.approx(np.nanmax(want))
    w.close()


@pytest.mark.parametrize("entry", ["tests.tiny_plot:per_token", "tests.tiny_plot:Nothing", "tests.no_such_module:X",
                                   "KVPerTokenPlot", "kvscope.ui.plots.kv:KVPlot"])
def test_a_wrong_entry_is_one_line(entry):
    """An entry that is not a PlotPanel's "module:class", or a second plot with a key already taken, is refused in one
    line that names it."""
    entries = live.PANELS + (entry,)
    with pytest.raises(ValueError) as caught:
        live.panel_classes(entries)
    message = str(caught.value)
    assert entry in message and "\n" not in message
    assert live.panel_classes() == live.panel_classes(live.PANELS)  # the tree's own list resolves

"""The live plots: samples reach the curves, switches become markers, n/a stays a gap, buffers wrap."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPointF, QRectF

from kvscope.core.base.sample import Sample
from kvscope.core.live.compare import error_percent
from kvscope.ui.axes import BytesAxis, format_count, format_slope
from kvscope.ui.plots import LivePlots
from kvscope.ui.ringbuffer import RingBuffer
from tests.synthetic import synthetic_samples


@pytest.fixture
def plots(qtbot):
    widget = LivePlots(capacity=1000)
    qtbot.addWidget(widget)
    widget.resize(1000, 700)
    widget.show()
    return widget


def test_samples_reach_the_kv_curves(plots):
    samples = synthetic_samples(50, prompt_tokens=10)
    plots.add_samples(samples)
    assert plots.redraw() > 0
    x, y = plots.curve_data("kv_observed")
    tokens = [s for s in samples if not s.is_event]
    assert len(x) == len(tokens) == 51  # the prefill and 50 decode tokens
    assert x[0] == 9 and x[-1] == 59
    assert y[-1] == tokens[-1].kv_bytes_reserved
    _, predicted = plots.curve_data("kv_predicted")
    np.testing.assert_array_equal(predicted, [s.kv_bytes_predicted for s in tokens])
    assert plots.slope_bytes_per_token == pytest.approx(8 * 1024)  # 2 x 4 layers x 8 heads x 32 x 4 B


def test_a_switch_adds_a_labelled_marker_and_a_step(plots):
    plots.add_samples(synthetic_samples(40, prompt_tokens=8, switches={20: "gqa:2"}))
    plots.redraw()
    assert len(plots.markers) == 1
    marker = plots.markers[0]
    assert marker.label == "gqa:2"
    assert marker.token == 19
    assert marker.lines[0].label.format == "gqa:2"
    x, y = plots.curve_data("kv_observed")
    before, after = y[x == 19][0], y[x == 20][0]
    assert after < before / 3  # 8 -> 2 KV heads: the cache shrinks by 4x at the switch
    # After the switch the slope is the GQA one, not the step.
    assert plots.slope_bytes_per_token == pytest.approx(2 * 1024)


def test_not_available_is_a_hidden_curve_and_a_label_never_zero(plots):
    plots.add_samples(synthetic_samples(20, gpu=False))
    plots.redraw()
    assert plots.host_only is True
    assert not plots.curve_visible("device_used")
    assert not plots.curve_visible("allocated")
    assert plots.curve_visible("process_rss")
    assert "no GPU" in plots.memory.title_label.text  # the panel's header, over the plot item
    # Observed total falls back to measured weights + KV, compared with predicted weights + KV.
    _, err = plots.curve_data("error_total")
    assert np.all(err == 0.0)


def test_gpu_samples_show_device_curves_and_capacity(plots):
    plots.add_samples(synthetic_samples(20, gpu=True))
    plots.redraw()
    assert plots.host_only is False
    assert plots.curve_visible("device_used") and plots.curve_visible("allocated")
    assert not plots.curve_visible("process_rss")
    assert plots.capacity_line.isVisible() and plots.capacity_line.value() == 141 * 1024**3


def test_reset_forgets_curves_and_markers(plots):
    plots.add_samples(synthetic_samples(30, switches={10: "mqa"}))
    plots.redraw()
    plots.reset()
    plots.redraw()
    assert plots.markers == [] and len(plots.tokens) == 0
    assert not plots.curve_visible("kv_observed")


def test_ring_buffer_keeps_the_newest_rows_in_order():
    buf = RingBuffer(5, ("x", "y"))
    buf.extend([{"x": i, "y": None if i == 6 else 10 * i} for i in range(8)])
    np.testing.assert_array_equal(buf.column("x"), [3, 4, 5, 6, 7])
    y = buf.column("y")
    assert np.isnan(y[3]) and y[4] == 70
    assert buf.last("y") == 70.0
    buf.extend_arrays({"x": np.arange(100, 103), "y": np.arange(3)})
    np.testing.assert_array_equal(buf.column("x"), [6, 7, 100, 101, 102])
    with pytest.raises(ValueError):
        RingBuffer(0, ("x",))


def test_bytes_axis_labels_in_binary_units(qtbot):
    axis = BytesAxis(orientation="left")
    spacing = axis.tickSpacing(0, 40 * 1024**3, 400)
    assert spacing[0][0] == 10 * 1024**3
    assert axis.tickStrings([0, 10 * 1024**3, 20 * 1024**3], 1, 10 * 1024**3) == ["0", "10 GiB", "20 GiB"]
    assert axis.tickStrings([512 * 1024, 768 * 1024], 1, 256 * 1024) == ["512 KiB", "768 KiB"]


@pytest.mark.parametrize("top, size", [(s * 1024**u, px) for u in (0, 1, 2, 3, 4) for s in (0.3, 1, 2.2, 9, 11, 37, 700)
                                        for px in (90, 170, 260, 400, 640)])
def test_every_byte_tick_label_is_exactly_its_value(top, size):
    """Issue 12, item 3: whatever step the axis picks (1, 2, 2.5, 5 x 10^k), each label reads back as
    the tick's value in its unit (2.5 steps once printed 2/5/8 MiB), and labels are all different."""
    axis = BytesAxis(orientation="left")
    (major, _), _minor = axis.tickSpacing(0, top, size)
    values = [major * k for k in range(1, int(top / major) + 1)]
    labels = axis.tickStrings(values, 1, major)
    assert len(set(labels)) == len(labels)
    for value, label in zip(values, labels):
        number, unit = label.split(" ")
        scale = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)
        assert float(number) * scale == pytest.approx(value, rel=1e-9), (label, value / scale)


def test_error_percent_none_when_not_available():
    assert error_percent(None, 10) is None
    assert error_percent(10, 0) is None
    assert error_percent(11, 10) == pytest.approx(10.0)


def test_event_sample_shape_is_accepted(plots):
    """A 'refused' event (a switch the engine declined) is not a marker and adds no point."""
    base = synthetic_samples(3)[-1]
    refused = Sample(**{**base.to_dict(), "phase": "event", "event": "refused", "text": "gqa:3 refused"})
    plots.add_samples([refused])
    plots.redraw()
    assert plots.markers == [] and len(plots.tokens) == 0


@pytest.mark.parametrize("style", ["solid", "wide", "dash", "fill", "gaps"])
def test_device_curve_draws_what_pyqtgraph_draws(qtbot, style):
    """DeviceCurve strokes in device pixels for speed; the picture must be pyqtgraph's own."""
    import pyqtgraph as pg
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage

    from kvscope.ui.curves import DeviceCurve

    rng = np.random.default_rng(3)
    x = np.arange(600.0) * 200.0  # plot-like scales: tokens and bytes, far from pixels
    y = 1e8 + np.cumsum(rng.normal(0, 1e6, 600))
    pen = {"solid": pg.mkPen("#ff8000", width=2), "wide": pg.mkPen("#ff8000", width=4.4),
           "dash": pg.mkPen("#ff8000", width=2, style=Qt.PenStyle.DashLine)}.get(style, pg.mkPen("#ff8000", width=2))
    if style == "gaps":
        y[100:300] = np.nan

    def render(cls) -> QImage:
        widget = pg.PlotWidget()
        qtbot.addWidget(widget)
        widget.resize(500, 300)
        widget.setBackground("k")
        item = cls(pen=pen)
        if style == "fill":
            item.setFillLevel(0)
            item.setBrush(pg.mkBrush(0, 128, 255, 90))
        item.setData(x, y, connect="finite")
        widget.addItem(item)
        widget.setXRange(0, 130_000, padding=0)
        widget.setYRange(0 if style == "fill" else np.nanmin(y), np.nanmax(y) * 1.05, padding=0)
        widget.show()
        return widget.grab().toImage().convertToFormat(QImage.Format.Format_RGB32)

    ours, theirs = render(DeviceCurve), render(pg.PlotCurveItem)
    a = np.frombuffer(ours.constBits(), np.uint8).reshape(ours.height(), ours.width(), 4)[..., :3].astype(int)
    b = np.frombuffer(theirs.constBits(), np.uint8).reshape(theirs.height(), theirs.width(), 4)[..., :3].astype(int)
    background = b[2, -3]  # a corner pixel
    inked = (np.abs(a - background).max(axis=2) > 40) | (np.abs(b - background).max(axis=2) > 40)
    assert inked.sum() > 1000  # the curve (and fill) is there
    differ = (np.abs(a - b).max(axis=2) > 40).sum() / inked.sum()
    assert differ < 0.05, f"{differ:.1%} of the drawn pixels differ"


def test_slopes_and_counts_read_as_numbers():
    """Issue 12, item 6: no '+-19.9 KiB / token', no '0.00 B parameters' for a 3.4 M model."""
    assert format_slope(131072) == "+128.0 KiB / token"
    assert format_slope(-20378) == "\u221219.9 KiB / token"
    assert format_slope(0) == "+0 B / token"
    assert format_count(3_426_560) == "3.43 M" and format_count(8_030_261_248) == "8.03 B"
    assert format_count(671_026_404_352) == "671.03 B" and format_count(950) == "950"


def test_spike_labels_never_overlap_and_the_largest_keep_theirs(plots, qtbot):
    """Issue 12, item 5: 60 spikes within 6 s (a switch storm) on a 1000 px plot: every triangle stays,
    the labels shown do not overlap on screen, the largest spike's label is among them, and zooming
    in on a second shows labels that were hidden."""
    samples = synthetic_samples(200, tokens_per_s=20.0)
    plots.add_samples(samples)
    peak = max(s.process_rss for s in samples)  # a spike's triangle sits on the memory curve's peak
    marks = [plots.add_spike(1.0 + k * 0.1, peak, (k % 7 + 1) * 2**20, "test") for k in range(60)]
    plots.redraw(settle=True)  # the layout settles (legend rows, axis widths), then the ranges fit it
    qtbot.wait(10)
    plots.redraw(settle=True)
    shown = [m for m in marks if m.items[2].isVisible()]
    assert 2 <= len(shown) < 60 and all(m.items[1].isVisible() for m in marks)
    assert any(m.rise == max(x.rise for x in marks) for m in shown)  # the largest keep their labels
    rects = sorted((m.items[2].sceneBoundingRect() for m in shown), key=lambda r: r.left())
    for a, b in zip(rects, rects[1:]):
        assert a.right() <= b.left() + 1, (a, b)
    # No label runs through a triangle: each stands above its own, and clear of the others (issue 25).
    view = plots.mem_plot.getViewBox()
    for m in shown:
        text = m.items[2].sceneBoundingRect().adjusted(4, 4, -4, -4)
        for other in marks:
            at = view.mapViewToScene(QPointF(other.time_s, other.after))
            assert not text.intersects(QRectF(at.x() - 6, at.y() - 6, 12, 12)), (m.time_s, other.time_s)
    plots.mem_plot.getViewBox().setXRange(2.0, 3.0, padding=0)
    zoomed = plots.declutter_spike_labels()
    assert zoomed > sum(1 for m in shown if 2.0 <= m.time_s <= 3.0)


def test_the_kv_cache_on_the_memory_plot_has_its_own_scale_next_to_hundreds_of_mib(plots, qtbot):
    """CPU demo: ~400 MiB of process RSS and a KV cache of a few hundred KiB. On one axis the KV area
    would be a hairline at the bottom; on its own (right) axis it fills most of the height."""
    samples = synthetic_samples(200, prompt_tokens=10)
    plots.add_samples(samples)
    plots.redraw()
    qtbot.wait(50)
    kv_top = max(s.kv_bytes_reserved for s in samples if not s.is_event)
    rss_top = max(s.process_rss for s in samples if not s.is_event)
    assert rss_top > 200 * kv_top  # the case the right axis is for
    lo, hi = plots.kv_view.viewRange()[1]
    assert lo == 0 and kv_top <= hi <= 2 * kv_top  # the KV fills at least half its scale
    mem_lo, mem_hi = plots.mem_plot.getViewBox().viewRange()[1]
    assert mem_hi >= rss_top  # the left axis still holds the process memory
    assert plots.curve_visible("kv_share")
    assert plots._curves["kv_share"].item.getViewBox() is plots.kv_view
    # The right axis draws the KV scale; the two views cover the same rectangle and time range.
    assert plots.mem_plot.getAxis("right").linkedView() is plots.kv_view
    a, b = plots.kv_view.sceneBoundingRect(), plots.mem_plot.getViewBox().sceneBoundingRect()
    assert all(abs(u - v) <= 1.0 for u, v in zip(a.getRect(), b.getRect()))  # (within a pen's width)
    assert plots.kv_view.viewRange()[0] == pytest.approx(plots.mem_plot.getViewBox().viewRange()[0], rel=0.01)


def test_the_slope_label_names_a_quantized_residual_flush_instead_of_a_negative_slope(plots):
    samples = [s.replace(cache="quantized:4") for s in synthetic_samples(40, prompt_tokens=10)]
    # The flush at the last token: the cache drops to a third.
    last = samples[-1]
    samples[-1] = last.replace(kv_bytes_held=last.kv_bytes_reserved // 3, kv_bytes_reserved=last.kv_bytes_reserved // 3)
    plots.add_samples(samples)
    plots.redraw()
    assert plots.slope_bytes_per_token < 0
    assert "residual quantized" in plots.slope_label.text
    assert "-" not in plots.slope_label.text and "\u2212" not in plots.slope_label.text

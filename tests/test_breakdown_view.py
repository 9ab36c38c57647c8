"""The stacked view of where the memory went (ui/breakdown_view.py) and the numbers panel's total tile, in real Qt
(offscreen), rendering kvscope.core.live.breakdown's figures."""

from __future__ import annotations

import random

from kvscope.core.live.breakdown import PARTS, memory_breakdown
from kvscope.core.model.spec import human_bytes
from kvscope.ui.breakdown_view import UNATTRIBUTED, BreakdownView
from kvscope.ui.stats import StatsPanel
from tests.test_breakdown import MiB, _gpu_sample, _sample


def test_the_bar_and_the_legend_follow_the_breakdown(qtbot) -> None:
    view = BreakdownView()
    qtbot.addWidget(view)
    view.resize(260, 240)
    view.show()
    rng = random.Random(5)
    for _ in range(20):
        b = memory_breakdown(_gpu_sample(rng))
        view.show_breakdown(b)
        assert view.bar.total == b.total
        assert sum(size for _, size in view.bar.segments) == b.total  # every byte of the total drawn once
        for p in b.parts:
            assert view.rows[p.name][1].text() == human_bytes(p.bytes)
        assert not view.rows[UNATTRIBUTED][1].isVisible()
    assert not view.grab().isNull()


def test_what_the_device_does_not_say_reads_na(qtbot) -> None:
    view = BreakdownView()
    qtbot.addWidget(view)
    view.show()
    cpu = _sample(process_rss=500 * MiB, weights_bytes=40 * MiB, kv_bytes_held=MiB, kv_bytes_reserved=MiB,
                  activations_predicted=2 * MiB)
    view.show_breakdown(memory_breakdown(cpu))
    assert view.rows["allocator_cache"][1].text() == "n/a" and view.rows["other_processes"][1].text() == "n/a"
    assert view.rows["activations"][2].text() == "pred." and view.rows["runtime"][2].text() == "rest"
    assert "process RSS" in view.total_label.text()
    wsl = _gpu_sample(random.Random(1)).replace(process_gpu=None)  # NVML without a per-process figure
    view.show_breakdown(memory_breakdown(wsl))
    assert view.rows[UNATTRIBUTED][1].isVisible()
    assert view.rows[UNATTRIBUTED][1].text() == human_bytes(wsl.device_used - wsl.allocator_reserved)
    view.show_breakdown(None)
    assert [view.rows[name][1].text() for name in PARTS] == ["n/a"] * len(PARTS)


def test_the_numbers_panel_says_the_total_and_its_parts(qtbot) -> None:
    panel = StatsPanel()
    qtbot.addWidget(panel)
    s = _sample(process_rss=500 * MiB, weights_bytes=40 * MiB, kv_bytes_held=MiB, kv_bytes_reserved=MiB,
                activations_predicted=2 * MiB)
    panel.show_breakdown(memory_breakdown(s))
    tile = panel.tiles["total"]
    assert tile.value.text() == human_bytes(500 * MiB)
    assert "weights 40.0 MiB (m)" in tile.note.text() and "activations / compute 2.0 MiB (p)" in tile.note.text()
    assert "other processes n/a" in tile.note.text()


def test_parts_over_the_total_are_never_a_negative_row(qtbot) -> None:
    """Issue 37: a llama.cpp run on the CPU showed "-399.4 MiB parts exceed": its weights are mapped from the file,
    counted whole in the parts, resident only where read. The row says the excess as a size and why."""
    view = BreakdownView()
    qtbot.addWidget(view)
    view.resize(260, 400)
    view.show()
    mapped = _sample(process_rss=100 * MiB, weights_bytes=480 * MiB, kv_bytes_held=MiB, kv_bytes_reserved=20 * MiB,
                     activations_observed=10 * MiB)
    b = memory_breakdown(mapped)
    assert b.unattributed < 0
    view.show_breakdown(b)
    value, source = view.rows[UNATTRIBUTED][1].text(), view.rows[UNATTRIBUTED][2].text()
    assert value == human_bytes(-b.unattributed) and not value.startswith("-")
    assert source == "over the total: mapped, not resident"
    assert all(not view.rows[name][1].text().startswith("-") for name in PARTS)


def test_a_short_box_keeps_the_kv_cache_and_the_weights_rows(qtbot) -> None:
    """Presenter mode at 1024x768 gives the box room for three rows: it showed the allocator's cache, the runtime
    and the rest, and dropped the KV cache (the part the app is about) and the weights (what it is weighed
    against). They stay; the largest of the others fill the room left; the tooltip names what is not shown."""
    view = BreakdownView()
    qtbot.addWidget(view)
    view.show()
    cpu = _sample(process_rss=460 * MiB, weights_bytes=13 * MiB, kv_bytes_held=2 * MiB, kv_bytes_reserved=2 * MiB,
                  activations_predicted=MiB // 3)
    view.show_breakdown(memory_breakdown(cpu))
    full = view.sizeHint().height()
    for rows in (1, 2, 3):
        view.setFixedSize(260, full - (len(PARTS) - rows) * view._row_height())
        qtbot.wait(10)
        shown = [name for name in PARTS if view.rows[name][1].isVisibleTo(view)]
        assert len(shown) <= rows + 1, shown
        assert "kv_held" in shown, (rows, shown)
        if rows >= 2:
            assert "weights" in shown, (rows, shown)
        assert "Not shown for lack of room" in view.toolTip()

"""The quality probe in the window (issue 34, items 1 and 5): the strip under the KV plot, the running figure on the
attention badge, the frontier, their exports and the summary image, and the probe's default in the controls.

Real Samples: one short run of the embedded model with the probe on (MHA, then MQA, then a 16-token window, each
judged against the model as loaded), recorded and read back as a replay reads it; real Qt, offscreen."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ElementTree

import numpy as np
import pytest

from kvscope.core.base.sample import Sample
from kvscope.core.records.recording import RecordingReader
from kvscope.ui.main_window import MainWindow
from kvscope.ui.plots import LivePlots
from kvscope.ui.plots.quality import WINDOW
from kvscope.ui.screenshot import image_stats
from tests.synthetic import synthetic_samples

SWITCHES = ((20, "attention", "mqa"), (40, "attention", "window:16"))


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> list[Sample]:
    """A real run of the embedded model, 60 tokens, the probe on, recorded and read back."""
    from kvscope.core.live.terminal import run_terminal
    from kvscope.core.model.request import RunRequest

    record = tmp_path_factory.mktemp("probe") / "probe.jsonl"
    assert run_terminal(RunRequest(device="cpu", max_new_tokens=60, switches=SWITCHES, record_path=str(record),
                                   quality_probe=True)) == 0
    with RecordingReader(record) as reader:
        samples = list(reader)
    judged = [s for s in samples if not s.is_event]
    assert all(s.quality_top1 is not None for s in judged) and {s.attention for s in judged} == {"mha", "mqa",
                                                                                                "window:16"}
    return samples


def _running_means(samples: list[Sample]) -> list[tuple[int, float, float]]:
    """(token, top-1 %, KL) per judged token: the mean of the last WINDOW tokens since the last switch, by hand."""
    out, recent, setting = [], [], None
    for s in samples:
        if s.is_event:
            if s.event == "switch":
                recent = []
            continue
        if (s.attention, s.cache) != setting:
            recent, setting = [], (s.attention, s.cache)
        recent = (recent + [(s.quality_top1, s.quality_kl)])[-WINDOW:]
        out.append((s.token, 100.0 * sum(a for a, _ in recent) / len(recent), sum(k for _, k in recent) / len(recent)))
    return out


from tests.test_ui_plots import plots  # noqa: E402,F401 - the live plots, shown at 1000 x 700 (a fixture)


def test_the_strip_draws_the_running_top1_and_kl_and_shows_only_with_the_probe(plots, probed, qtbot):
    plots.add_samples(synthetic_samples(10))  # no probe: no strip, no frontier, the KV plot's token axis its own
    plots.redraw()
    assert not plots.quality.isVisible() and not plots.frontier.isVisible() and not plots.kv.axis_below
    plots.reset()
    plots.add_samples(probed)
    plots.redraw()
    qtbot.wait(20)
    assert plots.quality.isVisible() and plots.frontier.isVisible() and plots.kv.axis_below
    expected = _running_means(probed)
    x, top1 = plots.curve_data("quality_top1_mean")
    _, kl = plots.curve_data("quality_kl_mean")
    # Decimated to one min/max pair per pixel column: every drawn point is one of the running means, in order, and
    # 60 tokens on a ~900 px plot keep every one.
    np.testing.assert_array_equal(np.unique(x), [t for t, _, _ in expected])
    by_token = {t: (a, k) for t, a, k in expected}
    assert all(top1[i] == pytest.approx(by_token[x[i]][0]) and kl[i] == pytest.approx(by_token[x[i]][1])
               for i in range(len(x)))
    # The KL is the strip's now: the KV plot has no KL curve and no stale "full cache" wording left.
    assert not any(k.startswith("quality") for k in plots.kv.curves)
    assert all("KL" not in name for name in plots.kv.legend_entries())
    # The figure (the strip's title, the badge's) is the last setting's: window:16, the tokens since its switch.
    figure = plots.quality_figure()
    tail = [s for s in probed if not s.is_event and s.attention == "window:16"][-WINDOW:]
    assert (figure.attention, figure.tokens) == ("window:16", len(tail))
    assert figure.top1 == pytest.approx(sum(s.quality_top1 for s in tail) / len(tail))
    assert f"top-1 {figure.percent}%" in plots.quality.title_label.text
    # The strip's tokens are the KV plot's, pixel for pixel: the same x range, the data areas' edges aligned.
    assert plots.quality.plot.viewRange()[0] == plots.kv.plot.viewRange()[0]
    kv_area = plots.kv.plot.getViewBox().sceneBoundingRect()
    strip_area = plots.quality.plot.getViewBox().sceneBoundingRect()
    assert abs(kv_area.left() - strip_area.left()) <= 2 and abs(kv_area.right() - strip_area.right()) <= 2
    plots.reset()
    assert not plots.quality.isVisible() and plots.quality_figure() is None


def test_the_frontier_has_one_point_per_setting_with_its_means(plots, probed):
    plots.add_samples(probed)
    plots.redraw()
    points = {label: (x, y, kl) for label, x, y, kl in plots.frontier.shown_points()}
    assert list(points) == ["mha", "mqa", "window:16"]  # one per setting, in the order visited; one cache: no cache
    for label, (x, y, kl) in points.items():
        mine = [s for s in probed if not s.is_event and s.attention == label]
        grown = mine[-1].kv_bytes_held - mine[0].kv_bytes_held  # one visit: the growth over its tokens
        assert x == pytest.approx(grown / (mine[-1].context_tokens - mine[0].context_tokens) if grown > 0 else
                                  np.mean([s.kv_bytes_held / s.context_tokens for s in mine]))
        assert y == pytest.approx(100.0 * np.mean([s.quality_top1 for s in mine]))
        assert kl == pytest.approx(np.mean([s.quality_kl for s in mine]))
    # The model as loaded is itself: MHA agrees at every token; MQA's pooled heads hold 1/8 of its bytes per token.
    assert points["mha"][1] == 100.0 and points["mha"][2] < 1e-5
    assert points["mqa"][0] == pytest.approx(points["mha"][0] / 8)
    # Each drawn dot is at its point (x on a log2 scale), and every label that shows names a setting.
    xs, ys = plots.frontier.scatter.getData()
    assert sorted(zip(xs, ys)) == sorted((math.log2(x), y) for x, y, _ in points.values())
    shown = [item for item in plots.frontier.labels.values() if item.isVisible()]
    assert shown and all(item.textItem.toPlainText().split("\n")[0] in points for item in shown)
    # A second visit of a setting adds to its point, never a second one.
    again = [s.replace(token=s.token + 1000, time_s=s.time_s + 100) for s in probed if s.attention == "mha"]
    plots.add_samples(again)
    plots.redraw()
    assert [label for label, *_ in plots.frontier.shown_points()] == ["mha", "mqa", "window:16"]


def test_a_latent_is_placed_at_what_each_more_token_costs_not_its_basis(plots):
    """MLA's latent holds its basis once per layer beside the coefficients per token: at a short context the held
    bytes per token of context are mostly basis; the frontier's x is what one more token costs."""
    base = [s for s in synthetic_samples(30) if not s.is_event]
    latent = [s.replace(attention="mla", quality_top1=1, quality_kl=0.01, context_tokens=40 + i,
                        kv_bytes_held=1_000_000 + 512 * (40 + i)) for i, s in enumerate(base)]
    plots.add_samples(latent)
    plots.redraw()
    (label, x, y, kl), = plots.frontier.shown_points()
    assert label == "mla" and x == pytest.approx(512) and y == 100.0


def test_a_cache_in_the_label_only_where_the_points_differ_in_it(plots):
    base = [s.replace(quality_top1=1, quality_kl=0.0, context_tokens=s.token + 1) for s in synthetic_samples(8)
            if not s.is_event]
    other = [s.replace(token=s.token + 20, cache="quantized:4", quality_top1=0, quality_kl=0.5) for s in base]
    plots.add_samples(base + other)
    plots.redraw()
    labels = [label for label, *_ in plots.frontier.shown_points()]
    assert labels == [f"{base[0].attention} \u00b7 {base[0].cache}", f"{base[0].attention} \u00b7 quantized:4"]


def test_the_badge_says_the_running_figure_only_while_the_probe_runs(qtbot, settings, probed):
    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    w.resize(1280, 800)
    w.show()
    w.add_samples(synthetic_samples(6))
    w._redraw()
    badge = w.badges["attention"]
    assert badge.suffix == "" and "top-1" not in badge.shown_text()
    w.plots.reset()
    w.add_samples(probed)
    w._redraw()
    figure = w.plots.quality_figure()
    assert badge.text() == "WINDOW:16"  # the setting alone: what the other tests and the combos read
    assert badge.shown_text() == f"WINDOW:16 \u00b7 top-1 {figure.percent}%"
    assert f"over the last {figure.tokens} tokens" in badge.toolTip()
    w.plots.reset()
    assert badge.suffix == ""
    w.shutdown()


def test_the_quality_plots_export_as_png_and_svg_and_join_the_summary(qtbot, settings, probed, tmp_path):
    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    w.resize(1280, 800)
    w.show()
    w.add_samples(probed)
    w._redraw()
    qtbot.wait(20)
    pngs = w.export_plots(str(tmp_path / "q.png"), fmt="png")
    assert [p.name for p in pngs] == ["q-kv.png", "q-quality.png", "q-frontier.png", "q-memory.png", "q-compare.png"]
    for path in pngs:
        width, height, spread = image_stats(path)
        assert width >= 400 and height > 100 and spread > 5, (path.name, width, height, spread)
    svgs = w.export_plots(str(tmp_path / "q"), fmt="svg")
    for path in svgs:
        root = ElementTree.parse(path).getroot()  # a well-formed SVG document
        assert root.tag.endswith("svg") and path.stat().st_size > 2000
    frontier_svg = (tmp_path / "q-frontier.svg").read_text(encoding="utf-8")
    assert "window:16" in frontier_svg and "mqa" in frontier_svg  # the points' labels are in the picture
    summary = w.export_summary(str(tmp_path / "summary.png"))
    width, height, spread = image_stats(summary)
    assert (width, height) == (1920, 1080) and spread > 10
    w.shutdown()


def test_the_probe_is_on_by_default_where_it_is_cheap(qtbot, settings, tmp_path):
    from kvscope.ui.controls import PROBE_DEFAULT_MAX_BYTES, probe_is_cheap_for

    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    c = w.controls
    assert c.quality_check.isChecked() and w.build_request().quality_probe  # the embedded model
    assert "model as loaded" in c.quality_check.toolTip() and "twin" not in c.quality_check.toolTip()
    c.source_combo.setCurrentIndex(c.source_combo.findData("hub"))
    c.hub_edit.setText("HuggingFaceTB/SmolLM2-135M")
    assert not c.quality_check.isChecked()  # not on disk: its size is unknown
    small, large = tmp_path / "small", tmp_path / "large"
    for folder, size in ((small, 1000), (large, PROBE_DEFAULT_MAX_BYTES + 1)):
        folder.mkdir()
        with open(folder / "model.safetensors", "wb") as f:
            f.truncate(size)  # a sparse file: its size, no bytes written
    assert probe_is_cheap_for(str(small), "transformers") and not probe_is_cheap_for(str(large), "transformers")
    assert not probe_is_cheap_for(str(small), "llama.cpp") and not probe_is_cheap_for(str(tmp_path), "transformers")
    c.source_combo.setCurrentIndex(c.source_combo.findData("folder"))
    c.folder_edit.setText(str(small))
    assert c.quality_check.isChecked()
    c.quality_check.setChecked(False)  # the user's choice stands until another model is chosen
    assert not w.build_request().quality_probe
    c.folder_edit.setText(str(large))
    assert not c.quality_check.isChecked()
    w.shutdown()


def test_a_narrow_column_keeps_the_kv_plot_and_still_exports_the_quality_plots(qtbot, probed, tmp_path):
    """At 1024 px with the controls shown the plots are ~480 px wide: the strip and the frontier wait off screen (they
    squeezed the KV plot's data area to a few pixels there), and File › Export still draws them whole."""
    plots = LivePlots(capacity=1000)
    qtbot.addWidget(plots)
    plots.resize(480, 420)
    plots.show()
    plots.add_samples(probed)
    plots.redraw()
    qtbot.wait(20)
    assert plots.quality.isHidden() and plots.frontier.isHidden() and not plots.kv.axis_below
    assert plots.quality_figure() is not None  # the badge still says it
    for which in ("quality", "frontier"):
        path = plots.export_plot(which, str(tmp_path / f"{which}.png"))
        width, height, spread = image_stats(path)
        assert width >= 400 and height > 100 and spread > 5, (which, width, height, spread)
    plots.resize(700, 420)  # wide enough again (presenter mode at 1024 px): they come back
    qtbot.waitUntil(lambda: not plots.quality.isHidden() and not plots.frontier.isHidden(), timeout=2000)

"""Issue 25, item 5: the small things a viewer notices (offscreen Qt, the real window's widgets)."""

from __future__ import annotations

from PySide6.QtGui import QColor

from kvscope.ui.diagnose import EventRow, EventsTable
from kvscope.ui.theme import theme as make_theme
from tests.synthetic import synthetic_samples


def _luminance(color: QColor) -> float:
    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    return 0.2126 * channel(color.redF()) + 0.7152 * channel(color.greenF()) + 0.0722 * channel(color.blueF())


def contrast(a: str, b: str) -> float:
    la, lb = sorted((_luminance(QColor(a)), _luminance(QColor(b))), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_an_event_before_the_runs_time_0_says_loading_not_a_negative_time(qtbot):
    table = EventsTable(make_theme("dark"))
    qtbot.addWidget(table)
    table.add(EventRow(-0.44, None, "spike (this process)", "+36 MiB", "loading the weights"))
    table.add(EventRow(1.5, 3, "switch", "2 MiB", "attention: mha -> mqa"))
    times = [table.item(r, 0).text() for r in range(table.rowCount())]
    assert times == ["loading", "1.50 s"]
    assert not any(t.startswith("-") for t in times)


def test_event_names_keep_their_contrast_when_the_theme_changes(qtbot):
    dark, light = make_theme("dark"), make_theme("light")
    table = EventsTable(dark)
    qtbot.addWidget(table)
    samples = synthetic_samples(40, switches={10: "mqa", 20: "gqa:2"})
    for s in samples:
        if s.is_event or s.phase == "prefill":
            table.add_event(s)
    for kind, color in (("switch", dark.curves["marker"]), ("refused", dark.warning), ("oom", dark.error)):
        table.add(EventRow(2.0, 5, kind, "", kind), color)
    table.recolor(dark, light)
    ratios = [contrast(table.item(r, 2).foreground().color().name(), light.background) for r in range(table.rowCount())]
    assert ratios and min(ratios) >= 4.5, ratios  # WCAG AA for normal text
    table.recolor(light, dark)
    ratios = [contrast(table.item(r, 2).foreground().color().name(), dark.background) for r in range(table.rowCount())]
    assert min(ratios) >= 4.5, ratios


def test_start_runs_the_prompt_the_first_run_runs(qtbot):
    """The Start path stripped the default prompt's trailing space: 18 tokens where the first run had 19."""
    from kvscope.core.model.request import DEFAULT_PROMPT, RunRequest
    from kvscope.ui.controls import ControlsPanel

    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.prompt_edit.setPlainText(DEFAULT_PROMPT)
    assert panel.build_request().prompt == RunRequest().prompt == DEFAULT_PROMPT
    panel.prompt_edit.setPlainText("   \n")
    assert panel.build_request().prompt == DEFAULT_PROMPT  # blank: the default, as before

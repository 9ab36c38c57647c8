"""Issue 25, item 5: the calculator and `calc` give the same largest context (it stopped at "131,072+"
where calc said 1,635,930), with one GPU and with several; the per-GPU numbers say they are per GPU."""

from __future__ import annotations

import pytest

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.sources import load_spec
from kvscope.core.prediction.calc import calculate
from kvscope.core.prediction.parallel import Parallelism
from kvscope.ui.calculator import GPU_LAYOUTS, CalculatorTab

MODELS = ("llama-3-8b", "mistral-7b", "qwen2.5-7b", "smollm2-135m", "gemma-3-27b")
MEMORIES = ("24 GiB", "80 GiB  A100 / H100")


@pytest.mark.parametrize("model", MODELS)
def test_the_calculator_and_calc_agree_on_the_largest_context(qtbot, model):
    tab = CalculatorTab()
    qtbot.addWidget(tab)
    spec = load_spec(model)
    tab.set_spec(spec)
    for memory_text in MEMORIES:
        tab.memory_combo.setCurrentText(memory_text)
        for layout in GPU_LAYOUTS[:3]:
            tab.gpus_combo.setCurrentIndex(GPU_LAYOUTS.index(layout))
            tab.recompute()
            settings = tab.current_settings()
            try:
                result = calculate(spec, settings, [4096], tab.memory_bytes(), Parallelism(tensor=layout[0], pipeline=layout[1]))
            except SettingsError as exc:  # TP that does not divide the heads: the calculator says so too
                assert str(exc).split(" (")[0] in tab.error_label.text()
                continue
            assert tab.state.max_fit == result.max_context, (model, memory_text, layout)
            if result.max_context:
                assert f"{result.max_context:,}" in tab.fits_label.text()
            single = layout == (1, 1)
            assert tab.number_names["total"].text() == ("Total" if single else "Total per GPU")


def test_a_replay_leaves_the_calculator_alone(qtbot, window):
    from pathlib import Path

    window.calculator.set_spec(load_spec("llama-3-70b"), source="llama-3-70b")
    before = (window.calculator.spec, window.calculator.state)
    demo = Path(__file__).resolve().parents[1] / "assets" / "demo" / "demo.jsonl"
    with qtbot.waitSignal(window.run_finished, timeout=120_000):
        assert window.open_recording(str(demo), speed=50.0)
    assert window.info is not None and window.info.spec.name != "llama-3-70b"  # the recording's model is another
    assert (window.calculator.spec, window.calculator.state) == before

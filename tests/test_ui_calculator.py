"""The calculator tab: every slider move shows the predictor's numbers at once."""

from __future__ import annotations

import pytest

from kvscope.core.model.settings import RunSettings, attention_choices
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import human_bytes
from kvscope.core.prediction.calc import kv_formula
from kvscope.core.prediction.predict import kv_bytes, max_context_that_fits, predict
from kvscope.ui.calculator import CalculatorTab


@pytest.fixture(scope="module")
def llama():
    return load_spec("llama-3-8b")


@pytest.fixture
def calc(qtbot, llama):
    tab = CalculatorTab()
    qtbot.addWidget(tab)
    tab.set_spec(llama)
    tab.memory_combo.setCurrentText("24 GiB")
    return tab


def test_context_slider_updates_the_numbers(calc, llama):
    calc.set_context(4096)
    assert calc.state.context == 4096
    assert calc.numbers["kv"].text() == "512.0 MiB"
    calc.set_context(32768)  # a slider move, not a call to recompute
    settings = RunSettings(weight_dtype="bfloat16")
    assert calc.state.kv == kv_bytes(llama, settings, 32768) == 4 * 1024**3
    assert calc.numbers["kv"].text() == "4.0 GiB"
    assert calc.state.total == predict(llama, settings, 32768).total
    assert calc.numbers["total"].text() == human_bytes(calc.state.total)


def test_batch_and_attention_sliders(calc, llama):
    calc.set_context(4096)
    one = calc.state.kv
    calc.batch.slider.setValue(calc.batch.values.index(4))
    assert calc.state.kv == 4 * one
    calc.batch.slider.setValue(0)
    calc.attention.set_value("mqa")
    assert calc.state.kv == one // 8  # 8 KV heads -> 1
    assert "1 KV heads" in calc.formula_label.text()


def test_largest_context_that_fits_matches_the_predictor(calc, llama):
    calc.set_context(131072)
    settings = RunSettings(weight_dtype="bfloat16")
    expected = max_context_that_fits(llama, settings, 24 * 1024**3, limit=131072)
    assert calc.state.max_fit >= expected  # issue 25: no longer capped at the slider's end (calc's search)
    assert f"{expected:,}" in calc.fits_label.text()
    assert "does not fit" in calc.headline.text()
    assert "beyond" in calc.headline.text()  # 128K is past Llama-3-8B's trained 8K


def test_kv_dtype_and_memory_typed_in(calc):
    calc.set_context(4096)
    calc.kv_dtype.set_value("int8")
    assert calc.state.kv == 256 * 1024**2
    calc.memory_combo.setCurrentText("80GB")
    assert calc.state.memory == 80 * 1000**3
    calc.memory_combo.setCurrentText("lots")
    assert calc.state.memory is None and calc.state.max_fit is None


def test_formula_has_the_models_numbers(llama):
    text = kv_formula(llama, RunSettings(weight_dtype="bfloat16"), 4096, times=" \u00d7 ")
    assert "2 \u00d7 32 layers \u00d7 8 KV heads \u00d7 128 head_dim \u00d7 4,096 tokens \u00d7 1 batch \u00d7 2 B" in text
    assert "= 536,870,912 B" in text
    windowed = kv_formula(load_spec("mistral-7b"), RunSettings(), 8192, times=" \u00d7 ")
    assert "cache holds" in windowed


def test_a_bad_combination_shows_a_message_not_a_traceback(calc):
    calc.attention.set_value(next(v for v in calc.attention.values if v.startswith("window")))
    calc.cache_combo.setCurrentText("quantized:4")
    assert "quantized" in calc.error_label.text()


def test_attention_choices_run_from_most_to_least_kv(llama):
    assert attention_choices(llama) == ("mha", "gqa:16", "gqa:8", "gqa:4", "gqa:2", "mqa", "mla", "window:4096",
                                        "window:256")


def test_one_list_of_choices_per_axis_for_engine_window_and_calculator():
    """The window before a model loads, the engine's ModelInfo and the calculator all read these."""
    from dataclasses import replace

    from kvscope.core.model.settings import CACHE_KEYS, cache_choices, selecting_cache_keys, window_choices
    from kvscope.core.model.sources import load_spec

    embedded, mistral = load_spec("embedded"), load_spec("mistral-7b")
    assert window_choices(embedded) == [256]  # 4,096-token context: a 4K window would be the whole of it
    assert attention_choices(mistral)[-2:] == ("window:4096", "window:256")  # its own window, and the demo's
    assert window_choices(mistral) == [4096, 256]
    assert window_choices(replace(embedded, max_position_embeddings=64)) == [16]
    assert [k for k, _ in cache_choices()] == list(CACHE_KEYS) + list(selecting_cache_keys())
    assert dict(cache_choices())["offloaded"] == "needs CUDA" and dict(cache_choices("cuda:0"))["offloaded"] is None
    assert dict(cache_choices())["quantized:4"] is None  # optimum-quanto is installed here (make setup)


def test_model_loads_in_the_background(qtbot):
    tab = CalculatorTab()
    qtbot.addWidget(tab)
    with qtbot.waitSignal(tab.spec_loaded, timeout=60_000):
        tab.load_model("smollm2-135m")
    assert tab.spec.num_layers == 30
    tab.load_model("no-such-model-here")
    qtbot.waitUntil(lambda: "unknown model" in tab.error_label.text(), timeout=30_000)
    tab.shutdown()


def test_context_slider_arrow_keys_step_between_powers_of_two(calc):
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    slider = calc.context.slider
    calc.set_context(4096)
    seen = []
    for key in (Qt.Key.Key_Right, Qt.Key.Key_Right, Qt.Key.Key_Left, Qt.Key.Key_PageUp, Qt.Key.Key_PageDown):
        QTest.keyClick(slider, key)
        seen.append(calc.state.context)
    assert seen == [8192, 16384, 8192, 32768, 8192]
    calc.set_context(5000)  # between two stops: the next one up, or down
    start = calc.state.context
    assert 4096 < start < 8192
    QTest.keyClick(slider, Qt.Key.Key_Right)
    assert calc.state.context == 8192
    calc.set_context(5000)
    QTest.keyClick(slider, Qt.Key.Key_Left)
    assert calc.state.context == 4096
    calc.set_context(1)
    QTest.keyClick(slider, Qt.Key.Key_Left)  # the first stop stays
    assert calc.state.context == 1


def test_several_gpus_show_the_busiest_gpus_share_and_what_fits_on_every_one(calc):
    from kvscope.core.model.sources import load_spec
    from kvscope.core.prediction.parallel import Parallelism, max_context_per_gpu, predict_parallel

    big = load_spec("llama-3-70b")
    calc.set_spec(big)
    calc.memory_combo.setCurrentText("80 GiB  A100 / H100")
    calc.set_context(32768)
    whole = calc.state.total
    from kvscope.ui.calculator import GPU_LAYOUTS

    calc.gpus_combo.setCurrentIndex(GPU_LAYOUTS.index((4, 1)))
    settings = calc.current_settings()
    shares = predict_parallel(big, settings, Parallelism(tensor=4), 32768).per_gpu()
    assert calc.state.total == max(p.total for p in shares) < whole
    assert calc.state.kv == shares[0].breakdown.kv_cache == 2 * 80 * 2 * 128 * 32768 * 2  # 2 of 8 KV heads per GPU
    assert "per GPU" in calc.headline.text() and "4 GPUs" in calc.gpus_combo.currentText()
    fit = max_context_per_gpu(big, settings, Parallelism(tensor=4), 80 * 2**30, calc._context_values[-1])
    assert calc.state.max_fit >= fit and "every one of 4 GPUs" in calc.fits_label.text()
    assert calc.number_names["total"].text() == "Total per GPU" and calc.number_names["per_token"].text().endswith("(all GPUs)")
    calc.gpus_combo.setCurrentIndex(0)
    assert calc.state.total == whole


def test_llamacpp_runtime_shows_the_allocation_at_load(calc, llama, tmp_path):
    """Runtime llama.cpp: the KV is what llama.cpp allocates for the context (padded to 256 cells), the same
    whatever is generated; a GGUF model's weights are its tensor bytes; the Cache list holds llama.cpp's types."""
    from kvscope.core.model.gguf import read_gguf
    from kvscope.core.prediction.llamacpp import LlamaCppOptions, max_context_llamacpp, plan
    from tests import gguf_models

    calc.set_context(4096)
    calc.runtime_combo.setCurrentIndex(calc.runtime_combo.findData("llama.cpp"))
    assert [calc.cache_combo.itemText(i) for i in range(3)] == ["f32", "f16", "bf16"]
    assert calc.cache_combo.currentText() == "f16" and not calc.batch.isEnabled()
    assert calc.state.kv == 536_870_912
    # the compute buffer llama.cpp reserves (kvscope.core.prediction.llamacpp_compute), shown in place of transformers' activations
    compute = plan(llama, LlamaCppOptions(n_ctx=4096)).compute_bytes
    assert compute and calc.numbers["activations"].text() == human_bytes(compute)
    assert calc.number_names["activations"].text() == "Compute buffer"
    calc.cache_combo.setCurrentText("q8_0")
    assert calc.state.kv == plan(llama, LlamaCppOptions(n_ctx=4096, type_k="q8_0", type_v="q8_0")).kv_bytes
    # calc's search (to llama.cpp's MAX_CONTEXT), not stopped at the slider's 131,072 (issue 25: "131,072+")
    assert calc.state.max_fit == max_context_llamacpp(llama, 24 * 1024**3, "q8_0") == 135_168
    assert "135,168 tokens" in calc.fits_label.text()
    assert "cells" in calc.formula_label.text() and "allocated at load" in calc.formula_label.text()
    path = gguf_models.gemma3(tmp_path / "g.gguf")
    spec = load_spec(str(path))
    calc.set_spec(spec)
    calc.set_context(1024)
    g = read_gguf(path)
    expected = plan(g, LlamaCppOptions(n_ctx=1024, type_k="q8_0", type_v="q8_0"))
    assert calc.state.kv == expected.kv_bytes and calc.state.weights == g.weight_bytes
    assert "sliding window" in calc.formula_label.text()
    calc.runtime_combo.setCurrentIndex(calc.runtime_combo.findData("transformers"))
    assert calc.cache_combo.currentText() == "dynamic" and calc.batch.isEnabled()
    assert calc.state.kv == kv_bytes(spec, calc.current_settings(), 1024)


def test_a_runtime_registered_with_calculator_rules_is_offered_without_a_ui_edit(qtbot, llama):
    """The tab lists what the registry gives rules (``RuntimeInfo.calculator``): a runtime written here, whose cache
    allocates K/V in chunks of 256 tokens, shows its own rows and greys the inputs it does not read."""
    from dataclasses import replace as with_

    from kvscope.core import runtimes
    from kvscope.core.prediction.predict import kv_bytes
    from kvscope.core.runtimes.calculator import CalcFigures, CalcRow

    class ChunkRules:
        label, tip, unused_note, default_cache = "chunks (tests)", "a cache in 256-token chunks", "(chunks: not used)", "chunk:256"
        inputs = frozenset({"batch"})

        def caches(self, spec):
            return ["chunk:256", "chunk:1024"]

        def settings(self, spec, inputs):
            return RunSettings(batch=inputs.batch)

        def _kv(self, spec, inputs):
            size = int(inputs.cache.split(":")[1])
            held = -(-inputs.context // size) * size  # whole chunks
            return kv_bytes(spec, self.settings(spec, inputs), held)

        def fit(self, spec, inputs):
            return None, 1

        def figures(self, spec, inputs, fit):
            kv = self._kv(spec, inputs)
            return CalcFigures(inputs, self.settings(spec, inputs), (CalcRow("kv", "KV in chunks", kv), CalcRow("total", "Total", kv)),
                               kv, fit[0], fit[1], f"{inputs.cache}", 1, spec.max_position_embeddings, spec.label)

        def stack(self, spec, inputs):
            return 0, self._kv(spec, inputs), 0

    runtimes.register(runtimes.RuntimeInfo(name="chunks-test", open=lambda r, p: None, calculator=ChunkRules()))
    try:
        tab = CalculatorTab()
        qtbot.addWidget(tab)
        tab.set_spec(llama)
        names = [tab.runtime_combo.itemData(i) for i in range(tab.runtime_combo.count())]
        assert names == list(runtimes.calculators()) and names[-1] == "chunks-test"
        tab.set_context(1000)
        tab.runtime_combo.setCurrentIndex(names.index("chunks-test"))
        assert [tab.cache_combo.itemText(i) for i in range(tab.cache_combo.count())] == ["chunk:256", "chunk:1024"]
        assert list(tab.numbers) == ["kv", "total"] and tab.number_names["kv"].text() == "KV in chunks"
        assert tab.state.kv == kv_bytes(llama, RunSettings(), 1024)  # 1,000 tokens: four whole chunks of 256
        assert tab.batch.isEnabled() and not tab.attention.isEnabled() and "(chunks: not used)" in tab.attention.toolTip()
        tab.runtime_combo.setCurrentIndex(names.index(runtimes.DEFAULT))  # back: the default's rows again
        assert list(tab.numbers) == ["weights", "kv", "activations", "total", "per_token"]
        assert tab.attention.isEnabled() and "(chunks" not in tab.attention.toolTip()
        assert with_(tab.state.inputs, runtime="x").runtime == "x"
    finally:
        runtimes.unregister("chunks-test")

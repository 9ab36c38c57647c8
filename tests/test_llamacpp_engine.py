"""llama.cpp as a live engine (kvscope.core.runtimes.llamacpp.engine): the embedded model's GGUF generated in the real llama.cpp.

Every decode sample's KV observed is what llama.cpp reserved at load (from its log's cells and a measured cell),
flat, and equal to the predictor's plan; "used" grows by one cell's bytes per token; an attention switch is
refused and the run goes on; a cache-type or context switch reloads the context and the reserved bytes become
the new plan's exactly; the recording round-trips; the CLI and the window run it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")

from kvscope.core.base.sample import Sample  # noqa: E402
from kvscope.core.live.run import run_generation  # noqa: E402
from kvscope.core.model.gguf import read_gguf  # noqa: E402
from kvscope.core.model.gguf_write import embedded_gguf  # noqa: E402
from kvscope.core.model.request import RunHooks, RunRequest  # noqa: E402
from kvscope.core.prediction.llamacpp import LlamaCppOptions, plan  # noqa: E402
from kvscope.core.runtimes.llamacpp.engine import FIXED_LAYOUT, RUNTIME  # noqa: E402
from tests import gguf_models  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path():
    return embedded_gguf()


def _run(request: RunRequest, polls=None) -> list[Sample]:
    samples: list[Sample] = []
    queue = list(polls or [])

    def poll():
        # a live switch (as the window sends one) once the run is 10 tokens in
        if queue and sum(s.phase == "decode" for s in samples) >= queue[0][0]:
            return [queue.pop(0)[1]]
        return []

    run_generation(dataclasses.replace(request, runtime=RUNTIME), RunHooks(emit=samples.append, poll=poll))
    return samples


def _decodes(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.phase == "decode"]


def test_sixty_tokens_reserve_the_whole_context_at_load_and_fill_one_cell_per_token(gguf_path):
    options = LlamaCppOptions(n_ctx=4096)
    predicted = plan(read_gguf(gguf_path), options)
    samples = _run(RunRequest(runtime="llama.cpp", options={"llama.cpp": options}, max_new_tokens=60))
    decodes = _decodes(samples)
    assert len(decodes) == 60 and all(s.runtime == "llama.cpp" for s in samples)
    per_cell = predicted.buffers[0].row_bytes
    assert per_cell == 4 * 2 * 256 * 2  # 4 layers x (K + V) x 8 heads x 32 x f16
    for s in [samples[2]] + decodes:  # the prefill, then every token
        assert s.kv_bytes_reserved == predicted.kv_bytes == s.kv_bytes_predicted == 16 * 1024 * 1024
    used = [s.kv_bytes_held for s in decodes]
    assert all(b - a == per_cell for a, b in zip(used, used[1:])), "used grows by one cell per token"
    assert used[-1] == per_cell * decodes[-1].context_tokens
    text = "".join(s.text for s in decodes)
    assert text.strip(), "llama.cpp generated text"
    assert decodes[-1].weights_bytes == read_gguf(gguf_path).weight_bytes  # llama_model_size: the tensors
    load = [s for s in samples if s.event == "load"]
    assert load and "llama.cpp" in load[0].text


def test_an_attention_switch_is_refused_and_a_cache_type_reload_reserves_the_new_plan(gguf_path):
    options = LlamaCppOptions(n_ctx=4096)
    g = read_gguf(gguf_path)
    samples = _run(RunRequest(runtime="llama.cpp", options={"llama.cpp": options}, max_new_tokens=400,
                              switches=((5, "attention", "mqa"), (12, "cache-type", "q8_0"))),
                   polls=[(20, ("context", "8192"))])
    refused = [s for s in samples if s.event == "refused"]
    assert len(refused) == 1 and FIXED_LAYOUT in refused[0].text and refused[0].switch_key == "attention"
    switches = [s for s in samples if s.event == "switch"]
    assert [s.switch_key for s in switches] == ["cache-type", "context"]
    q8 = plan(g, dataclasses.replace(options, type_k="q8_0", type_v="q8_0"))
    q8_8k = plan(g, dataclasses.replace(options, type_k="q8_0", type_v="q8_0", n_ctx=8192))
    assert switches[0].kv_bytes_reserved == q8.kv_bytes == switches[0].kv_bytes_predicted
    assert switches[0].tokens_rerun == switches[0].context_tokens > 12
    assert switches[1].kv_bytes_reserved == q8_8k.kv_bytes == 2 * q8.kv_bytes
    decodes = _decodes(samples)
    assert len(decodes) == 400  # the run went on after the refusal and through both reloads
    # The scripted reload applies between tokens 12 and 13; the live one (a press, as the window sends it) is
    # prepared on a second context while the run goes on, and applies at the token its event says.
    live_at = switches[1].token
    assert live_at >= 20 and "prepared off the token path" in switches[1].text, switches[1].text
    assert switches[1].tokens_rerun == switches[1].context_tokens
    for s in decodes:
        want = 16 * 1024 * 1024 if s.token <= 12 else q8.kv_bytes if s.token <= live_at else q8_8k.kv_bytes
        assert s.kv_bytes_reserved == s.kv_bytes_predicted == want, s.token
    cell = q8.buffers[0].row_bytes
    after = [s for s in decodes if s.token > 12]
    assert all(s.kv_bytes_held == cell * s.context_tokens for s in after)
    assert decodes[-1].cache == "q8_0"


def test_a_window_model_keeps_its_window_cells_used(tmp_path):
    """gemma3's window layers: reserved is both caches' allocation; used stops growing in the window cache."""
    path = gguf_models.gemma3(tmp_path / "g3.gguf")
    options = LlamaCppOptions(n_ctx=1024)
    predicted = plan(read_gguf(path), options)
    samples = _run(RunRequest(runtime="llama.cpp", source=str(path), options={"llama.cpp": options}, max_new_tokens=200,
                              prompt="hello"))
    decodes = _decodes(samples)
    assert all(s.kv_bytes_reserved == predicted.kv_bytes for s in decodes)
    assert [s.kv_bytes_held for s in decodes] == [predicted.used_bytes(s.context_tokens) for s in decodes]


def test_a_recording_of_a_llamacpp_run_round_trips_and_old_ones_still_read(gguf_path, tmp_path):
    from kvscope.core.base.sample import sample_from_json
    from kvscope.core.records.export import export_csv
    from kvscope.core.records.recording import RecordingReader

    path = tmp_path / "llama.jsonl"
    samples = _run(RunRequest(runtime="llama.cpp", options={"llama.cpp": LlamaCppOptions(n_ctx=512)}, max_new_tokens=12,
                              record_path=str(path), switches=((6, "cache", "q4_0"),)))
    with RecordingReader(path) as reader:
        back = list(reader)
        header = reader.header
    assert back == samples
    assert header["settings"]["runtime"] == "llama.cpp" and header["settings"]["llama_cpp"]["n_ctx"] == 512
    rows = export_csv(path, tmp_path / "llama.csv")
    assert rows == len(samples)
    csv_head = (tmp_path / "llama.csv").read_text().splitlines()[0].split(",")
    assert {"kv_bytes_held", "kv_bytes_reserved", "runtime"} <= set(csv_head)
    # A line from before the runtime field reads as a transformers sample; one from before held/reserved (observed:
    # reserved, used: held) reads as the two figures.
    old = {k: v for k, v in samples[-1].to_dict().items() if k not in ("kv_bytes_held", "kv_bytes_reserved", "runtime")}
    legacy = sample_from_json({**old, "kv_bytes_observed": samples[-1].kv_bytes_reserved,
                               "kv_bytes_used": samples[-1].kv_bytes_held})
    assert legacy.runtime == "transformers" and legacy == samples[-1].replace(runtime="transformers")
    # Untrusted: the new fields' types and ranges are checked.
    good = samples[-1].to_dict()
    for bad in ({"kv_bytes_held": -1}, {"kv_bytes_held": "4096"}, {"kv_bytes_held": True}, {"runtime": 3},
                {"kv_bytes_held": good["kv_bytes_reserved"] + 1}, {"runtime": "x" * 10_000}):
        with pytest.raises(ValueError):
            sample_from_json({**good, **bad})


def test_the_cli_runs_llamacpp_and_refuses_a_model_that_is_not_gguf(capsys, tmp_path):
    from kvscope import main

    rc = main.main(["run", "--runtime", "llama.cpp", "--tokens", "8", "--context", "1024", "--cache-type-k", "q8_0",
                    "--cache-type-v", "q8_0", "--switch", "3:attention=mqa", "--switch", "5:context=2048"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "KV reserved" in out and "KV used" in out and "[refused]" in out and "[switch]" in out
    assert "observed == predicted at 9 of 9 samples" in out
    rc = main.main(["run", "--runtime", "llama.cpp", "--tokens", "1", "--context", "0"])  # -c 0: the trained context
    assert rc == 0 and "4,096 cells" in capsys.readouterr().out
    rc = main.main(["run", "--runtime", "llama.cpp", "--model", "llama-3-8b", "--tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "runs a .gguf file" in err
    rc = main.main(["run", "--runtime", "llama.cpp", "--tokens", "2", "--switch", "1:cache-type=q3_x"])
    assert rc == 2 and "unknown llama.cpp cache type" in capsys.readouterr().err


def test_a_llamacpp_run_in_the_window_draws_reserved_and_used(qtbot, window):
    from tests.helpers import run_in_window

    controls = window.controls
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("llamacpp"))
    controls.max_context_spin.setValue(0)
    controls.max_tokens_spin.setValue(40)
    request = controls.build_request()
    assert request.runtime == "llama.cpp" and request.source == "embedded" and request.options_for("llama.cpp").n_ctx == 4096
    request = dataclasses.replace(request, switches=((20, "cache", "q8_0"),))
    run_in_window(qtbot, window, request)
    assert window.last_error == ""
    window._redraw()
    x, reserved = window.plots.curve_data("kv_reserved")
    _, used = window.plots.curve_data("kv_used")
    assert window.plots.curve_visible("kv_reserved") and window.plots.curve_visible("kv_used")
    assert not window.plots.curve_visible("kv_observed")  # no transformers cache in this run
    assert reserved[0] == 16 * 1024 * 1024 and reserved[-1] < reserved[0]  # f16, then the q8_0 reload
    assert used[-1] < reserved[-1] and used[5] > used[1]
    assert controls.cache_combo.currentData() == "q8_0"
    texts = [controls.cache_combo.itemText(i) for i in range(controls.cache_combo.count())]
    assert "reload with f16 KV" in texts and "q8_0 KV" in texts


def test_without_llama_cpp_the_window_disables_the_choice(qtbot, settings, monkeypatch):
    import kvscope.core.runtimes.llamacpp.switches
    from kvscope.ui.controls import ControlsPanel

    # The registry resolves the runtime's ``missing`` hook when asked: the window's Source list asks it.
    monkeypatch.setattr(kvscope.core.runtimes.llamacpp.switches, "llamacpp_missing",
                        lambda: "llama-cpp-python is not installed: pip install it")
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    i = panel.source_combo.findData("llamacpp")
    item = panel.source_combo.model().item(i)
    assert not item.isEnabled() and "not installed" in item.toolTip()
    panel.source_combo.setCurrentIndex(i)
    with pytest.raises(Exception, match="not installed"):
        panel.build_request()


def test_the_runtime_finds_llama_cpp_without_importing_it():
    import subprocess
    import sys

    code = ("import sys; from kvscope.core.runtimes.llamacpp.switches import llamacpp_missing; print(json.dumps([llamacpp_missing(), "
            "'llama_cpp' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [None, False]


def test_thread_mode_runs_llamacpp_too(qtbot, thread_window):
    """KVSCOPE_ENGINE=thread: the same RunDriver on a thread of the window's process dispatches to llama.cpp."""
    from tests.helpers import run_in_window

    request = RunRequest(runtime="llama.cpp", options={"llama.cpp": LlamaCppOptions(n_ctx=512)}, max_new_tokens=10)
    run_in_window(qtbot, thread_window, request)
    assert thread_window.last_error == "" and thread_window.decode_tokens == 10
    assert thread_window.info.label.endswith("(llama.cpp)")


def test_transformers_then_llamacpp_on_one_model_shows_both_curves(qtbot, window):
    """Run the embedded model with transformers, then with llama.cpp: the first run's growing cache stays on the
    KV plot, dotted, under the prepayment (the issue's "transformers' growing cache for the same model if both
    are run"); a recording played next drops it."""
    from tests.helpers import run_in_window

    controls = window.controls
    controls.max_tokens_spin.setValue(30)
    first = controls.build_request()
    assert first.runtime == "transformers" and first.source == "embedded"
    run_in_window(qtbot, window, first)
    window._redraw()
    import numpy as np

    tokens = window.plots.tokens.column("token").copy()
    grown = window.plots.tokens.column("kv_observed").copy()  # every token's observed KV, not the drawn decimation
    assert np.nanmax(grown) > np.nanmin(grown)
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("llamacpp"))
    second = controls.build_request()
    assert second.runtime == "llama.cpp" and second.source == "embedded"
    run_in_window(qtbot, window, second)
    window._redraw()
    px, py = window.plots.previous_curve.getData()
    assert window.plots.previous_curve.isVisible() and window.plots.previous_label == "before: transformers"
    ok = np.isfinite(grown)
    assert list(py) == list(grown[ok]) and list(px) == list(tokens[ok])
    _, reserved = window.plots.curve_data("kv_reserved")
    assert reserved[0] == reserved[-1] > py[-1]  # the prepaid 4K context over the 30 tokens transformers holds
    window.plots.drop_previous()
    assert not window.plots.previous_curve.isVisible()


def test_a_reload_pressed_live_is_prepared_on_a_second_context_while_the_run_goes_on(gguf_path):
    """Issue 37, item 2: F and C stood a SmolLM2-135M run still 6-12 s in llama.cpp (decoding every token again).
    A press now loads a second context and decodes the tokens so far into it on a thread while the first keeps
    generating; it applies at a later token, exactly: the new context then holds every token, one cell each; a press
    on another axis waits for it, and the decode steps meanwhile are the old context's, at its bytes."""
    options = LlamaCppOptions(n_ctx=4096)
    g = read_gguf(gguf_path)
    samples = _run(RunRequest(runtime="llama.cpp", options={"llama.cpp": options}, max_new_tokens=300),
                   polls=[(40, ("cache-type", "q8_0")), (40, ("attn-impl", "fa-off"))])
    switches = [s for s in samples if s.event in ("switch", "refused")]
    assert [(s.event, s.switch_key) for s in switches] == [("switch", "cache-type"), ("refused", "attn-impl")], \
        [s.text for s in switches]
    assert "needs flash attention" in switches[1].text  # fa-off under the q8_0 V it waited for
    q8 = plan(g, dataclasses.replace(options, type_k="q8_0", type_v="q8_0"))
    at = switches[0].token
    assert at >= 40 and "prepared off the token path" in switches[0].text
    decodes = _decodes(samples)
    assert len(decodes) == 300 and [s.token for s in decodes] == list(range(1, 301))
    for s in decodes:
        want = 16 * 1024 * 1024 if s.token <= at else q8.kv_bytes
        assert s.kv_bytes_reserved == s.kv_bytes_predicted == want, s.token
        if s.token > at:
            assert s.kv_bytes_held == q8.buffers[0].row_bytes * s.context_tokens and s.cache == "q8_0"

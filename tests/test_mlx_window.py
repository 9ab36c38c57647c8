"""The MLX runtime in the window (the engine process, the shared run loop) and the installed-model scan.

Three runtimes on one plot (issue 27, item 4): the embedded model run by transformers, then MLX, then llama.cpp;
the first two stay on the KV plot under the third, each labelled by its runtime: the growing cache, the
256-token steps, the prepayment.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvscope.core.runtimes.llamacpp.switches import llamacpp_missing
from kvscope.core.runtimes.mlx.switches import mlx_missing


@pytest.mark.slow
@pytest.mark.skipif(mlx_missing() is not None or llamacpp_missing() is not None,
                    reason=f"needs MLX and llama.cpp: {mlx_missing() or llamacpp_missing()} (make test installs both)")
def test_three_runtimes_on_one_plot(qtbot, window):
    from tests.helpers import run_in_window

    controls = window.controls
    controls.max_tokens_spin.setValue(30)
    run_in_window(qtbot, window, controls.build_request())  # transformers
    window._redraw()
    grown = window.plots.tokens.column("kv_observed").copy()
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("mlx"))
    controls.max_tokens_spin.setValue(260)  # past the first 256-token step
    mlx = controls.build_request()
    assert mlx.runtime == "mlx" and mlx.source == "embedded" and mlx.options_for("mlx").cache == "kv"
    run_in_window(qtbot, window, mlx)
    assert window.last_error == "" and window.info.label.endswith("(MLX)")
    window._redraw()
    steps = window.plots.tokens.column("kv_reserved").copy()
    predicted = window.plots.tokens.column("kv_predicted").copy()
    ok = np.isfinite(steps)
    assert set(steps[ok]) == {2 * 1024 * 1024, 4 * 1024 * 1024}  # the embedded model's 2 MiB steps
    assert list(steps[ok]) == list(predicted[ok])
    controls.source_combo.setCurrentIndex(controls.source_combo.findData("llamacpp"))
    controls.max_tokens_spin.setValue(20)
    controls.max_context_spin.setValue(512)
    run_in_window(qtbot, window, controls.build_request())
    window._redraw()
    plots = window.plots
    assert plots.previous_labels == ["before: transformers", "before: mlx kv"]
    assert plots.older_curve.isVisible() and plots.previous_curve.isVisible()
    _, older = plots.older_curve.getData()
    _, previous = plots.previous_curve.getData()
    assert list(older) == list(grown[np.isfinite(grown)])  # transformers: every token's bytes
    assert set(previous) == {2 * 1024 * 1024, 4 * 1024 * 1024}  # MLX: the steps it reserved
    _, reserved = plots.curve_data("kv_reserved")
    assert reserved[0] == reserved[-1] == 512 * 4 * 1024  # llama.cpp: 512 cells of f16 K+V reserved at load
    plots.drop_previous()
    assert not plots.previous_curve.isVisible() and not plots.older_curve.isVisible()


def test_installed_scan_marks_mlx_conversions(tmp_path):
    """An mlx-community repo in the Hugging Face cache and LM Studio's '-MLX-' folder are MLX models; a plain
    transformers folder is not."""
    from kvscope.core.model.installed import scan_installed
    from tests.test_installed import hf_repo

    config = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                         "quantization": {"group_size": 64, "bits": 4}}).encode()
    plain = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode()
    cache = tmp_path / "hub"
    rev = "a" * 40
    hf_repo(cache, "models--mlx-community--Tiny-4bit", {rev: {"config.json": config, "model.safetensors": b"x"}}, rev)
    hf_repo(cache, "models--org--Tiny", {rev: {"config.json": plain, "model.safetensors": b"x"}}, rev)
    studio = tmp_path / "home" / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-MLX-4bit"
    studio.mkdir(parents=True)
    (studio / "config.json").write_bytes(config)
    scan = scan_installed(home=tmp_path / "home", hf_cache=cache)
    kinds = {m.label: m.kind for m in scan.models}
    assert kinds == {"mlx-community/Tiny-4bit": "mlx", "org/Tiny": "hf", "Tiny-MLX-4bit": "mlx"}, kinds

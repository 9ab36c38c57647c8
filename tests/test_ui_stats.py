"""The numbers panel: what compute_stats derives from a sample, and how the tiles say it."""

from __future__ import annotations

from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.prediction.predict import kv_bytes
from kvscope.ui.stats import StatsPanel, compute_stats, kv_at_max_context
from tests.synthetic import synthetic_samples


def test_kv_at_max_context_is_the_predictors_and_is_computed_once_per_settings():
    spec = load_spec("embedded")
    last = synthetic_samples(5, prompt_tokens=4)[-1]
    kv_at_max_context.cache_clear()
    for _ in range(10):  # ten refreshes of the panel
        stats = compute_stats(last, None, spec, max_context=4096, predicted_slope=4096.0)
    assert stats.kv_at_max == kv_bytes(spec, RunSettings(weight_dtype=last.dtype), 4096)
    info = kv_at_max_context.cache_info()
    assert info.misses == 1 and info.hits == 9
    assert stats.bytes_per_token == 4096.0 and stats.bytes_per_token_source == "predicted"
    measured = compute_stats(last, 1234.0, spec, max_context=4096, predicted_slope=4096.0)
    assert measured.bytes_per_token == 1234.0 and measured.bytes_per_token_source == "measured"


def test_a_spelling_the_predictor_does_not_know_is_not_available_not_an_error():
    spec = load_spec("embedded")
    last = synthetic_samples(3, prompt_tokens=4)[-1].replace(cache="from-the-future")
    assert compute_stats(last, None, spec, max_context=4096).kv_at_max is None


def test_the_quantized_caches_drop_is_said_in_words_not_as_a_negative_size(qtbot):
    spec = load_spec("embedded")
    last = synthetic_samples(3, prompt_tokens=4)[-1].replace(cache="quantized:4")
    panel = StatsPanel()
    qtbot.addWidget(panel)
    stats = compute_stats(last, -20_000.0, spec, max_context=4096)
    panel.show_stats(stats)
    tile = panel.tiles["bytes_per_token"]
    assert tile.value.text() == "\u2193 quantized" and tile.note.text() == "residual just quantized"
    panel.show_stats(compute_stats(last, 8192.0, spec, max_context=4096))  # between two drops
    assert tile.value.text() == "8.0 KiB" and tile.note.text() == "measured"
    dynamic = compute_stats(last.replace(cache="dynamic"), -1.0, spec, max_context=4096)
    assert dynamic.bytes_per_token_source == "measured"  # only the quantized cache has a residual to explain


def test_a_llamacpp_run_is_prepaid(qtbot):
    """llama.cpp allocated the context at load: the KV now is that allocation, a token fills a paid cell (KV per
    token = used / tokens), the KV at the max context is the same allocation, and the context is the limit."""
    spec = load_spec("embedded")
    last = synthetic_samples(5, prompt_tokens=4)[-1].replace(
        runtime="llama.cpp", kv_bytes_reserved=16_777_216, kv_bytes_predicted=16_777_216, context_tokens=100,
        kv_bytes_held=100 * 4096)
    stats = compute_stats(last, None, spec, max_context=4096, host_available=8 << 30)
    assert (stats.kv_now, stats.kv_at_max, stats.bytes_per_token, stats.tokens_fit) == (16_777_216, 16_777_216, 4096.0,
                                                                                        3996)
    assert stats.prepaid and stats.kv_error_pct == 0.0
    panel = StatsPanel()
    qtbot.addWidget(panel)
    panel.show_stats(stats)
    assert panel.tiles["kv_at_max"].value.text() == "16.0 MiB" and "already paid" in panel.tiles["kv_at_max"].note.text()
    assert "allocated at load" in panel.tiles["kv_now"].note.text()
    assert "allocated context" in panel.tiles["tokens_fit"].note.text()


def test_a_prepaid_run_with_sliding_layers_says_the_allocation_and_the_cells_a_token_fills():
    """Issue 37, item 5: a model with sliding layers holds a window there, so held / tokens falls as the run goes on;
    scaled by the context it read 72.0 MiB, drifting to 30.9 MiB, under a 27.0 MiB allocation. The KV at max context
    is the runtime's own allocation, and KV per token the growth of the held bytes (the slope of the used curve)."""
    spec = load_spec("embedded")
    reserved = 27 * 2**20
    for tokens, held in ((300, 3 * 2**20), (3000, 9 * 2**20)):  # early: held/tokens x 4096 = 40 MiB > 27 MiB
        last = synthetic_samples(5, prompt_tokens=4)[-1].replace(
            runtime="llama.cpp", kv_bytes_reserved=reserved, kv_bytes_held=held, context_tokens=tokens)
        stats = compute_stats(last, 2048.0, spec, max_context=4096)
        assert stats.kv_at_max == reserved and stats.kv_now == reserved
        assert stats.bytes_per_token == 2048.0 and stats.bytes_per_token_source == "cells filled per token, prepaid"
    mlx = synthetic_samples(5, prompt_tokens=4)[-1].replace(
        runtime="mlx", kv_bytes_reserved=256 * 4096, kv_bytes_held=100 * 4096, context_tokens=100)
    stats = compute_stats(mlx, 4096.0, spec, max_context=4096)
    assert not stats.prepaid  # 256-token steps: the KV at the max context is still to be paid
    assert stats.kv_now == 100 * 4096 and stats.bytes_per_token_source == "measured"

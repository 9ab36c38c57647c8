"""Issue 16: token-selecting caches (sink:S+W, h2o:B+W) live in the engine, exact at every sample, across
switches in and out of them, on the embedded model, a sliding-window architecture and an MLA one; the
quality probe; calc's flat line; the choices per axis; the recording fields."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvscope.core.live.run import RunHooks, run_generation
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.caches import HeavyHitter, SinkWindow, parse_cache
from kvscope.core.model.request import RunRequest
from kvscope.core.model.settings import RunSettings, cache_choices, selecting_cache_keys
from kvscope.core.runtimes.transformers.engine import Engine
from kvscope.core.runtimes.transformers.loading import load_model
from kvscope.core.runtimes.transformers.measure import cache_bytes
from tests import archs, helpers

_one_thread = pytest.fixture(autouse=True, scope="module")(helpers.one_torch_thread)


@pytest.fixture(scope="module")
def embedded():
    return load_model("embedded", device="cpu")


@pytest.fixture(scope="module")
def arch_root(tmp_path_factory):
    return tmp_path_factory.mktemp("sparse-archs")


def _exact(sample, what: str) -> None:
    assert sample.kv_bytes_reserved == sample.kv_bytes_predicted, (
        f"{what}: token {sample.token} ({sample.context_tokens} in context) observed {sample.kv_bytes_reserved:,} "
        f"!= predicted {sample.kv_bytes_predicted:,} ({sample.attention}, {sample.attn_impl}, {sample.cache})")


def _engine(loaded, settings: RunSettings | None = None, prompt: str = "Every token keeps a key and a value",
            **kwargs) -> Engine:
    engine = Engine(loaded, settings or RunSettings(), seed=0, **kwargs)
    ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
    _exact(engine.prefill(ids, prompt), "prefill")
    return engine


def _steps(engine: Engine, n: int, what: str) -> list:
    out = []
    for _ in range(n):
        sample = engine.step()
        _exact(sample, what)
        out.append(sample)
    return out


def _no_hooks(engine: Engine) -> None:
    models = [m for m in (engine.base_model, engine.model) if m is not None]
    assert not any(m._forward_hooks for model in models for m in model.modules()), "h2o hooks left on the model"


# ------------------------------------------------------------------------------------------------ embedded model


@pytest.mark.parametrize("key", ["sink:4+12", "h2o:8+8"])
def test_from_the_start_flat_at_capacity(embedded, key):
    """Started with the strategy (h2o takes eager and says so); the prompt of 9 tokens grows to 16 and stays there."""
    engine = _engine(embedded, RunSettings(cache=parse_cache(key)))
    strategy = engine.settings.cache
    if strategy.needs_attention_weights:
        assert engine.settings.attn_impl == "eager" and any("eager" in note for note in engine.notes)
    samples = _steps(engine, 30, key)
    at_capacity = [s.kv_bytes_reserved for s in samples if s.context_tokens >= strategy.capacity]
    assert len(set(at_capacity)) == 1 and len(at_capacity) > 10
    assert samples[0].kv_bytes_reserved < at_capacity[0]  # it grew up to the capacity first
    _no_hooks(engine)


def test_switches_in_and_out_exact_at_every_sample(embedded):
    """dynamic -> sink (copied across) -> attention changes under it -> h2o (the kernel goes eager; re-run for
    the scores) -> attention under h2o (re-run: per-head selections) -> sdpa refused -> out again (re-run:
    the dropped tokens are gone) -> a window with a sink cache; MLA (a latent of the model's own K/V, a dynamic
    cache of its own) refused under sink and h2o, then in and out from dynamic."""
    engine = _engine(embedded)
    _steps(engine, 4, "dynamic")
    plan = [("cache", "sink:4+12"), ("attention", "gqa:2"), ("attention", "mqa"), ("cache", "sink:2+6"),
            ("cache", "h2o:6+6"), ("attention", "gqa:4"), ("cache", "dynamic"), ("attention", "mha"),
            ("cache", "sink:3+9"), ("attention", "window:8"), ("attention", "mha"), ("mla refused", "sink"),
            ("cache", "dynamic"), ("attention", "mla"), ("attention", "mha"), ("cache", "h2o:5+5"),
            ("mla refused", "h2o"), ("cache", "dynamic")]
    events = []
    for key, value in plan:
        if key == "mla refused":
            with pytest.raises(SettingsError, match="dynamic cache of its own"):
                engine.apply("attention", "mla")
            continue
        event = engine.apply(key, value)
        assert event.event == "switch", event.text
        _exact(event, f"{key}={value} event")
        events.append(event)
        _steps(engine, 6, f"after {key}={value}")
        _no_hooks(engine)
    text = {f"{e.switch_key}={e.switch_after}": e.text for e in events}
    assert "cache moved across" in text["cache=sink:4+12"]
    assert "attn-impl sdpa -> eager" in text["cache=h2o:6+6"] and events[4].attn_impl == "eager"
    assert events[4].tokens_rerun == events[4].context_tokens  # scored by running the tokens so far
    assert "K/V head" in text["attention=gqa:4"] and events[5].tokens_rerun
    assert "dropped" in text["cache=dynamic"] and events[6].tokens_rerun
    assert engine.seq_len == engine.prompt_tokens + engine.generated


def test_kernel_away_from_eager_is_refused_while_h2o_runs(embedded):
    engine = _engine(embedded)
    _steps(engine, 3, "dynamic")
    engine.apply("cache", "h2o:4+4")
    _steps(engine, 3, "h2o")
    before = (engine.settings, engine.kernel, cache_bytes(engine.cache).logical, engine.seq_len)
    for impl in ("sdpa", "flash"):
        with pytest.raises(SettingsError, match="only eager attention returns"):
            engine.apply("attn-impl", impl)
    assert (engine.settings, engine.kernel, cache_bytes(engine.cache).logical, engine.seq_len) == before
    engine.apply("cache", "sink:4+4")
    assert engine.apply("attn-impl", "sdpa").event == "switch"  # once h2o has gone, sdpa is fine again
    _steps(engine, 3, "sink on sdpa")


def test_a_failed_switch_into_h2o_changes_nothing(embedded, monkeypatch):
    """The switch transaction covers the token-selecting caches: a failure in the trial pass restores the cache,
    the kernel and the settings exactly, and leaves no hook on the model."""
    engine = _engine(embedded)
    _steps(engine, 3, "dynamic")
    before = (engine.settings, engine.kernel, cache_bytes(engine.cache).logical, engine.seq_len,
              engine.base_model.config._attn_implementation)
    helpers.fail_the_trial_pass(monkeypatch)
    with pytest.raises(SettingsError, match="nothing was changed"):
        engine.apply("cache", "h2o:4+4")
    monkeypatch.undo()
    assert (engine.settings, engine.kernel, cache_bytes(engine.cache).logical, engine.seq_len,
            engine.base_model.config._attn_implementation) == before
    _no_hooks(engine)
    _steps(engine, 3, "after the refusal")


def test_sink_keeps_exactly_the_first_and_last_tokens(embedded):
    """The first layer's held keys and values are the first S and the last W of what a dynamic cache holds for
    the same tokens (they depend on the token and its position only; deeper layers see the evicted context)."""
    sink = _engine(embedded, RunSettings(cache=parse_cache("sink:2+5")))
    full = _engine(embedded)
    for _ in range(6):
        token = sink._sample_next()
        for engine in (sink, full):
            engine._sample_next = lambda token=token: token
            engine.step()
    ours, theirs = sink.cache.layers[0], full.cache.layers[0]
    assert sink.seq_len == full.seq_len > 7 and ours.keys.shape[-2] == 7
    for name in ("keys", "values"):
        held = getattr(theirs, name)
        assert torch.allclose(getattr(ours, name), torch.cat([held[:, :, :2], held[:, :, -5:]], dim=-2), atol=1e-5)


def test_h2o_keeps_the_heaviest_hitters():
    """One layer by hand: the old tokens with the most attention so far stay, in time order, plus the window."""
    from kvscope.core.runtimes.transformers.sparse_caches import HeavyHitterLayer

    layer = HeavyHitterLayer(budget=2, window=2)
    keys = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    layer.update(keys, keys)
    weights = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.0, 0.0]).view(1, 1, 1, 6)
    layer.observe_attention(weights)
    assert layer.keys.flatten().tolist() == [1.0, 3.0, 4.0, 5.0]
    assert layer.scores.flatten().tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert layer.get_seq_length() == 6 and layer.get_mask_sizes(1) == (5, 2)


# ------------------------------------------------------------------------------------------------ other architectures


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "deepseek_v3"])
def test_sliding_window_and_mla_architectures(model_type, arch_root):
    """Mistral (every layer slides: the sinks change nothing, exactly), Gemma 3 (local + global layers: only the
    global ones are bounded) and DeepSeek-V3 (MLA: the latent is evicted like K/V), in and out of both."""
    try:
        folder = archs.build_tiny_folder(model_type, arch_root)
    except archs.TinyBuildError as exc:
        pytest.skip(str(exc))
    loaded = load_model(str(folder), device="cpu")
    engine = _engine(loaded, prompt="Every token keeps a key and a value in every layer")
    _steps(engine, 3, "native")
    for key, value in [("cache", "sink:3+6"), ("cache", "h2o:4+5"), ("cache", "sink:2+4"), ("cache", "dynamic"),
                       ("cache", "h2o:3+3"), ("cache", "dynamic")]:
        try:
            event = engine.apply(key, value)
        except SettingsError as exc:
            pytest.fail(f"{model_type}: {key}={value} refused: {exc}")
        _exact(event, f"{key}={value}")
        _steps(engine, 5, f"{model_type} after {key}={value}")
        _no_hooks(engine)


def test_dsa_indexer_layers_are_refused_before_anything_changes():
    """DeepSeek-V3.2's indexer keys cannot be evicted with the K/V: calc and the predictor refuse it in one line."""
    from dataclasses import replace

    from kvscope.core.model.sources import load_spec
    from kvscope.core.model.spec import INDEXED_ATTENTION
    from kvscope.core.prediction.predict import kv_bytes

    spec = load_spec("embedded")
    dsa = replace(spec, layer_types=(INDEXED_ATTENTION,) * spec.num_layers, indexer_head_dim=16)
    with pytest.raises(SettingsError, match="indexer"):
        kv_bytes(dsa, RunSettings(cache=parse_cache("sink:4+60")), 100)


# ------------------------------------------------------------------------------------------------ the run and the CLI


def test_run_goes_flat_at_64_tokens_after_the_switch(embedded):
    """The issue's command, shortened: --switch 10:cache=sink:4+60 grows to 64 tokens' worth, then stays flat."""
    from kvscope.core.prediction.predict import kv_bytes

    per_token = kv_bytes(embedded.spec, RunSettings(weight_dtype=embedded.dtype), 1)
    emitted, infos = [], []
    run_generation(RunRequest(device="cpu", max_new_tokens=90, switches=((10, "cache", "sink:4+60"),)),
                   RunHooks(emit=emitted.append, loaded=infos.append))
    # What the window's cache combo and C key cycle through: the sizes made for this model's context.
    assert [k for k, _ in infos[0].cache_choices][-2:] == ["sink:4+252", "h2o:128+128"]
    tokens = [s for s in emitted if not s.is_event]
    for s in emitted:
        if s.kv_bytes_predicted is not None and s.kv_bytes_reserved is not None:
            _exact(s, "run")
    flat = [s.kv_bytes_reserved for s in tokens if s.token > 10 and s.context_tokens >= 64]
    assert len(flat) > 20 and set(flat) == {64 * per_token}
    assert all(s.kv_bytes_reserved == s.context_tokens * per_token for s in tokens if s.context_tokens < 64)


def test_quality_probe_off_by_default_and_exact_twin(embedded):
    """Off: no fields. On with a dynamic cache: the twin is the same cache, top-1 always the same and KL 0. On with
    a sink cache that has dropped tokens: measured, finite, and the KV bytes are still the sink cache's."""
    plain = _engine(embedded)
    assert all(s.quality_top1 is None and s.quality_kl is None for s in _steps(plain, 3, "no probe"))
    twin = _engine(embedded, quality_probe=True)
    same = _steps(twin, 5, "probe on dynamic")
    assert all(s.quality_top1 == 1 and s.quality_kl == pytest.approx(0.0, abs=1e-6) for s in same)
    twin.apply("cache", "sink:2+4")
    sparse = _steps(twin, 8, "probe on sink")
    assert all(s.quality_top1 in (0, 1) and math.isfinite(s.quality_kl) and s.quality_kl >= 0 for s in sparse)
    assert max(s.quality_kl for s in sparse) > 1e-4  # a cache that dropped tokens sees different text
    twin.apply("attention", "gqa:2")  # the twin follows the model (rebuilt from the tokens so far)
    _steps(twin, 3, "probe after an attention switch")


def test_quality_probe_in_the_terminal_and_the_recording(tmp_path, capsys):
    from kvscope.core.live.terminal import run_terminal
    from kvscope.core.records.recording import RecordingReader

    record = tmp_path / "q.jsonl"
    run_terminal(RunRequest(device="cpu", max_new_tokens=12, switches=((4, "cache", "sink:2+4"),),
                            record_path=str(record), quality_probe=True))
    out = capsys.readouterr().out
    assert "top-1" in out and "KL (nats)" in out and "quality probe on" in out
    assert "quality probe (against the model as loaded, teacher-forced): top-1 the same at" in out
    with RecordingReader(record) as reader:
        samples = [s for s in reader if not s.is_event]
    assert all(s.quality_top1 in (0, 1) and s.quality_kl is not None for s in samples)


def test_recordings_with_and_without_quality_fields_read():
    from kvscope.core.base.sample import sample_from_json

    engine = _engine(load_model("embedded", device="cpu"), quality_probe=True)
    sample = engine.step().to_dict()
    assert sample_from_json(sample).quality_top1 == 1
    old = {k: v for k, v in sample.items() if not k.startswith("quality_")}
    assert sample_from_json(old).quality_kl is None  # recordings made before the probe
    for bad in ({"quality_top1": 2}, {"quality_top1": True}, {"quality_kl": -1.0}, {"quality_kl": float("nan")},
                {"quality_kl": "0.1"}):
        with pytest.raises(ValueError, match="quality_"):
            sample_from_json(sample | bad)
    json.dumps(sample)  # plain JSON


# ------------------------------------------------------------------------------------------------ choices and calc


def test_choices_and_parsing():
    from kvscope.core.model.sources import load_spec

    assert parse_cache("sink:4+252") == SinkWindow(4, 252) and parse_cache("h2o:128+128") == HeavyHitter(128, 128)
    assert str(parse_cache("SINK:0+64")) == "sink:0+64"
    for bad in ("sink", "sink:4", "sink:4+0", "sink:a+b", "h2o:-1+4", "sink:9999999999999+1"):
        with pytest.raises(SettingsError):
            parse_cache(bad)
    keys = [k for k, _ in cache_choices("cpu", load_spec("embedded"))]
    assert keys[-2:] == ["sink:4+252", "h2o:128+128"]  # 4,096 positions: the 256-token demo size only
    assert selecting_cache_keys(load_spec("mistral-7b")) == ("sink:4+4092", "sink:4+252", "h2o:2048+2048",
                                                             "h2o:128+128")
    assert all(reason is None for k, reason in cache_choices() if k.startswith(("sink", "h2o")))


def test_calc_shows_the_flat_line_beyond_s_plus_w(capsys):
    from kvscope.core.model.sources import load_spec
    from kvscope.core.prediction.calc import calculate, render_table

    spec = load_spec("llama-3-8b")
    result = calculate(spec, RunSettings(cache=parse_cache("sink:4+252")), [128, 256, 257, 4096, 131_072])
    kv = [p.breakdown.kv_cache for p in result.rows]
    assert kv[0] == 128 * 131_072 and kv[1] == kv[2] == kv[3] == kv[4] == 256 * 131_072
    assert result.overtakes_at is None  # 32 MiB of KV never overtakes 16 GB of weights
    table = render_table(result)
    assert "cache sink:4+252" in table and "flat from 256 tokens on" in table
    h2o = calculate(spec, RunSettings(cache=parse_cache("h2o:128+128"), attn_impl="eager"), [100_000])
    assert h2o.rows[0].breakdown.kv_cache == 256 * 131_072 + 32 * 8 * 256 * 4  # + a float32 score per KV head


def test_calculator_tab_offers_the_sizes_of_the_model(qtbot):
    from kvscope.core.model.sources import load_spec
    from kvscope.ui.calculator import CalculatorTab

    tab = CalculatorTab()
    qtbot.addWidget(tab)
    tab.set_spec(load_spec("mistral-7b"))
    items = [tab.cache_combo.itemText(i) for i in range(tab.cache_combo.count())]
    assert items[-4:] == ["sink:4+4092", "sink:4+252", "h2o:2048+2048", "h2o:128+128"]
    tab.cache_combo.setCurrentText("h2o:128+128")
    assert tab.current_settings().attn_impl == "eager"  # as the engine runs it
    tab.set_spec(load_spec("embedded"))  # the chosen strategy stays chosen across models
    assert tab.cache_combo.currentText() == "h2o:128+128"


def test_the_kl_curve_is_the_quality_strips_only_when_measured(qtbot):
    from kvscope.core.base.sample import PHASE_DECODE, Sample
    from kvscope.ui.plots import LivePlots

    plots = LivePlots()
    qtbot.addWidget(plots)

    def sample(token: int, kl: float | None) -> Sample:
        return Sample(token=token, phase=PHASE_DECODE, time_s=0.01 * token, text="x", attention="mha", attn_impl="sdpa",
                      cache="sink:4+60", kernel="sdpa", device="cpu", dtype="float32",
                      kv_bytes_held=8192 * token, kv_bytes_reserved=8192 * token,
                      kv_bytes_storage=None, weights_bytes=1, kv_bytes_predicted=8192 * token, quality_top1=1,
                      quality_kl=kl)

    plots.add_samples([sample(t, None) for t in range(1, 5)])
    plots.redraw()
    assert plots.quality.isHidden() and not plots.kv_plot.getAxis("right").isVisible()  # the probe is off
    plots.add_samples([sample(t, 0.5 * t) for t in range(5, 40)])
    plots.redraw()
    assert not plots.quality.isHidden() and "quality_kl" not in plots._curves  # the strip's, not the KV plot's
    assert plots._curves["quality_kl_mean"].y_range[1] == pytest.approx(sum(0.5 * t for t in range(8, 40)) / 32)
    plots.reset()
    assert plots.quality.isHidden() and not plots.kv_plot.getAxis("right").isVisible()


def test_sink_without_sinks_is_transformers_sliding_window(embedded):
    """sink:0+64 holds the last 64 tokens and attends them plus the new one: transformers' own sliding window of
    65 (DynamicSlidingWindowLayer, a Mistral twin of the model) gives the same logits, to the bit."""
    from kvscope.core.model.attention import parse_attention

    def logits(settings: RunSettings) -> torch.Tensor:
        engine = _engine(embedded, settings)
        tokens = torch.randint(3, 200, (90,), generator=torch.Generator().manual_seed(5))
        out = [engine._next_logits.clone()]
        for t in tokens:
            engine._sample_next = lambda t=t: t.view(1, 1)
            _exact(engine.step(), settings.cache.key)
            out.append(engine._next_logits.clone())
        return torch.stack(out)

    window = logits(RunSettings(attention=parse_attention("window:65")))
    assert torch.equal(logits(RunSettings(cache=parse_cache("sink:0+64"))), window)

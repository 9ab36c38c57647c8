"""A live switch is all or nothing (core/runtimes/transformers/transaction.py, Engine.apply), and errors in a run are data."""

from __future__ import annotations

import json

import pytest
import torch

from kvscope.core.live.run import RunHooks, run_generation
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.request import RunRequest
from kvscope.core.model.settings import RunSettings
from kvscope.core.runtimes.transformers import convert
from kvscope.core.runtimes.transformers.engine import Engine
from kvscope.core.runtimes.transformers.loading import load_model
from kvscope.core.runtimes.transformers.measure import cache_bytes
from tests import helpers


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model("embedded", device="cpu")


def _engine(tokens: int = 3) -> Engine:
    engine = Engine(load_model("embedded", device="cpu"), RunSettings(), seed=0)
    ids = engine.loaded.tokenizer("Every token keeps a key and a value", return_tensors="pt")["input_ids"]
    engine.prefill(ids, "p")
    for _ in range(tokens):
        engine.step()
    return engine


def _fingerprint(engine: Engine):
    attn = engine.base_model.model.layers[0].self_attn
    return (engine.mode.key, engine.settings, engine.model is engine.base_model, id(attn.k_proj.weight),
            attn.k_proj.out_features, attn.num_key_value_groups, engine.base_model.config.num_key_value_heads,
            cache_bytes(engine.cache).logical, engine.cache.get_seq_length(), engine.kernel)


def _next_tokens(engine: Engine, n: int = 4):
    return [engine.step() for _ in range(n)]


@pytest.mark.parametrize("fail_in", ["layer pattern", "cache conversion", "merged cache conversion", "trial pass"])
def test_a_switch_that_fails_halfway_changes_nothing(fail_in, monkeypatch):
    """mqa converts k_proj/v_proj first; a failure after that (the next step, the cache, the trial forward
    pass) must leave the model, the cache and the settings exactly as before, and generation identical
    to an engine that was never asked to switch."""
    reference, engine = _engine(), _engine()
    before = _fingerprint(engine)
    if fail_in == "layer pattern":
        monkeypatch.setattr(Engine, "_layer_pattern_model", lambda self, eff: (_ for _ in ()).throw(RuntimeError("boom")))
    elif fail_in == "cache conversion":
        # The model gets 1 K/V head but the cache keeps 8: only the trial pass can notice.
        monkeypatch.setattr(convert, "convert_cache_kv_heads", lambda cache, old, new: True)
    elif fail_in == "merged cache conversion":  # the aligned merge's own path (mqa), the cache left unmerged
        from kvscope.core.runtimes.transformers import merge

        monkeypatch.setattr(merge, "merge_cache", lambda cache, merges, held: None)
    else:
        helpers.fail_the_trial_pass(monkeypatch)
    with pytest.raises(SettingsError, match="nothing was changed"):
        engine.apply("attention", "mqa:mean" if fail_in == "cache conversion" else "mqa")
    monkeypatch.undo()
    assert _fingerprint(engine) == before
    ours, theirs = _next_tokens(engine), _next_tokens(reference)
    assert [s.text for s in ours] == [s.text for s in theirs]
    assert all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in ours)
    assert torch.equal(engine._next_logits, reference._next_logits)


def test_refusals_name_the_reason_before_touching_anything():
    engine = _engine()
    before = _fingerprint(engine)
    with pytest.raises(SettingsError, match="gqa:3 does not divide 8 query heads"):
        engine.apply("attention", "gqa:3")
    engine.apply("cache", "quantized:4")
    # A quantized cache refuses sliding layers: said before any conversion.
    with pytest.raises(SettingsError, match="quantized cache needs full-attention layers"):
        engine.apply("attention", "window:8")
    assert engine.mode.key == "mha" and engine.settings.cache.key == "quantized:4"
    engine.apply("cache", "dynamic")
    assert _fingerprint(engine)[0] == before[0]


def test_quantized_shapes_are_checked_at_every_future_requantization():
    """quanto groups 64 elements: with one K/V head of 32 dims, an odd token count cannot be grouped. The
    switch is refused now, not at the residual flush 128 tokens later (the ValueError seen on stage)."""
    engine = Engine(load_model("embedded", device="cpu"), RunSettings(), seed=0)
    ids = engine.loaded.tokenizer("abc", return_tensors="pt")["input_ids"]
    assert ids.shape[1] % 2 == 1
    engine.prefill(ids, "abc")
    engine.apply("cache", "quantized:4")
    with pytest.raises(SettingsError, match=r"quantized at \d+ tokens: quanto cannot quantize"):
        engine.apply("attention", "mqa")
    assert all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in _next_tokens(engine, 3))


def test_a_switch_to_the_current_setting_says_no_change():
    engine = _engine()
    event = engine.apply("attention", "mha")
    assert event.event == "note" and "no change" in event.text
    event = engine.apply("attn-impl", "sdpa")
    assert event.event == "note" and "no change" in event.text


def test_the_kernel_is_measured_not_named():
    engine = _engine()
    assert engine.kernel.startswith("sdpa-")  # the backend PyTorch picked, e.g. sdpa-flash-cpu
    event = engine.apply("attn-impl", "eager")
    assert engine.kernel == "eager" and "kernel eager" in event.text


def test_an_error_in_a_run_is_an_event_in_the_recording(tmp_path, monkeypatch):
    real = Engine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("kernel exploded")
        return real(self)

    monkeypatch.setattr(Engine, "step", step)
    record = tmp_path / "r.jsonl"
    seen = []
    with pytest.raises(RuntimeError, match="kernel exploded"):
        run_generation(RunRequest(device="cpu", max_new_tokens=10, record_path=str(record)), RunHooks(emit=seen.append))
    last = json.loads(record.read_text().splitlines()[-1])
    assert last["event"] == "error" and seen[-1].event == "error"
    assert last["text"].startswith("RuntimeError: kernel exploded (at token 2; attention mha, attn-impl sdpa, cache dynamic)")


def test_switches_travel_as_data_and_old_recordings_read_alike(tmp_path):
    """Issue 13: a switch, a refusal and a no-op carry key / before / after / tokens re-run as fields
    (the text is their prose); the window reads the fields, never the text. Recordings made before
    (the shipped demo) get the same fields from the reader."""
    from kvscope.core.base.sample import sample_from_json
    from kvscope.core.records.recording import RecordingReader
    from kvscope.ui.file_actions import demo_recording_path

    record = tmp_path / "r.jsonl"
    request = RunRequest(max_new_tokens=12, record_path=str(record), settings=RunSettings(),
                         switches=((3, "attention", "gqa:2"), (5, "attention", "mla"), (7, "attention", "mla"),
                                   (9, "attn_impl", "eager"), (9, "attention", "gqa:3"), (10, "attention", "window:8")))
    emitted = []
    run_generation(request, RunHooks(emit=emitted.append))
    events = [s for s in emitted if s.is_event and s.switch_key]
    assert [(s.event, s.switch_key, s.switch_before, s.switch_after) for s in events] == [
        ("switch", "attention", "mha", "gqa:2"), ("switch", "attention", "gqa:2", "mla"),
        ("note", "attention", "mla", "mla"), ("switch", "attn-impl", "sdpa", "eager"),
        ("refused", "attention", "mla", "gqa:3"),  # 3 groups do not divide 8 query heads
        ("switch", "attention", "mla", "window:8")]
    assert events[0].tokens_rerun is None and events[1].tokens_rerun > 10  # MLA re-runs the tokens
    assert events[5].tokens_rerun == events[1].tokens_rerun + 5  # and so does leaving it
    assert events[4].cache == "dynamic" and "refused" in events[4].text  # the settings in force, the reason
    with RecordingReader(record) as reader:
        assert [s.switch_after for s in reader if s.switch_key] == [s.switch_after for s in events]
    with RecordingReader(demo_recording_path()) as reader:
        demo = [(s.switch_key, s.switch_after) for s in reader if s.event == "switch"]
    assert demo[:3] == [("attention", "gqa:4"), ("attention", "gqa:2"), ("attention", "mqa")] and len(demo) == 6
    legacy = sample_from_json(events[1].to_dict() | {"switch_key": None, "switch_before": None, "switch_after": None,
                                                     "tokens_rerun": None})
    assert (legacy.switch_key, legacy.switch_before, legacy.switch_after, legacy.tokens_rerun) == \
        ("attention", "gqa:2", "mla", events[1].tokens_rerun)


def test_a_head_switch_frees_q_k_v_loaded_as_views_of_one_fused_tensor():
    """transformers loads some checkpoints' fused q/k/v weight as three views of one tensor (Sarvam-MoE): after the
    K/V projections are replaced, q_proj gets a tensor of its own, so the fused one (old K/V rows included) is freed
    and the weights are what the prediction says."""
    engine = _engine()
    with torch.no_grad():
        for layer in engine.base_model.model.layers:
            attn = layer.self_attn
            parts = (attn.q_proj, attn.k_proj, attn.v_proj)
            fused = torch.cat([p.weight.detach() for p in parts])
            start = 0
            for proj in parts:
                rows = proj.weight.shape[0]
                proj.weight = torch.nn.Parameter(fused[start:start + rows], requires_grad=False)
                start += rows
    event = engine.apply("attention", "mqa")
    assert event.event == "switch" and event.weights_bytes == event.weights_predicted
    attn = engine.base_model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().nbytes() == attn.q_proj.weight.numel() * attn.q_proj.weight.element_size()
    assert all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in _next_tokens(engine, 2))


def test_a_head_switch_is_refused_where_layers_share_their_k_v_projections():
    """One attention block serving several layers (Zamba's shared block, HRM's cycles): the prediction counts K/V rows
    per layer, the model has fewer, so the switch is refused before anything changes, saying why."""
    engine = _engine()
    first, second = (layer.self_attn for layer in engine.base_model.model.layers[:2])
    second.k_proj, second.v_proj = first.k_proj, first.v_proj
    before = _fingerprint(engine)
    with pytest.raises(SettingsError, match="share .* K/V projection"):
        engine.apply("attention", "mqa")
    assert _fingerprint(engine) == before

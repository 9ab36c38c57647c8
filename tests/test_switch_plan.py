"""A switch is a value (issue 36, item 2): ``switches.plan`` answers the target or the refusal and its reason,
whether it may re-run, what it converts; the window greys with it (``switch_problem``) and the engine refuses with
the same words (one rule set); its light half imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.runtimes import switch_problem as registry_switch_problem
from kvscope.core.runtimes.transformers import switches
from kvscope.core.runtimes.transformers.switches import SwitchState, plan, switch_problem


def _state(spec, device="cpu", **fields):
    now = {"attention": switches.native_attention(spec).key, "attn-impl": "sdpa", "cache": "dynamic"}
    now.update({k.replace("_", "-"): v for k, v in fields.pop("now", {}).items()})
    return SwitchState.of(now, device, **fields)


def test_the_light_half_imports_neither_torch_nor_transformers():
    code = ("import sys; from kvscope.core.runtimes.transformers import switches; "
            "from kvscope.core.model.sources import load_spec; s = load_spec('embedded'); "
            "st = switches.SwitchState.of({'attention': 'gqa:4', 'attn-impl': 'sdpa', 'cache': 'dynamic'}, 'cpu', "
            "tokens=10); switches.plan(s, st, 'cache', 'quantized:4'); switches.plan(s, st, 'attention', 'mla'); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_plan_says_target_refusal_rerun_and_what_converts():
    spec = load_spec("embedded")
    state = _state(spec, tokens=100)
    h2o = plan(spec, state, "cache", "h2o:32+32")
    # h2o scores tokens by attention: eager comes along, and the tokens so far go through the model again.
    assert (h2o.refusal, h2o.eager_for, h2o.target.attn_impl, h2o.reruns) == (None, "sdpa", "eager", True)
    assert h2o.converts == ("cache", "kernel") and h2o.fields() == {
        "switch_key": "cache", "switch_before": "dynamic", "switch_after": "h2o:32+32"}
    static = plan(spec, state, "cache", "static")
    assert (static.refusal, static.reruns, static.converts) == (None, False, ("cache",))
    offloaded = plan(spec, state, "cache", "offloaded")
    assert offloaded.refusal.startswith("the offloaded cache needs CUDA (this run is on cpu)")
    assert offloaded.converts == () and not offloaded.reruns
    assert plan(spec, state, "cache", "dynamic").no_change
    # A static cache too short for what the run still generates is refused before anything converts.
    short = plan(spec, _state(spec, tokens=100, max_context=120, ahead=50), "cache", "static")
    assert short.refusal and "static cache of 120" in short.refusal, short.refusal
    # Leaving a window of 16 after 100 tokens: the full layers need tokens the window dropped.
    windowed = _state(spec, tokens=100, now={"attention": "window:16"})
    assert plan(spec, windowed, "attention", switches.native_attention(spec).key).reruns
    assert not plan(spec, _state(spec, tokens=0, now={"attention": "window:16"}), "attention",
                    switches.native_attention(spec).key).reruns  # nothing to re-run before the prefill
    with pytest.raises(SettingsError, match="unknown setting"):
        plan(spec, state, "colour", "blue")


def test_the_window_greys_with_the_plans_words_through_the_registry():
    spec = load_spec("embedded")
    now = {"attention": "window:16", "attn-impl": "sdpa", "cache": "dynamic"}
    why = switch_problem(spec, "cpu", now, "cache", "quantized:4")
    assert why == plan(spec, SwitchState.of(now, "cpu"), "cache", "quantized:4").refusal
    assert why.startswith("a quantized cache needs full-attention layers")
    assert registry_switch_problem("transformers", spec, "cpu", now, "cache", "quantized:4") == why
    assert switch_problem(spec, "cpu", now, "cache", "nonsense").startswith("unknown cache")
    assert switch_problem(spec, "cuda:0", now, "cache", "offloaded") is None


def test_the_engine_refuses_with_the_plans_reason_and_changes_nothing():
    """One rule set: what the window greys is what the engine refuses, in the same words."""
    from kvscope.core.runtimes.transformers.engine import Engine
    from kvscope.core.runtimes.transformers.loading import load_model

    torch.set_num_threads(1)
    engine = Engine(load_model("embedded", device="cpu"), RunSettings(), seed=0)
    ids = engine.loaded.tokenizer("Every token keeps a key and a value", return_tensors="pt")["input_ids"]
    engine.prefill(ids, "p")
    engine.step()
    engine.apply("attention", "window:4")
    now = {"attention": engine.mode.key, "attn-impl": engine.settings.attn_impl, "cache": engine.settings.cache.key}
    for key, value in (("cache", "offloaded"), ("cache", "quantized:4"), ("attention", "window:1")):
        expected = switch_problem(engine.spec, engine.device, now, key, value, tokens=engine.seq_len)
        assert expected, (key, value)
        state = engine.state.copy()
        with pytest.raises(SettingsError) as refused:
            engine.apply(key, value)
        assert str(refused.value) == expected
        assert engine.state == state  # nothing changed
    # What the plan allows, the engine applies, and the state it leaves is what the plan said.
    answer = plan(engine.spec, SwitchState.of(now, "cpu", tokens=engine.seq_len), "cache", "h2o:8+8")
    event = engine.apply("cache", "h2o:8+8")
    assert (event.event, event.cache, event.attn_impl) == ("switch", answer.after, answer.target.attn_impl)
    assert bool(event.tokens_rerun) == answer.reruns

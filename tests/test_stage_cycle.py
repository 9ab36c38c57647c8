"""Issue 25, item 3: C, F and 1-5 offer only settings the engine can apply from the current state; what it
cannot is greyed in the combos with its reason and never proposed again.

The matrix is generated: every state the keys reach from a model's start (breadth first, through the
real ControlsPanel), every key from each. A seeded sample of those (state, key) pairs then goes to the
real engine on the embedded model: what a key offers is applied, what the combos grey is refused."""

from __future__ import annotations

import random

import pytest

from kvscope.core.model.caches import parse_cache
from kvscope.core.model.settings import ATTN_IMPLS, attention_choices, cache_choices, native_attention
from kvscope.core.runtimes.transformers.switches import switch_problem
from kvscope.core.model.sources import load_spec
from kvscope.ui.controls import SWITCH_KEYS, ControlsPanel
from tests.synthetic import synthetic_samples

KEYS = ("1", "2", "3", "4", "5", "F", "C")
TOKENS = 12  # the run's context when the keys are pressed (prompt + generated)


def _panel(qtbot, spec, device):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.set_model(spec, device)
    panel.set_choices(attention_choices(spec), cache_choices(device, spec), ATTN_IMPLS)
    panel.context_tokens = lambda: TOKENS
    return panel


def _show(panel, state, event=None, **fields):
    s = synthetic_samples(2, prompt_tokens=4)[-1].replace(attention=state[0], attn_impl=state[1], cache=state[2],
                                                          context_tokens=TOKENS)
    if event:
        s = s.replace(phase="event", event=event, **fields)
    panel.show_settings(s)


def _press(panel, key):
    """What key ``key`` asks from the state shown: (axis, value) or None."""
    if key == "C":
        return ("cache", panel.next_cache())
    if key == "F":
        return ("attn-impl", panel.flash_toggled())
    return ("attention", panel.attention_for_key(int(key)))


def _after(state, axis, value):
    a, i, c = state
    if axis == "attention":
        a = value
    elif axis == "attn-impl":
        i = value
    else:
        c = value
        if parse_cache(value).needs_attention_weights:
            i = "eager"  # the engine takes the kernel along
    return (a, i, c)


def reachable(qtbot, spec, device):
    """{state: {key: offered value or None}} for every state the keys reach from the model's start."""
    panel = _panel(qtbot, spec, device)
    start = (native_attention(spec).key, "sdpa", "dynamic")
    table, todo = {}, [start]
    while todo:
        state = todo.pop()
        if state in table:
            continue
        table[state] = {}
        for key in KEYS:
            _show(panel, state)
            axis, value = _press(panel, key)
            table[state][key] = (axis, value)
            if value is not None:
                todo.append(_after(state, axis, value))
    return panel, table


@pytest.mark.parametrize("model,device", [("embedded", "cpu"), ("embedded", "cuda:0"), ("mistral-7b", "cuda:0"),
                                          ("gemma-3-27b", "cpu"), ("deepseek-v3", "cuda:0")])
def test_every_key_from_every_reachable_state_offers_only_what_can_run(qtbot, model, device):
    spec = load_spec(model)
    panel, table = reachable(qtbot, spec, device)
    assert len(table) > 1 or spec.is_mla
    for state, keys in table.items():
        now = dict(zip(SWITCH_KEYS, state))
        for key, (axis, value) in keys.items():
            if value is not None:
                assert switch_problem(spec, device, now, axis, value, tokens=TOKENS) is None, (state, key, value)
        # C cycles through every cache that can run from here, and through nothing else.
        _show(panel, state)
        runnable = {k for k, reason in cache_choices(device, spec)
                    if reason is None and switch_problem(spec, device, now, "cache", k, tokens=TOKENS) is None}
        seen = set()
        for _ in range(len(runnable) + 1):
            value = panel.next_cache()
            if value is None:
                break
            seen.add(value)
            panel.select(panel.cache_combo, value)  # what request_switch does: the combo shows what was asked
        assert seen == (runnable if len(runnable) > 1 else set()), (state, sorted(seen ^ runnable))
        # The combos grey exactly what cannot run, each with its reason.
        _show(panel, state)
        for axis in SWITCH_KEYS:
            combo = panel.combo(axis)
            for i in range(combo.count()):
                value, item = combo.itemData(i), combo.model().item(i)
                if not value or value == now[axis]:
                    continue
                fixed = dict(cache_choices(device, spec)).get(value) if axis == "cache" else None
                reason = fixed or switch_problem(spec, device, now, axis, value, tokens=TOKENS)
                assert item.isEnabled() == (reason is None), (state, axis, value, reason)
                assert (item.toolTip() == reason) if reason else True


def test_sliding_window_and_static_cache_c_reaches_offloaded_sink_and_h2o_never_quantized(qtbot):
    """The issue's case: C used to propose quantized:4 (refused) again and again."""
    spec = load_spec("embedded")
    panel = _panel(qtbot, spec, "cuda:0")
    state = ("window:256", "sdpa", "static")
    _show(panel, state)
    asked = []
    for _ in range(12):
        value = panel.next_cache()
        asked.append(value)
        panel.select(panel.cache_combo, value)
    assert not any(v.startswith("quantized") for v in asked)
    assert {"offloaded", "dynamic"} <= set(asked)
    assert any(v.startswith("sink:") for v in asked) and any(v.startswith("h2o:") for v in asked)
    assert not panel.cache_combo.model().item(panel.cache_combo.findData("quantized:4")).isEnabled()


def test_a_refusal_is_never_proposed_again_from_that_state(qtbot):
    spec = load_spec("embedded")
    panel = _panel(qtbot, spec, "cpu")
    state = ("mha", "sdpa", "dynamic")
    _show(panel, state)
    first = panel.next_cache()
    _show(panel, state, event="refused", text=f"cache={first} refused: the backend cannot build here",
          switch_key="cache", switch_before="dynamic", switch_after=first)
    assert panel.next_cache() != first
    item = panel.cache_combo.model().item(panel.cache_combo.findData(first))
    assert not item.isEnabled() and item.toolTip() == "the backend cannot build here"
    _show(panel, ("mqa", "sdpa", "dynamic"))  # from another state it may run: offered again
    assert panel.cache_combo.model().item(panel.cache_combo.findData(first)).isEnabled()


def test_the_real_engine_applies_what_a_key_offers_and_refuses_what_is_greyed(qtbot):
    """A seeded sample of the matrix on the real embedded model (CPU): each state is reached by the keys'
    own switches on a fresh engine, then one offered switch must apply and one greyed switch be refused."""
    import torch

    from kvscope.core.model.attention import SettingsError
    from kvscope.core.model.settings import RunSettings
    from kvscope.core.runtimes.transformers.engine import Engine
    from kvscope.core.runtimes.transformers.loading import load_model

    torch.set_num_threads(1)
    spec = load_spec("embedded")
    panel, table = reachable(qtbot, spec, "cpu")
    start = (native_attention(spec).key, "sdpa", "dynamic")
    paths = {start: []}  # breadth first: the shortest key path to each state
    frontier = [start]
    while frontier:
        nxt = []
        for state in frontier:
            for axis, value in table[state].values():
                if value is not None and _after(state, axis, value) not in paths:
                    paths[_after(state, axis, value)] = paths[state] + [(axis, value)]
                    nxt.append(_after(state, axis, value))
        frontier = nxt
    assert set(paths) == set(table)
    quanto = lambda v: v.startswith("quantized:") and parse_cache(v).backend == "quanto"  # noqa: E731 - builds C++ first
    rng = random.Random(25)
    states = rng.sample(sorted(s for s in paths if not any(quanto(v) for _, v in paths[s])), 6)
    checked = {"applied": 0, "refused": 0}
    for state in states:
        engine = Engine(load_model("embedded", device="cpu"), RunSettings(), seed=0)
        ids = engine.loaded.tokenizer("Every token keeps a key and a value", return_tensors="pt")["input_ids"]
        engine.prefill(ids, "p")
        engine.step()
        for axis, value in paths[state]:
            assert engine.apply(axis, value).event == "switch"
        assert (engine.mode.key, engine.settings.attn_impl, engine.settings.cache.key) == state
        now = dict(zip(SWITCH_KEYS, state))
        offered = [(a, v) for a, v in table[state].values() if v is not None and v != now[a] and not quanto(v)]
        greyed = [(a, v) for a in SWITCH_KEYS for v in _values(spec, a)
                  if v != now[a] and switch_problem(spec, "cpu", now, a, v, tokens=engine.seq_len)]
        if greyed:
            axis, value = rng.choice(greyed)
            with pytest.raises(SettingsError):
                engine.apply(axis, value)
            checked["refused"] += 1
        if offered:
            axis, value = rng.choice(offered)
            assert engine.apply(axis, value).event == "switch", (state, axis, value)
            checked["applied"] += 1
    assert checked["applied"] >= 4 and checked["refused"] >= 2, checked


def _values(spec, axis):
    if axis == "attention":
        return attention_choices(spec)
    if axis == "attn-impl":
        return ATTN_IMPLS
    return tuple(k for k, reason in cache_choices("cpu", spec) if reason is None)


@pytest.mark.parametrize("impls,flash,other", [(("fa-off", "fa-on"), "fa-on", "fa-off"),
                                               (ATTN_IMPLS, "flash", "sdpa")])
def test_the_kernel_combo_lists_a_runtimes_own_kernels_and_f_toggles_its_flash(qtbot, impls, flash, other):
    """llama.cpp names its kernels fa-off / fa-on: the Kernel combo lists them enabled (they were greyed as
    'not available here' under torch's three), and F goes to flash attention and back, as with SDPA's flash."""
    spec = load_spec("embedded")
    panel = _panel(qtbot, spec, "cpu")
    panel.set_choices(attention_choices(spec), cache_choices("cpu", spec), impls)
    listed = [panel.impl_combo.itemData(i) for i in range(panel.impl_combo.count())]
    assert listed == list(impls)
    model = panel.impl_combo.model()
    assert all(model.item(i).isEnabled() for i in range(len(impls)) if listed[i] in impls)
    panel.select(panel.impl_combo, other)
    assert panel.flash_toggled() == flash
    panel.select(panel.impl_combo, flash)
    assert panel.flash_toggled() == other


def test_under_fa_off_llamacpp_c_passes_over_the_quantized_v_caches_it_would_refuse(qtbot):
    """Issue 37: under fa-off, C offered q8_0 and llama.cpp refused it (a quantized V cache needs flash attention).
    Every cache type from every llama.cpp kernel: C offers only what llama.cpp loads, and F to fa-off under a
    quantized V is greyed with the reason."""
    from kvscope.core.prediction.llamacpp import CACHE_TYPES, QUANTIZED

    spec = load_spec("embedded")
    panel = _panel(qtbot, spec, "cpu")
    types = tuple(CACHE_TYPES)
    panel.set_choices(attention_choices(spec), tuple((t, None) for t in types), ("fa-off", "fa-on"))
    for impl in ("fa-off", "fa-on"):
        for cache in types:
            s = synthetic_samples(2, prompt_tokens=4)[-1].replace(runtime="llama.cpp", attention="mha",
                                                                  attn_impl=impl, cache=cache)
            panel.show_settings(s)
            offered = panel.next_cache()
            assert offered is not None
            if impl == "fa-off":
                assert offered not in QUANTIZED, (cache, offered)
                for q in QUANTIZED - {cache}:
                    assert "needs flash attention" in (panel.problem("cache", q) or ""), (cache, q)
            f = panel.problem("attn-impl", "fa-off") if impl == "fa-on" else None
            assert (f is not None) == (impl == "fa-on" and cache in QUANTIZED), (impl, cache, f)

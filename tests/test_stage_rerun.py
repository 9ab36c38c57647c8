"""A switch that re-runs the tokens so far is prepared off the token path (issue 25, item 1; kvscope.core.runtimes.transformers.rerun).

On the real embedded model: the run goes on under the current settings while the one batched pass runs on a
shadow of the engine, and the cache the switch leaves is, byte for byte and value for value, the cache that the
switch applied at once (``Engine.apply``) leaves after the same tokens. Presses during a preparation: the same
axis replaces or cancels it, another axis waits for it.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvscope.core.live.run import run_generation
from kvscope.core.model.attention import parse_attention
from kvscope.core.model.caches import parse_cache
from kvscope.core.model.request import RunHooks, RunRequest
from kvscope.core.model.settings import RunSettings
from kvscope.core.runtimes.transformers import latent, rerun
from kvscope.core.runtimes.transformers.convert import dense_kv
from kvscope.core.runtimes.transformers.engine import Engine
from kvscope.core.runtimes.transformers.loading import load_model
from kvscope.core.runtimes.transformers.measure import cache_bytes
from kvscope.core.runtimes.transformers.runtime import TransformersRuntime
from tests import helpers

_one_thread = pytest.fixture(autouse=True, scope="module")(helpers.one_torch_thread)

PROMPT = 12


@pytest.fixture
def loaded():
    """A fresh load per engine: a switch applied at once converts the loaded model in place."""
    return lambda: load_model("embedded", device="cpu")


def _engine(loaded, attention: str | None, cache: str, attn_impl: str = "sdpa") -> Engine:
    settings = RunSettings(attention=parse_attention(attention) if attention else None, cache=parse_cache(cache),
                           attn_impl=attn_impl, max_context=512)
    engine = Engine(loaded(), settings, seed=0)
    prompt = torch.randint(3, engine.spec.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    engine.prefill(prompt, "p")
    return engine


# Every kind of re-run the engine makes: to MLA's latent from a cache without the model's own K/V of every token
# (a window past its size, mean-pooled heads), up in rank, leaving MLA below full rank, leaving a window past its
# size, to h2o (scores), out of a token-selecting cache that dropped tokens.
RERUNS = [
    ("window:8", "dynamic", "attention", "mla"),
    ("mqa", "dynamic", "attention", "mla:64"),
    ("mla:16", "dynamic", "attention", "mla:64"),
    ("mla:16", "dynamic", "attention", "mha"),
    ("mla:16", "dynamic", "attention", "gqa:2"),
    ("window:8", "dynamic", "attention", "mha"),
    ("window:8", "dynamic", "attention", "mqa"),
    (None, "dynamic", "cache", "h2o:4+8"),
    (None, "sink:2+8", "cache", "dynamic"),
    (None, "sink:2+8", "cache", "static"),
]


def _case(i: int) -> tuple[int, int]:
    """Seeded: tokens before the switch, tokens generated while it is prepared."""
    rng = random.Random(2500 + i)
    return rng.randint(12, 40), rng.randint(1, 9)


def _same_cache_and_runs_on(prepared_run: Engine, applied_run: Engine) -> None:
    """The prepared switch left the cache, the next logits and the settings the applied one left, and runs on exact."""
    assert cache_bytes(prepared_run.cache) == cache_bytes(applied_run.cache)
    # MLA's latent: the tokens generated meanwhile reach it in chunks here, one by one there; each grouping extends
    # or refits the basis on the same tokens, equal to the fit's float32 rounding.
    tol = 2e-3 if latent.is_latent(applied_run.cache) else 1e-5
    for (k1, v1), (k2, v2) in zip(dense_kv(prepared_run.cache), dense_kv(applied_run.cache), strict=True):
        torch.testing.assert_close(k1, k2, rtol=tol, atol=tol)
        torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)
    torch.testing.assert_close(prepared_run._next_logits, applied_run._next_logits, rtol=10 * tol, atol=10 * tol)
    assert prepared_run._settings_now() == applied_run._settings_now()
    for _ in range(3):  # and it runs on, exact
        s = prepared_run.step()
        assert s.kv_bytes_held == s.kv_bytes_predicted and s.attention == applied_run.mode.key


@pytest.mark.parametrize("i", range(len(RERUNS)))
def test_a_prepared_rerun_leaves_the_cache_an_applied_switch_leaves(loaded, i):
    attention, cache, key, value = RERUNS[i]
    before, meanwhile = _case(i)
    prepared_run = _engine(loaded, attention, cache)
    lines: list[str] = []
    prepared_run.progress = lines.append
    for _ in range(before):
        prepared_run.step()
    running = prepared_run._settings_now()
    prep = prepared_run.begin_switch(key, value)
    assert isinstance(prep, rerun.PreparedSwitch), prep
    tokens = []
    for _ in range(meanwhile):  # the run goes on under the settings it had
        s = prepared_run.step()
        tokens.append(prepared_run.ids[:, -1:].clone())
        assert (s.attention, s.attn_impl, s.cache) == (running["attention"], running["attn_impl"], running["cache"])
        assert s.kv_bytes_held == s.kv_bytes_predicted
    prep.done.wait(120)
    assert prep.layers_done == prep.layers == prepared_run.spec.num_layers and prep.fraction == 1.0
    event = None
    while event is None:
        event = prepared_run.advance_switch(prep)
    assert event.event == "switch" and event.switch_after == (parse_attention(value).key if key == "attention"
                                                              else parse_cache(value).key), event.text
    assert event.kv_bytes_held == event.kv_bytes_predicted, event.text
    assert event.tokens_rerun == PROMPT + before + meanwhile
    assert any(line.startswith("re-running") for line in lines) and any("%" in line for line in lines), lines

    # The same switch applied at once at the same token, then fed the same tokens.
    applied_run = _engine(loaded, attention, cache)
    for _ in range(before):
        applied_run.step()
    assert torch.equal(applied_run.ids, prepared_run.ids[:, :PROMPT + before])
    applied = applied_run.apply(key, value)
    assert applied.event == "switch"
    forced = iter(tokens)
    applied_run._sample_next = lambda: next(forced)
    for _ in range(meanwhile):
        applied_run.step()
    assert torch.equal(applied_run.ids, prepared_run.ids)
    assert prepared_run.cache_base_tokens == applied_run.cache_base_tokens == PROMPT + before
    _same_cache_and_runs_on(prepared_run, applied_run)


def test_switches_that_need_no_rerun_apply_at_once(loaded):
    engine = _engine(loaded, None, "dynamic")
    for _ in range(5):
        engine.step()
    # gqa:2 aligned is fitted off the token path (tests/test_merge.py); the mean pools at once
    for key, value in [("attention", "gqa:2:mean"), ("attn-impl", "eager"), ("cache", "static"),
                       ("attention", "gqa:2:mean")]:
        answer = engine.begin_switch(key, value)
        assert not isinstance(answer, rerun.PreparedSwitch)
        assert answer.event in ("switch", "note") and answer.kv_bytes_held == answer.kv_bytes_predicted


def _runtime(engine: Engine) -> TransformersRuntime:
    return TransformersRuntime.around(engine, RunRequest(source="embedded", max_new_tokens=1000))


def _until_answered(runtime: TransformersRuntime, limit: int = 2000) -> list:
    answers = []
    for _ in range(limit):
        answers += runtime.advance()
        if runtime._prepared is None:
            return answers
        runtime.step()
    raise AssertionError("the prepared switch never applied")


def test_a_press_on_the_same_axis_replaces_or_cancels_the_prepared_switch(loaded):
    engine = _engine(loaded, "mqa", "dynamic")
    for _ in range(30):
        engine.step()
    runtime = _runtime(engine)
    assert runtime.apply_live("attention", "mha") == []  # the pooled cache goes back to the model's own heads
    prep = runtime._prepared
    assert runtime.apply_live("attention", "mha") == [] and runtime._prepared is prep  # the same: still under way
    back = runtime.apply_live("attention", "mqa")  # back to what runs: cancelled, answered "no change"
    assert [s.event for s in back] == ["note"] and runtime._prepared is None
    assert not prep.thread.is_alive() and engine.mode.key == "mqa"
    runtime.step()
    assert runtime.apply_live("cache", "h2o:4+8") == []
    first = runtime._prepared
    answers = runtime.apply_live("cache", "sink:2+8")  # a newer target: the h2o pass stops, sink applies
    assert first.cancel_flag.is_set() and not first.thread.is_alive()
    if runtime._prepared is not None:
        answers += _until_answered(runtime)
    assert [s.switch_after for s in answers] == ["sink:2+8"] and engine.settings.cache.key == "sink:2+8"


def test_a_press_on_another_axis_waits_for_the_prepared_switch(loaded):
    engine = _engine(loaded, "mqa", "dynamic")
    for _ in range(30):
        engine.step()
    runtime = _runtime(engine)
    assert runtime.apply_live("attention", "mha") == []
    assert runtime.apply_live("cache", "static") == []
    assert runtime.apply_live("cache", "h2o:4+8") == []  # the last press per axis counts
    assert runtime.apply_live("cache", "static") == []
    assert engine.settings.cache.key == "dynamic"
    answers = _until_answered(runtime)
    assert [(s.switch_key, s.switch_after) for s in answers] == [("attention", "mha"), ("cache", "static")]
    assert all(s.kv_bytes_held == s.kv_bytes_predicted for s in answers)


def test_a_live_rerun_in_the_run_loop_never_stops_the_tokens():
    """Through kvscope.core.live.run's loop, as the window's driver feeds it: the MHA press at token 40 (back from
    mean-pooled MQA) is answered at a later token, the tokens in between run under MQA, and every Sample stays exact."""
    samples = []
    pressed = []

    def poll():
        decoded = sum(1 for s in samples if s.phase == "decode")
        if decoded == 40 and not pressed:
            pressed.append(True)
            return [("attention", "mha")]
        return []

    run_generation(RunRequest(source="embedded", max_new_tokens=400, prompt="The KV cache ",
                              settings=RunSettings(attention=parse_attention("mqa"))),
                   RunHooks(emit=samples.append, loaded=lambda info: None, progress=lambda text: None,
                            poll=poll, should_stop=lambda: False))
    switch = next(s for s in samples if s.event == "switch")
    assert switch.token >= 40 and switch.tokens_rerun == switch.context_tokens
    assert all(s.attention == "mqa" for s in samples if s.phase == "decode" and s.token <= switch.token)
    assert all(s.attention == "mha" for s in samples if s.phase == "decode" and s.token > switch.token)
    assert all(s.kv_bytes_held == s.kv_bytes_predicted for s in samples if s.kv_bytes_held is not None)


def test_may_rerun_foresees_every_rerun(loaded):
    """``kvscope.core.runtimes.transformers.rerun.may_rerun`` (which spares switches without a re-run the shadow) against what ``Engine.apply``
    does, on a seeded sample of starting settings x switches: never a re-run it did not foresee."""
    from kvscope.core.model.attention import SettingsError

    rng = random.Random(25)
    starts = [(a, c) for a in (None, "gqa:2", "window:8", "mla:16") for c in ("dynamic", "static", "sink:2+8", "h2o:4+8")]
    starts = [(a, c) for a, c in starts if not (a == "mla:16" and c != "dynamic")]  # MLA's latent: dynamic only
    switches = [("attention", v) for v in ("mha", "gqa:2", "mqa", "mla", "mla:64", "window:8", "window:64")] + \
               [("cache", v) for v in ("dynamic", "static", "sink:2+8", "h2o:4+8", "quantized:fp8")]
    tried = 0
    for attention, cache in rng.sample(starts, 7):
        for key, value in rng.sample(switches, 2):
            engine = _engine(loaded, attention, cache, attn_impl="eager" if cache.startswith("h2o") else "sdpa")
            for _ in range(rng.randint(5, 14)):
                engine.step()
            name, parsed, _ = engine._asked(key, value)
            foreseen = rerun.may_rerun(engine, name, parsed)
            try:
                event = engine.apply(key, value)
            except SettingsError:
                continue
            if event.event == "note":  # no change: begin_switch answers it before asking
                continue
            tried += 1
            assert foreseen == (event.tokens_rerun is not None), (attention, cache, key, value, event.text)
    assert tried >= 7


def test_one_profiler_session_at_a_time_and_the_token_path_never_waits_for_it(loaded):
    """The re-run's pass is measured under the profiler on its own thread. The token thread measured a decode step
    (every 64th, or the first after a switch) and a switch's kernel (its trial pass) under the profiler too, at
    the same time: the engine process died of SIGSEGV (benchmarks/stage_keys.py, key 5 after key 4). Now the token
    thread skips its measurement while the profiler is taken, and takes it at a later token."""
    import threading
    import time

    from kvscope.core.runtimes.transformers.kernels import PROFILER, measure_kernel

    engine = _engine(loaded, "mqa", "dynamic")
    engine.step()
    # Held, as the re-run's thread holds it for its pass: a decode step due to be measured does not wait.
    assert PROFILER.acquire(timeout=5)
    try:
        engine._decode_peak_due = True
        started = time.monotonic()
        done = threading.Event()
        worker = threading.Thread(target=lambda: (engine.step(), engine.apply("attn-impl", "flash"), done.set()))
        worker.start()
        assert done.wait(30), "the token thread waited for the profiler"
        assert time.monotonic() - started < 30
        assert engine._decode_peak_due  # not measured: due at the next step
    finally:
        PROFILER.release()
    s = engine.step()
    assert not engine._decode_peak_due and s.peak_bytes_observed is not None
    # The real thing: steps due to be measured, and kernels measured, while a re-run's pass runs on its thread.
    engine.apply("attn-impl", "sdpa")  # (MLA's head sizes have no flash kernel on the CPU: refused there)
    prep = engine.begin_switch("attention", "mha")
    assert isinstance(prep, rerun.PreparedSwitch)
    while not prep.done.is_set():
        engine._decode_peak_due = True
        engine.step()
        measure_kernel(lambda: engine.model(input_ids=engine.ids[:, -1:]))
    event = None
    while event is None:
        event = engine.advance_switch(prep)
    assert event.event == "switch" and event.switch_after == "mha", event.text
    s = engine.step()
    assert s.kv_bytes_held == s.kv_bytes_predicted and s.attention == "mha"


# Switches that need no re-run but convert a large cache (issue 37, item 2: C on SmolLM2-135M at 1,000 tokens stood
# the run still 2.8-3.8 s): converted off the token path from a frozen copy of the live cache, then caught up. Here
# the threshold is lowered so that the embedded model's small cache takes that path.
CONVERSIONS = [
    (None, "dynamic", "cache", "static"),
    (None, "dynamic", "cache", "quantized:fp8"),
    (None, "static", "cache", "dynamic"),
    (None, "dynamic", "attention", "gqa:2"),
    (None, "static", "attention", "mqa"),
    (None, "dynamic", "attention", "window:64"),
]


def _applied_matches_prepared(applied_run, prepared_run, key, value, tokens) -> None:
    """``key=value`` applied between two tokens, then the tokens the prepared run generated meanwhile forced: the
    same ids, and the same cache from there on, as the switch prepared off the token path."""
    assert applied_run.apply(key, value).event == "switch"
    forced = iter(tokens)
    applied_run._sample_next = lambda: next(forced)
    for _ in range(len(tokens)):
        applied_run.step()
    assert torch.equal(applied_run.ids, prepared_run.ids)
    _same_cache_and_runs_on(prepared_run, applied_run)


@pytest.mark.parametrize("i", range(len(CONVERSIONS)))
def test_a_conversion_off_the_token_path_leaves_the_cache_an_applied_switch_leaves(loaded, monkeypatch, i):
    monkeypatch.setattr(rerun, "PREPARE_BYTES", 0)
    attention, cache, key, value = CONVERSIONS[i]
    before, meanwhile = _case(100 + i)
    prepared_run = _engine(loaded, attention, cache)
    for _ in range(before):
        prepared_run.step()
    live = [(k.clone(), v.clone()) for k, v in dense_kv(prepared_run.cache)]
    running = prepared_run._settings_now()
    prep = prepared_run.begin_switch(key, value)
    assert isinstance(prep, rerun.PreparedSwitch) and prep.convert is not None, prep
    tokens = []
    for _ in range(meanwhile):  # the run goes on under its own settings, its cache untouched by the conversion
        s = prepared_run.step()
        tokens.append(prepared_run.ids[:, -1:].clone())
        assert (s.attention, s.cache) == (running["attention"], running["cache"])
        assert s.kv_bytes_held == s.kv_bytes_predicted
    prep.done.wait(120)
    assert prep.error is None and prep.trialled
    for (k0, v0), (k1, v1) in zip(live, dense_kv(prepared_run.cache), strict=True):  # the conversion never wrote
        assert torch.equal(k1[..., :k0.shape[-2], :], k0) and torch.equal(v1[..., :v0.shape[-2], :], v0)  # into it
    event = None
    while event is None:
        event = prepared_run.advance_switch(prep)
    assert event.event == "switch" and "converted off the token path" in event.text, event.text
    assert event.tokens_rerun is None and event.kv_bytes_held == event.kv_bytes_predicted, event.text

    applied_run = _engine(loaded, attention, cache)
    for _ in range(before):
        applied_run.step()
    for (k1, v1), (k2, v2) in zip(live, dense_kv(applied_run.cache), strict=True):  # the same run up to N
        torch.testing.assert_close(k1[..., -k2.shape[-2]:, :] if k1.shape != k2.shape else k1, k2)
    _applied_matches_prepared(applied_run, prepared_run, key, value, tokens)


@pytest.mark.parametrize("case", [("cache", "static"), ("cache", "quantized:fp8"), ("attention", "mla")])
def test_the_tokens_generated_meanwhile_are_caught_up_off_the_token_path(loaded, monkeypatch, case):
    """Issue 37, item 2: the token thread caught the shadow up on every token generated meanwhile, in one gap
    (SmolLM2-135M at 1,000 tokens, C to static: 2-4.5 s). The background thread now does all but CATCH_UP_LEFT of
    them after its pass; the switch then leaves the cache an applied switch leaves."""
    import threading

    monkeypatch.setattr(rerun, "PREPARE_BYTES", 0)
    key, value = case
    meanwhile = 7
    generated = threading.Event()
    real = rerun._catch_up_behind
    behind_after: list[int] = []

    def held(prep):  # the pass is done; the run has gone on meanwhile: then the background catch-up
        assert generated.wait(60)
        real(prep)
        behind_after.append(prep.live.seq_len - prep.shadow.seq_len)

    monkeypatch.setattr(rerun, "_catch_up_behind", held)
    prepared_run = _engine(loaded, None, "dynamic")
    for _ in range(20):
        prepared_run.step()
    prep = prepared_run.begin_switch(key, value)
    assert isinstance(prep, rerun.PreparedSwitch), prep
    tokens = []
    for _ in range(meanwhile):
        prepared_run.step()
        tokens.append(prepared_run.ids[:, -1:].clone())
    generated.set()
    prep.done.wait(120)
    assert prep.error is None and behind_after == [rerun.CATCH_UP_LEFT], behind_after
    assert prep.caught_up == meanwhile - rerun.CATCH_UP_LEFT
    event = prepared_run.advance_switch(prep)  # the last few, between two tokens
    assert event is not None and event.event == "switch", event
    assert f"{meanwhile:,} tokens generated meanwhile caught up" in event.text, event.text

    applied_run = _engine(loaded, None, "dynamic")
    for _ in range(20):
        applied_run.step()
    _applied_matches_prepared(applied_run, prepared_run, key, value, tokens)

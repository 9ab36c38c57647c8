"""Issue 25, item 2: key presses coalesce. Per axis only the last pending press counts, a press back to
the running setting cancels the pending one, and never more than one switch per axis waits."""

from __future__ import annotations

import random

import pytest
from PySide6.QtCore import Qt

from kvscope.core.live.engine_process import RunDriver
from kvscope.core.live.session import Session, canonical_switch
from kvscope.core.model.request import RunRequest
from tests.synthetic import synthetic_samples

AXES = {"attention": ("mha", "gqa:2", "mqa", "mla", "window:256"),
        "attn-impl": ("eager", "sdpa", "flash"),
        "cache": ("dynamic", "static", "quantized:fp8", "offloaded", "sink:4+252", "h2o:128+128")}
# quantized:fp8 needs no backend built: quanto's and hqq's caches wait for it (tests/test_stage_prepare.py).


@pytest.mark.parametrize("seed", range(20))
def test_the_driver_keeps_the_last_press_per_axis_in_the_order_of_the_last_presses(seed):
    rng = random.Random(seed)
    driver = RunDriver(RunRequest(), lambda kind, payload: None)
    presses = [(axis, rng.choice(AXES[axis])) for axis in (rng.choice(list(AXES)) for _ in range(rng.randint(1, 40)))]
    for axis, value in presses:
        driver.command("switch", axis, value)
    switches = driver._poll()
    last: dict[str, str] = {}
    for axis, value in presses:
        last.pop(axis, None)
        last[axis] = value
    assert switches == list(last.items())
    assert len({axis for axis, _ in switches}) == len(switches) <= 3
    assert driver._poll() == []  # nothing left behind


@pytest.mark.parametrize("seed", range(20))
def test_the_session_sends_a_press_only_when_it_changes_what_is_pending(seed):
    """Fuzzed presses against a model of the rule: pending per axis = the last press unless it is the
    running setting; a press is sent when it changes that."""
    rng = random.Random(1000 + seed)
    session = Session(lambda: 0.0)
    session.begin_live(RunRequest(), "cpu")
    session.take_samples(synthetic_samples(3, prompt_tokens=4))
    running = {axis: session.running_setting(axis) for axis in AXES}
    assert None not in running.values()
    model: dict[str, str] = {}
    for _ in range(60):
        axis = rng.choice(list(AXES))
        value = rng.choice(AXES[axis] + (running[axis],))
        before = dict(model)
        if value == running[axis]:
            model.pop(axis, None)
        else:
            model[axis] = value
        sent = session.switch_sent(axis, value)
        assert sent == (model != before)
        assert session.pending == model and session.switches_pending == len(model) <= 3


def test_an_answer_to_a_superseded_press_leaves_the_last_press_pending():
    session = Session(lambda: 0.0)
    session.begin_live(RunRequest(), "cpu")
    samples = synthetic_samples(3, prompt_tokens=4)
    session.take_samples(samples)
    last = samples[-1]
    session.switch_sent("attention", "mla")
    session.switch_sent("attention", "mqa")  # MLA was already under way in the engine
    mla = last.replace(phase="event", event="switch", attention="mla", switch_key="attention",
                       switch_before=last.attention, switch_after="mla", text="mla")
    session.take_samples([mla])
    assert session.pending == {"attention": "mqa"}
    session.take_samples([mla.replace(attention="mqa", switch_before="mla", switch_after="mqa", text="mqa")])
    assert session.pending == {}


def test_canonical_spellings_match_the_engines():
    assert canonical_switch("attn_impl", "FA2") == ("attn-impl", "flash")
    assert canonical_switch("cache", "no such cache") == ("cache", "no such cache")


KEYS = [Qt.Key.Key_1, Qt.Key.Key_2, Qt.Key.Key_3, Qt.Key.Key_4, Qt.Key.Key_5, Qt.Key.Key_C, Qt.Key.Key_F]
AXIS_OF = {Qt.Key.Key_C: "cache", Qt.Key.Key_F: "attn-impl"}


def _mash(qtbot, window, rng, n=30):
    for _ in range(n):
        qtbot.keyClick(window, rng.choice(KEYS))
    return {axis: window.session.pending.get(axis) for axis in AXES}


def test_a_30_key_mash_in_a_real_run_is_at_most_one_switch_per_axis(qtbot, thread_window):
    """The real embedded model in thread mode. Paused, 30 keys then resume: the engine answers at most
    once per axis (one re-run at most per axis) and ends on each axis's last press. Running, 30 keys:
    at most the switch already under way plus the last press per axis."""
    window = thread_window
    answers: list = []
    window.sample_observers.append(lambda s: answers.append(s) if s.is_event and s.switch_key else None)
    window.start_run(RunRequest(source="embedded", max_new_tokens=100_000))
    qtbot.waitUntil(lambda: window.decode_tokens >= 8, timeout=120_000)
    rng = random.Random(25)
    for phase in ("paused", "running"):
        if phase == "paused":
            window.toggle_pause()
            qtbot.waitUntil(lambda: window.state == "paused", timeout=30_000)
        answers.clear()
        wanted = _mash(qtbot, window, rng)
        assert window.session.switches_pending <= 3
        if phase == "paused":
            window.toggle_pause()
        try:
            qtbot.waitUntil(lambda: window.session.switches_pending == 0, timeout=120_000)
        except Exception:
            raise AssertionError(f"{phase}: still pending {window.session.pending} after answers "
                                 f"{[(s.event, s.switch_key, s.switch_after) for s in answers]}") from None
        tokens = window.decode_tokens
        qtbot.waitUntil(lambda: window.decode_tokens > tokens + 1, timeout=60_000)  # late answers are in
        per_axis = {axis: [s for s in answers if s.switch_key == axis] for axis in AXES}
        limit = 1 if phase == "paused" else 2
        # What costs is a switch applied (a conversion, a re-run); a refusal or a no-op answers at once and lets the
        # next press through (MLA's latent refuses a sink cache, and the mash goes on): counted apart.
        applied = {axis: [s for s in v if s.event == "switch"] for axis, v in per_axis.items()}
        assert all(len(v) <= limit for v in applied.values()), (phase, {a: [(s.event, s.switch_after) for s in v]
                                                                        for a, v in per_axis.items()})
        assert all(len(v) <= limit + 3 for v in per_axis.values()), (phase, per_axis)
        reruns = [s for s in answers if s.tokens_rerun]
        assert len(reruns) <= limit * 3
        for axis, value in wanted.items():
            answered = per_axis[axis][-1] if per_axis[axis] else None
            if value is not None and answered is not None and answered.event == "switch":
                field = {"attention": "attention", "attn-impl": "attn_impl", "cache": "cache"}[axis]
                assert getattr(answered, field) == value, (axis, value)  # the last press is what was applied
    assert window.state == "running" and not window.last_error
    with qtbot.waitSignal(window.run_finished, timeout=30_000):
        window.stop_run()

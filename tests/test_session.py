"""The session model without a window: state, counters, switches pending, the clock tie, spikes,
the forecast, alerts — driven through its plain methods, observed through its events."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvscope.core.live.session import MARK_LABEL_CHARS, Session, marker_label
from kvscope.core.live.spikes import CAUSE_LOAD, CAUSE_SWITCH
from kvscope.core.model.request import RunRequest
from kvscope.core.prediction.forecast import OomForecast
from kvscope.core.runtimes.probes import MemoryReading
from tests.synthetic import synthetic_samples

MiB = 1 << 20


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Info:
    device: str = "cpu"
    max_context: int | None = 4096


def record(session: Session) -> dict[str, list]:
    """Every event the session announces, by name."""
    seen: dict[str, list] = {}
    for name, emitter in vars(session.events).items():
        emitter.connect(lambda *args, n=name: seen.setdefault(n, []).append(args))
    return seen


def test_a_live_run_goes_loading_running_idle_and_counts_what_it_saw():
    clock = Clock()
    session = Session(clock)
    seen = record(session)
    session.begin_live(RunRequest(), "cpu")
    assert session.state == "loading" and session.busy
    samples = synthetic_samples(10, prompt_tokens=4, switches={5: "mqa"})
    session.take_samples(samples)
    assert session.state == "running"
    assert session.decode_tokens == sum(1 for s in samples if s.phase == "decode") == 10
    assert session.switch_events == 1
    assert session.last_sample == [s for s in samples if not s.is_event][-1]
    assert [a[0] for a in seen["state"]] == ["loading", "running"]
    kinds = [k for k, _ in seen["text"]]
    assert kinds[0] == "prompt" and kinds.count("token") == 10 and kinds.count("marker") == 1
    assert ("marker", " \u27e8mqa\u27e9 ") in seen["text"]
    assert session.finished() and session.state == "idle" and not session.busy
    assert not session.finished()  # once
    assert seen["status"][-1] == ("run ended after 10 tokens", 5000)


def test_a_run_that_ends_leaves_no_switch_pending():
    """A switch asked just before the run ended (or failed) is never answered: the window waited on it for ever
    (benchmarks/stage_keys.py hung 10 minutes on a run that had ended)."""
    session = Session(Clock())
    session.begin_live(RunRequest(), "cpu")
    session.take_samples(synthetic_samples(3, prompt_tokens=4))
    assert session.switch_sent("attention", "gqa:3") and session.switches_pending == 1
    assert session.finished()
    assert session.switches_pending == 0


def test_the_settings_shown_are_the_engines_after_a_switch_and_after_a_refusal():
    session = Session(Clock())
    seen = record(session)
    session.begin_live(RunRequest(), "cpu")
    first = synthetic_samples(3, prompt_tokens=4)
    session.take_samples(first)
    assert session.switch_sent("attention", "gqa:3") and session.switch_sent("cache", "static")
    assert session.switches_pending == 2  # one per axis
    last = first[-1]
    refused = last.replace(phase="event", event="refused", text="refused: no", switch_key="attention",
                           switch_before="mha", switch_after="gqa:3")
    applied = last.replace(phase="event", event="switch", attention="mqa", text="attention: mha -> mqa",
                           switch_key="attention", switch_before="mha", switch_after="mqa")
    session.take_samples([refused])
    assert session.switches_pending == 1
    assert seen["settings"][-1][0].attention == "mha"  # the refusal puts the controls back to what runs
    assert session.switch_sent("attention", "mqa")
    session.take_samples([applied, applied.replace(switch_key="cache", switch_after="static", cache="static",
                                                   text="cache: dynamic -> static")])
    assert session.switches_pending == 0
    assert seen["settings"][-1][0].attention == "mqa"
    assert seen["status"][-1] == ("cache: dynamic -> static", 4000)  # said once the last pending one is in


def test_the_origin_ties_the_run_clock_to_the_readings_clock_and_places_early_readings():
    clock = Clock(1000.0)
    session = Session(clock)
    seen = record(session)
    session.begin_live(RunRequest(), "cpu")
    early = [MemoryReading(time_s=1000.0 + 0.05 * i, process_rss=400 * MiB) for i in range(5)]
    session.take_readings(early)
    assert "readings" not in seen  # no origin yet: kept
    clock.t = 1002.0
    samples = synthetic_samples(4, prompt_tokens=4, tokens_per_s=10.0)
    session.take_samples(samples)  # the newest left the engine at time_s; it arrived at 1002.0
    origin = 1002.0 - max(s.time_s for s in samples)
    assert session.origin == pytest.approx(origin)
    assert seen["origin"] == [(session.origin,)]
    assert seen["readings"] == [(early, session.origin)]
    # A batch delivered slower than the best so far leaves the origin; a faster one moves it earlier.
    clock.t = 1002.01
    session.take_samples([samples[-1].replace(time_s=samples[-1].time_s + 0.005)])
    assert session.origin == pytest.approx(origin)
    clock.t = 1002.1
    session.take_samples([samples[-1].replace(time_s=samples[-1].time_s + 0.2)])
    assert session.origin == pytest.approx(1002.1 - samples[-1].time_s - 0.2)
    # After the run, readings are still plotted for the tail, then not.
    session.finished()
    n = len(seen["readings"])
    session.take_readings([MemoryReading(time_s=clock.t, process_rss=1)])
    assert len(seen["readings"]) == n + 1
    clock.t += 5
    session.take_readings([MemoryReading(time_s=clock.t, process_rss=1)])
    assert len(seen["readings"]) == n + 1


def test_a_spike_during_a_switch_is_the_switchs_and_sits_at_its_token():
    clock = Clock(500.0)
    session = Session(clock)
    seen = record(session)
    session.begin_live(RunRequest(), "cpu")
    samples = synthetic_samples(40, prompt_tokens=8, switches={20: "gqa:2"}, tokens_per_s=20.0)
    clock.t = 500.0 + samples[-1].time_s
    session.take_samples(samples)
    origin = session.origin
    readings = [MemoryReading(time_s=origin + i * 0.05, process_rss=500 * MiB + (48 * MiB if i * 0.05 >= 1.05 else 0))
                for i in range(41)]
    session.take_readings(readings)
    clock.t = origin + 10
    session.feed_spikes(flush=True)
    assert session.spike_count == 1
    spike, token = seen["spike"][0]
    assert spike.rise_bytes == 48 * MiB and spike.cause.startswith(CAUSE_SWITCH.split(":")[0])
    assert 20 <= token <= 22


def test_loading_is_marked_from_start_to_the_load_event_so_its_spike_is_the_loads():
    clock = Clock(100.0)
    session = Session(clock)
    seen = record(session)
    session.begin_live(RunRequest(), "cpu")  # Start at 100.0
    readings = [MemoryReading(time_s=100.0 + 0.05 * i, process_rss=(300 if i < 20 else 420) * MiB) for i in range(60)]
    session.take_readings(readings)
    clock.t = 103.0
    samples = synthetic_samples(3, prompt_tokens=4, tokens_per_s=100.0)
    load = samples[0].replace(phase="event", event="load", text="loaded", time_s=0.0)
    session.take_samples([load] + [s.replace(time_s=s.time_s + 0.01) for s in samples])
    clock.t = 200.0
    session.feed_spikes(flush=True)
    causes = [spike.cause for spike, _ in seen["spike"]]
    assert causes and causes[0] == CAUSE_LOAD


def test_a_replay_judges_the_recorded_memory_and_flushes_at_its_end():
    session = Session(Clock())
    seen = record(session)
    session.begin_replay()
    samples = synthetic_samples(30, prompt_tokens=4, tokens_per_s=10.0)
    jump = [s.replace(process_rss=(s.process_rss or 0) + (64 * MiB if s.token >= 15 else 0)) for s in samples]
    session.take_samples(jump)
    session.take_readings([MemoryReading(time_s=1.0, process_rss=1)])  # a replay plots no live readings
    assert "readings" not in seen
    session.finished()
    assert session.spike_count >= 1 and seen["spike"][0][0].rise_bytes >= 64 * MiB


def test_the_forecast_warns_when_near_and_clears_when_the_run_ends():
    session = Session(Clock())
    seen = record(session)
    session.begin_live(RunRequest(), "cuda:0")
    session.model_loaded(Info(device="cuda:0", max_context=None))
    samples = synthetic_samples(40, prompt_tokens=8, gpu=True, tokens_per_s=200.0)
    session.take_samples(samples)
    bpt = 8 * 1024
    session.last_reading = MemoryReading(time_s=0.0, device_total=80 << 30, device_used=40 << 30)
    far = session.refresh_forecast("cuda:0", None)
    assert isinstance(far, OomForecast) and not far.warning() and "alert" not in seen
    session.last_reading = MemoryReading(time_s=0.0, device_total=80 << 30, device_used=(80 << 30) - 1000 * bpt)
    near = session.refresh_forecast("cuda:0", None)
    assert near.token == samples[-1].token + 1001 and session.alert_kind == "warning"
    assert seen["alert"][-1][0].startswith("\u26a0 Warning: out of memory at token")
    session.finished()
    assert session.alert_kind == "" and seen["alert_cleared"][-1] == ("warning",)


def test_an_out_of_memory_event_raises_an_error_alert_that_a_new_run_clears():
    session = Session(Clock())
    seen = record(session)
    session.begin_live(RunRequest(), "cpu")
    samples = synthetic_samples(5, prompt_tokens=4)
    oom = samples[-1].replace(phase="event", event="oom", text="out of memory in decode at token 5")
    session.take_samples(samples + [oom])
    assert session.alert_kind == "error"
    assert seen["alert"][-1] == (f"\u26a0 Out of memory at token {oom.token:,}: out of memory in decode at token 5",
                                 "error")
    session.finished()
    assert session.alert_kind == "error"  # an error stays until the next run
    session.begin_live(RunRequest(), "cpu")
    assert session.alert_kind == "" and session.decode_tokens == 0 and session.last_sample is None


def test_a_gpu_model_is_judged_by_the_gpu_threshold_after_the_load():
    session = Session(Clock())
    session.begin_live(RunRequest(), "cpu")
    cpu = session.monitor_threshold
    session.model_loaded(Info(device="cuda:0"))
    assert session.monitor_threshold > cpu and session.state == "running"


def test_marker_labels_name_what_was_switched_to_and_are_bounded():
    base = synthetic_samples(1, prompt_tokens=2)[-1]
    assert marker_label(base.replace(event="switch", switch_key="cache", switch_after="static")) == "cache static"
    assert marker_label(base.replace(event="switch", switch_key="attention", switch_after="mqa")) == "mqa"
    assert marker_label(base.replace(event="oom", text="x")) == "oom"
    long = marker_label(base.replace(event="switch", text="x" * 500))
    assert len(long) == MARK_LABEL_CHARS and long.endswith("\u2026")


def test_unknown_states_are_refused():
    with pytest.raises(ValueError, match="unknown run state"):
        Session().set_state("exploded")


def test_token_at_maps_plot_seconds_to_the_last_token_generated():
    session = Session(Clock())
    session.begin_replay()
    samples = synthetic_samples(10, prompt_tokens=4, tokens_per_s=10.0)
    session.take_samples(samples)
    tokens = [s for s in samples if not s.is_event]
    assert session.token_at(tokens[0].time_s - 1) is None
    assert session.token_at(tokens[3].time_s) == tokens[3].token
    assert session.token_at(tokens[3].time_s + 1e-9) == tokens[3].token
    assert session.token_at(1e9) == tokens[-1].token


def test_the_session_imports_no_qt_and_no_torch():
    import subprocess
    import sys

    code = ("import sys, kvscope.core.live.session; bad = [m for m in ('PySide6', 'torch', 'transformers', 'pyqtgraph') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_predicted_growth_is_the_engines_own_and_starts_afresh_at_a_switch():
    session = Session(Clock())
    session.begin_replay()
    samples = synthetic_samples(12, prompt_tokens=4, switches={6: "mqa"})
    before = [s for s in samples if s.phase == "decode" and s.attention == "mha"]
    session.take_samples(samples[:samples.index(before[-1]) + 1])
    assert session.predicted_slope == before[-1].kv_bytes_predicted - before[-2].kv_bytes_predicted > 0
    switch = next(s for s in samples if s.event == "switch")
    session.take_samples([switch])
    assert session.predicted_slope is None
    after = [s for s in samples if s.phase == "decode" and s.attention == "mqa"]
    session.take_samples(after[:2])
    assert session.predicted_slope == after[1].kv_bytes_predicted - after[0].kv_bytes_predicted
    assert session.predicted_slope < before[-1].kv_bytes_predicted - before[-2].kv_bytes_predicted  # MQA: less


def test_the_setting_that_runs_is_the_newest_samples_even_an_events():
    """A switch's event arrives after the token before it in one batch: read from the last token, a key pressed
    right after the switch took the setting left for the one that runs ('attention: already mha' under window:256)."""
    session = Session(lambda: 0.0)
    session.begin_live(RunRequest(), "cpu")
    tokens = synthetic_samples(5, prompt_tokens=4)
    switch = tokens[-1].replace(phase="event", event="switch", attention="window:256", switch_key="attention",
                                switch_before="mha", switch_after="window:256", text="attention: mha -> window:256")
    session.switch_sent("attention", "window:256")
    session.take_samples([*tokens, switch])
    assert session.last_sample.attention == "mha"  # the last token's, from before the switch
    assert session.running_setting("attention") == "window:256" and session.switches_pending == 0
    assert session.switch_sent("attention", "mha")  # pressing 1 now is a switch, not "already mha"

"""Spike detection on synthetic memory series with known spikes, and cause attribution."""

from __future__ import annotations

import random

import pytest

from kvscope.core.live.spikes import (CAUSE_DYNAMIC, CAUSE_LOAD, CAUSE_OTHER_PROCESS, CAUSE_STATIC, CAUSE_UNKNOWN,
                                      EVENT_DECODE, EVENT_LOAD, EVENT_PREFILL, EVENT_STATIC_PREALLOC, EVENT_SWITCH,
                                      Event, Spike, SpikeDetector, attribute_cause, detect_spikes, rise_between)

MiB = 1 << 20
GiB = 1 << 30
RATE_HZ = 20


def times(seconds: float) -> list[float]:
    return [i / RATE_HZ for i in range(int(seconds * RATE_HZ))]


def test_known_steps_on_a_noisy_ramp_are_found_with_their_size_and_time():
    rng = random.Random(7)
    ts = times(10)
    steps = {2.0: 300 * MiB, 6.5: 1 * GiB}  # start time -> size; the first takes 3 samples to rise

    def value(t: float) -> int:
        v = 2 * GiB + 10 * MiB * t + rng.randint(-2 * MiB, 2 * MiB)
        if t >= 2.0:
            v += min(1.0, (t - 2.0 + 0.05) / 0.15) * steps[2.0]
        if t >= 6.5:
            v += steps[6.5]
        return int(v)

    spikes = detect_spikes(ts, [value(t) for t in ts], 64 * MiB, 0.5, series="device")
    assert len(spikes) == 2
    first, second = spikes
    assert first.series == "device"
    assert 1.9 <= first.start_s <= 2.0 and 2.0 < first.time_s <= 2.15  # reported when it stopped rising
    assert abs(first.rise_bytes - 300 * MiB) < 12 * MiB
    assert first.after - first.before == first.rise_bytes
    assert 6.4 <= second.start_s < 6.5 and second.time_s == pytest.approx(6.5)
    assert abs(second.rise_bytes - GiB) < 12 * MiB


@pytest.mark.parametrize("mib_per_s", [5, 200, 2000])
def test_smooth_ramp_any_steepness_gives_no_spike(mib_per_s):
    rng = random.Random(1)
    ts = times(8)
    values = [int(GiB + mib_per_s * MiB * t + rng.randint(-MiB, MiB)) for t in ts]
    assert detect_spikes(ts, values, 32 * MiB, 0.5) == []


def test_token_staircase_of_a_growing_cache_gives_no_spike():
    # 7 tokens/s, 6 MiB of KV per token, sampled at 20 Hz: steps every 2-3 samples
    ts = times(10)
    values = [GiB + 6 * MiB * int(t * 7) for t in ts]
    assert detect_spikes(ts, values, 32 * MiB, 0.5) == []
    # ...while a prefill-sized jump in the middle of it is one spike, and only the jump
    values = [v + (400 * MiB if t >= 5.0 else 0) for t, v in zip(ts, values)]
    (spike,) = detect_spikes(ts, values, 32 * MiB, 0.5)
    assert 400 * MiB <= spike.rise_bytes <= 400 * MiB + 6 * MiB
    assert spike.start_s == pytest.approx(4.95)


def test_relative_threshold_hides_small_rises_on_a_large_base():
    ts = times(4)
    values = [10 * GiB + (40 * MiB if t >= 2 else 0) for t in ts]
    assert len(detect_spikes(ts, values, 32 * MiB, 0.5)) == 1
    assert detect_spikes(ts, values, 32 * MiB, 0.5, min_rise_fraction=0.01) == []  # 1% of 10 GiB > 40 MiB


def test_flat_series_and_falls_give_nothing():
    ts = times(4)
    assert detect_spikes(ts, [GiB] * len(ts), MiB, 0.5) == []
    assert detect_spikes(ts, [GiB - (512 * MiB if t > 2 else 0) for t in ts], MiB, 0.5) == []


def test_incremental_detector_matches_batch_and_skips_none():
    ts = times(6)
    values: list[int | None] = [GiB + (256 * MiB if t >= 1.0 else 0) + (256 * MiB if t >= 4.0 else 0) for t in ts]
    values[10] = None  # a reading where the figure was not available
    det = SpikeDetector("process", 64 * MiB, 0.5)
    live = [s for t, v in zip(ts, values) if (s := det.feed(t, v)) is not None]
    tail = det.flush()
    assert tail is None
    assert live == detect_spikes(ts, values, 64 * MiB, 0.5, series="process")
    assert [round(s.time_s, 2) for s in live] == [1.0, 4.0]
    assert all(s.rise_bytes == 256 * MiB for s in live)


def test_spike_still_rising_at_the_end_is_flushed():
    ts = times(3)
    values = [GiB] * (len(ts) - 1) + [GiB + 500 * MiB]
    (spike,) = detect_spikes(ts, values, 64 * MiB, 0.5)
    assert spike.rise_bytes == 500 * MiB and spike.time_s == ts[-1]


def test_bad_input_is_a_clear_error():
    det = SpikeDetector("device", MiB)
    det.feed(1.0, GiB)
    with pytest.raises(ValueError, match="times must increase"):
        det.feed(1.0, GiB)
    with pytest.raises(ValueError, match="min_rise_bytes must be positive"):
        SpikeDetector("device", 0)
    with pytest.raises(ValueError, match="differ in length"):
        detect_spikes([0.0, 1.0], [1], MiB)


def spike_at(t: float, series: str = "device", rise: int = 512 * MiB) -> Spike:
    return Spike(time_s=t, series=series, rise_bytes=rise, before=GiB, after=GiB + rise, start_s=t - 0.1)


def test_cause_is_taken_from_the_nearest_app_event():
    s = spike_at(10.0)
    assert attribute_cause(s, [Event(9.95, EVENT_PREFILL, "eager, 512 tokens")]).startswith("prefill activations")
    assert "eager, 512 tokens" in attribute_cause(s, [Event(9.95, EVENT_PREFILL, "eager, 512 tokens")])
    assert attribute_cause(s, [Event(9.9, EVENT_DECODE, "dynamic")]) == CAUSE_DYNAMIC
    assert attribute_cause(s, [Event(9.5, EVENT_STATIC_PREALLOC, "4096 tokens")]) == CAUSE_STATIC
    assert attribute_cause(s, [Event(9.5, EVENT_SWITCH, "cache=static")]) == CAUSE_STATIC
    switch = attribute_cause(s, [Event(9.8, EVENT_SWITCH, "attention=mqa")])
    assert switch.startswith("mode switch: attention=mqa")
    # a load outranks the prefill that follows it in the same window
    assert attribute_cause(s, [Event(9.2, EVENT_LOAD, "weights"), Event(9.9, EVENT_PREFILL, "")]) == CAUSE_LOAD


def test_events_outside_the_window_do_not_count():
    s = spike_at(10.0)
    assert attribute_cause(s, [Event(5.0, EVENT_PREFILL, "x"), Event(10.5, EVENT_LOAD, "")]) == CAUSE_UNKNOWN
    assert attribute_cause(s, []) == CAUSE_UNKNOWN
    # a decode step with a non-dynamic cache does not explain a jump
    assert attribute_cause(s, [Event(9.95, EVENT_DECODE, "static")]) == CAUSE_UNKNOWN


def test_device_rise_without_this_process_is_another_process():
    ts = times(4)
    device = [GiB + (2 * GiB if t >= 2.0 else 0) for t in ts]
    own = [300 * MiB] * len(ts)  # this process's GPU memory did not move
    (spike,) = detect_spikes(ts, device, 64 * MiB, 0.5, series="device")
    own_rise = rise_between(ts, own, spike.start_s, spike.time_s)
    assert own_rise == 0
    # even with a decode step nearby, the memory went elsewhere
    assert attribute_cause(spike, [Event(1.99, EVENT_DECODE, "dynamic")], process_rise=own_rise) == CAUSE_OTHER_PROCESS
    # the same device spike matched by our own rise is ours
    own2 = [300 * MiB + (2 * GiB if t >= 2.0 else 0) for t in ts]
    own_rise2 = rise_between(ts, own2, spike.start_s, spike.time_s)
    assert own_rise2 == 2 * GiB
    assert attribute_cause(spike, [Event(1.99, EVENT_DECODE, "dynamic")], process_rise=own_rise2) == CAUSE_DYNAMIC
    # a spike in this process's own series is never "another process"
    assert attribute_cause(spike_at(2.0, series="process"), [], process_rise=0) == CAUSE_UNKNOWN


def test_rise_between_with_no_points_is_none():
    assert rise_between([0.0, 1.0], [1, 2], 5.0, 6.0) is None
    assert rise_between([0.0, 1.0, 2.0], [5, 3, 9], 0.0, 2.0) == 6


def reading(t: float, device: int | None, process_gpu: int | None = None, rss: int | None = None):
    from kvscope.core.runtimes.probes import MemoryReading
    return MemoryReading(time_s=t, device_used=device, process_gpu=process_gpu, process_rss=rss)


def test_monitor_reports_own_spikes_once_and_others_as_another_process():
    from kvscope.core.live.spikes import SpikeMonitor
    mon = SpikeMonitor(min_rise_bytes=64 * MiB)
    mon.add_event(Event(1.98, EVENT_PREFILL, "eager, 2048 tokens"))
    found: list[Spike] = []
    for t in times(6):
        own = GiB + (512 * MiB if t >= 2.0 else 0)
        other = 2 * GiB if t >= 4.0 else 0  # a second process allocates 2 GiB at 4 s
        found += mon.feed(reading(t, device=3 * GiB + own + other, process_gpu=own, rss=200 * MiB))
    found += mon.flush()
    assert mon.process_source == "process_gpu"
    assert [(s.series, round(s.time_s, 2), s.rise_bytes) for s in found] == [
        ("process", 2.0, 512 * MiB), ("device", 4.0, 2 * GiB)]
    assert found[0].cause.startswith("prefill activations") and "2048 tokens" in found[0].cause
    assert found[1].cause == CAUSE_OTHER_PROCESS


def test_monitor_on_cpu_watches_rss():
    from kvscope.core.live.spikes import SpikeMonitor
    mon = SpikeMonitor(min_rise_bytes=32 * MiB)
    mon.add_event(Event(0.9, EVENT_SWITCH, "attention=mha"))
    found = [s for t in times(3) for s in mon.feed(reading(t, device=None, rss=300 * MiB + (100 * MiB if t >= 1.0 else 0)))]
    assert mon.process_source == "process_rss"
    assert len(found) == 1 and found[0].series == "process" and found[0].rise_bytes == 100 * MiB
    assert found[0].cause.startswith("mode switch: attention=mha")

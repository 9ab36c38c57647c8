"""The decode peak's measuring schedule on the CPU (issue 37): the profiled step was a 0.2-1.2 s hitch every 64 tokens
on SmolLM2-135M; now its cadence follows its measured cost, and a switch is measured soon after it applies."""

from __future__ import annotations

from kvscope.core.runtimes.transformers.peak_cadence import PeakCadence


def _run(cadence: PeakCadence, steps: int, plain_s: float, measured_s: float, settings="a", forced_first=True):
    """``steps`` decode steps at made-up costs; returns the indices of the measured ones."""
    measured = []
    for i in range(steps):
        if cadence.due(settings, forced=forced_first and i == 0):
            cadence.measured(measured_s, settings)
            measured.append(i)
        else:
            cadence.plain(plain_s)
    return measured


def test_a_cheap_measurement_keeps_the_floor_of_64_tokens():
    got = _run(PeakCadence(every=64, share=0.03), 400, plain_s=0.1, measured_s=0.15)
    assert got[0] == 0
    assert all(b - a == 65 for a, b in zip(got, got[1:])), got  # 64 plain steps between two
    assert len(got) == 7


def test_a_costly_measurement_keeps_the_profilers_share_under_the_limit():
    """SmolLM2 on two busy cores: a 0.1 s step, 1.2 s profiled (1.1 s more): one measurement per ~367 tokens,
    not one per 64 (which spent 15 % of the run's time under the profiler)."""
    cadence = PeakCadence(every=64, share=0.03)
    got = _run(cadence, 2000, plain_s=0.1, measured_s=1.2)
    gaps = [b - a - 1 for a, b in zip(got, got[1:])]  # plain steps between two measurements
    assert gaps and all(g >= 64 for g in gaps)
    # Each periodic measurement's extra second is at most 3 % of the plain time since the one before.
    assert all(1.1 <= 0.03 * g * 0.1 + 1e-9 for g in gaps[1:]), gaps
    assert 5 <= len(got) <= 7, got  # still measured through the run: ~every 370 tokens


def test_a_switch_is_measured_a_few_tokens_after_it_applies():
    cadence = PeakCadence(every=64, share=0.03, settle=2)
    assert _run(cadence, 10, plain_s=0.1, measured_s=1.0) == [0]
    # The settings change at step 10: steps 10 and 11 plain (the switch's own pause stands alone), 12 measured.
    measured = []
    for i in range(10, 30):
        if cadence.due("b"):
            cadence.measured(1.0, "b")
            measured.append(i)
        else:
            cadence.plain(0.1)
    assert measured == [12], measured
    # Then the periodic rule again, from that measurement.
    assert not cadence.due("b")


def test_forced_wins_and_a_measurement_resets_the_count():
    cadence = PeakCadence(every=64, share=0.03)
    cadence.plain(0.1)
    assert cadence.due("a", forced=True)
    cadence.measured(0.2, "a")
    assert cadence.since_tokens == 0 and abs(cadence.extra_s - 0.1) < 1e-9
    assert not cadence.due("a")


def test_the_engine_measures_a_switch_soon_after_and_its_peak_is_the_replays():
    """The real engine on the embedded model: the first step after the prefill is measured, the next ones are not;
    after a switch (GQA) the second step on is, and its peak is the replay's (the switch's new K/V heads)."""
    import torch

    from kvscope.core.model.settings import RunSettings
    from kvscope.core.runtimes.transformers.engine import Engine
    from kvscope.core.runtimes.transformers.loading import load_model
    from tests.test_prefill_peak import EXACT_SLACK

    engine = Engine(load_model("embedded", device="cpu"), RunSettings(attn_impl="eager"), seed=0)
    engine.prefill(torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(5)), "prompt")
    first = engine.step()
    assert first.peak_bytes_observed is not None
    before = [engine.step() for _ in range(4)]
    assert all(s.peak_bytes_observed is None for s in before)
    assert engine.apply("attention", "gqa:2").event == "switch"
    after = [engine.step() for _ in range(3)]
    assert [s.peak_bytes_observed is not None for s in after] == [False, False, True]
    s = after[2]
    assert abs(s.peak_bytes_predicted - s.peak_bytes_observed) <= EXACT_SLACK
    assert s.peak_bytes_observed != first.peak_bytes_observed  # the switch moved it

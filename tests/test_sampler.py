"""MemorySampler on real Qt (offscreen): its rate on CPU, clean stops, errors, and NVML faked at the
pynvml boundary flowing through it."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before any QApplication exists

import time
from pathlib import Path

import pytest
import torch

from kvscope.core.runtimes.probes import NOTE_CPU, NOTE_PROCESS_NA, MemoryProbe, MemoryReading
from kvscope.workers.sampler import THREAD_NAME, MemorySampler
from tests.fake_pynvml import FakeGpu, FakeNvml
from tests.helpers import os_thread_names

GiB = 1 << 30


def sampler_threads() -> list[str]:
    return [n for n in os_thread_names() if THREAD_NAME.startswith(n)]  # comm is cut to 15 chars


def assert_sampler_thread_gone(qtbot) -> None:
    """After ``stop()`` (QThread finished) the OS thread itself exits within moments."""
    qtbot.waitUntil(lambda: sampler_threads() == [], timeout=300)


@pytest.fixture
def make_sampler():
    """Build samplers that are always stopped at teardown, even when a test fails half-way."""
    made: list[MemorySampler] = []

    def make(*args, **kwargs) -> MemorySampler:
        made.append(MemorySampler(*args, **kwargs))
        return made[-1]

    yield make
    for sampler in made:
        assert sampler.stop(timeout_s=2.0)


@pytest.fixture
def collected():
    return {"readings": [], "notes": [], "rates": [], "errors": []}


def connect(sampler: MemorySampler, sink: dict) -> None:
    sampler.readings.connect(sink["readings"].extend)
    sampler.note.connect(sink["notes"].append)
    sampler.rate_measured.connect(sink["rates"].append)
    sampler.errored.connect(sink["errors"].append)


def test_runs_at_its_set_rate_on_cpu_and_stops_cleanly(make_sampler, qtbot, collected):
    sampler = make_sampler("cpu", rate_hz=20.0)
    connect(sampler, collected)
    with qtbot.waitSignal(sampler.rate_measured, timeout=5000) as blocker:
        sampler.start()
        assert sampler.is_running()
    rate = blocker.args[0]
    assert 10.0 <= rate <= 25.0, f"achieved {rate:.1f} Hz for 20 Hz set"
    assert sampler_threads() == [THREAD_NAME[:15]], "the sampler thread should carry its name"

    t0 = time.monotonic()
    assert sampler.stop() is True
    stop_s = time.monotonic() - t0
    assert stop_s < 1.0
    assert not sampler.is_running()
    assert_sampler_thread_gone(qtbot)
    qtbot.wait(50)  # let the last queued batch arrive

    readings = collected["readings"]
    assert all(isinstance(r, MemoryReading) for r in readings)
    # ~1 s at 20 Hz before the first rate report, so well over a handful of readings
    assert len(readings) >= 10
    stamps = [r.time_s for r in readings]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    span = stamps[-1] - stamps[0]
    assert 10.0 <= (len(stamps) - 1) / span <= 25.0
    assert all(r.process_rss and r.process_rss > 0 and r.device_used is None for r in readings)
    assert collected["notes"] == [NOTE_CPU]  # each explanation once, not once per reading
    assert collected["errors"] == []


def test_readings_arrive_in_small_batches(make_sampler, qtbot):
    sampler = make_sampler("cpu", rate_hz=50.0, batch_s=0.1)
    sizes: list[int] = []
    sampler.readings.connect(lambda batch: sizes.append(len(batch)))
    sampler.start()
    qtbot.waitUntil(lambda: len(sizes) >= 4, timeout=5000)
    assert sampler.stop()
    # 50 Hz in 0.1 s batches: a handful per batch, never one giant batch
    assert max(sizes[:4]) <= 15
    assert sum(sizes[:4]) >= 8


def test_stop_wakes_a_slow_sampler_at_once(make_sampler, qtbot, collected):
    sampler = make_sampler("cpu", rate_hz=0.5)  # 2 s between readings
    connect(sampler, collected)
    with qtbot.waitSignal(sampler.note, timeout=3000):  # the first reading has happened
        sampler.start()
    t0 = time.monotonic()
    assert sampler.stop(timeout_s=1.0)
    assert time.monotonic() - t0 < 0.5  # not the 2 s sleep
    assert_sampler_thread_gone(qtbot)
    qtbot.wait(20)
    assert len(collected["readings"]) == 1  # the pending batch is flushed on the way out


def test_restart_after_stop_and_live_rate_change(make_sampler, qtbot):
    sampler = make_sampler("cpu", rate_hz=5.0)
    sampler.start()
    sampler.start()  # already running: nothing happens
    qtbot.waitUntil(lambda: len(sampler_threads()) >= 1, timeout=2000)  # named once it runs
    assert len(sampler_threads()) == 1
    assert sampler.stop()
    rates: list[float] = []
    sampler.rate_measured.connect(rates.append)
    sampler.start()
    sampler.set_rate(40.0)
    qtbot.waitUntil(lambda: len(rates) >= 1, timeout=5000)
    assert sampler.stop()
    assert rates[0] > 15.0  # well above the 5 Hz it started at
    assert_sampler_thread_gone(qtbot)


def test_bad_rate_is_refused():
    with pytest.raises(ValueError, match="sampling rate must be between 0 and"):
        MemorySampler("cpu", rate_hz=0)
    sampler = MemorySampler("cpu")
    with pytest.raises(ValueError, match="got 5000"):
        sampler.set_rate(5000)


def test_failing_probe_becomes_errored_and_the_thread_ends(make_sampler, qtbot):
    class BrokenProbe(MemoryProbe):
        def read(self) -> MemoryReading:
            raise RuntimeError("driver went away")

    sampler = make_sampler("cpu", probe_factory=lambda: BrokenProbe("cpu"))
    errors: list[str] = []
    sampler.errored.connect(errors.append)
    with qtbot.waitSignals([sampler.errored, sampler.finished], order="strict", timeout=3000):
        sampler.start()
    assert errors == ["memory sampler stopped: RuntimeError: driver went away"]
    assert sampler.stop()
    assert not sampler.is_running()
    assert_sampler_thread_gone(qtbot)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes NVML for a machine where torch cannot see CUDA")
def test_faked_nvml_with_na_per_process_flows_through(make_sampler, qtbot, collected):
    nvml = FakeNvml([FakeGpu(total=24 * GiB, used=5 * GiB, reserved=GiB // 4, compute=[(os.getpid(), None)])])
    sampler = make_sampler("cuda:0", rate_hz=20.0, probe_factory=lambda: MemoryProbe("cuda:0", nvml=nvml))
    connect(sampler, collected)
    sampler.start()
    qtbot.waitUntil(lambda: len(collected["readings"]) >= 3, timeout=5000)
    assert sampler.stop()
    r = collected["readings"][0]
    assert (r.device_total, r.device_used, r.device_reserved) == (24 * GiB, 5 * GiB, GiB // 4)
    assert r.process_gpu is None
    assert NOTE_PROCESS_NA in collected["notes"]
    assert nvml.initialised == 0  # the sampler closed its probe (nvmlShutdown) on the way out

"""Diagnosing in the window: sampler readings on the memory plot, the events table of a real scripted
run, spikes marked, the OOM forecast, the memory budget, the GPU processes panel (NVML faked at the
pynvml boundary only), and no thread left behind. Real Qt (offscreen), real worker, embedded model."""

from __future__ import annotations

import os
import threading

import pytest
from PySide6.QtCore import QSettings

from kvscope.core.base.sample import PHASE_EVENT
from kvscope.core.live.spikes import CAUSE_SWITCH
from kvscope.core.model.request import RunRequest
from kvscope.core.model.settings import RunSettings
from kvscope.core.prediction.forecast import format_duration
from kvscope.core.records.recording import RecordingReader
from kvscope.core.runtimes.probes import MemoryProbe, MemoryReading
from kvscope.ui.diagnose import GpuProcessesPanel
from kvscope.ui.main_window import MainWindow
from kvscope.ui.theme import theme
from kvscope.workers.gpu_poller import GpuProcessPoller
from tests.fake_pynvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeGpu, FakeNvml
from tests.helpers import run_in_window
from tests.synthetic import synthetic_samples

MiB = 1 << 20


def test_sampler_readings_reach_the_memory_plot_on_the_samples_time_axis(qtbot, window):
    assert window.sampling.sampler is not None and window.sampling.sampler.is_running()
    # A run long enough for the sampler to measure its rate (it reports once a second).
    request = RunRequest(source="embedded", max_new_tokens=100_000)
    window.start_run(request)
    qtbot.waitUntil(lambda: window.decode_tokens >= 5 and window.sampling.achieved_hz is not None, timeout=120_000)
    qtbot.wait(1200)
    with qtbot.waitSignal(window.run_finished, timeout=10_000):
        window.stop_run()
    window._redraw()
    plots = window.plots
    assert len(plots.readings) > 10
    # CPU: the sampler reads host memory; its curve replaces the once-per-token one.
    x, y = plots.curve_data("sampled_process_rss")
    assert len(x) == len(plots.readings) and (y > 50 * MiB).all()
    assert plots.curve_visible("sampled_process_rss") and not plots.curve_visible("process_rss")
    # One time axis: the readings span the run's tokens (the load comes before 0 s).
    token_times = plots.times.column("time")
    assert x[0] < token_times[0] and x[-1] >= token_times[-1] - 0.5
    assert window.sampling.achieved_hz == pytest.approx(20.0, rel=0.5)
    assert "Hz" in window.sampler_label.text() and "host memory" in window.sampler_label.text()
    print(f"sampler rate achieved in the window: {window.sampling.achieved_hz:.1f} Hz")


def test_scripted_run_puts_the_prefill_and_every_switch_in_the_events_table(qtbot, window, tmp_path):
    record = tmp_path / "scripted.jsonl"
    window.set_record_path(str(record))
    request = RunRequest(source="embedded", max_new_tokens=12, settings=RunSettings(max_context=256),
                         switches=((4, "attention", "mqa"), (8, "cache", "static")))
    run_in_window(qtbot, window, request)
    assert window.last_error == ""
    rows = window.events_table.rows
    kinds = [r.kind for r in rows if not r.kind.startswith("spike")]
    assert kinds == ["load", "prefill", "switch", "switch"]
    switches = [r for r in rows if r.kind == "switch"]
    assert [r.token for r in switches] == [4, 8]
    assert "mqa" in switches[0].detail and "static" in switches[1].detail
    assert window.events_table.rowCount() == len(rows)
    # File > Record: the run went to the file, and File > Export CSV exports it.
    assert not window.record_action.isChecked()  # one recording per choice
    with RecordingReader(record) as reader:
        recorded = list(reader)
    assert sum(1 for s in recorded if s.event == "switch") == 2
    assert window.files.last_recording == str(record)
    assert window.export_csv(str(tmp_path / "scripted.csv")) == len(recorded)


def test_a_spike_in_the_readings_is_marked_and_listed_with_its_cause(qtbot, window):
    window.sampling.sampler.stop()  # the synthetic readings are the only ones
    qtbot.wait(100)  # readings queued before the stop are delivered now, not later
    window.session.mode = "live"
    window.session.plot_readings = True
    window.session.new_monitor("cpu")
    samples = synthetic_samples(40, prompt_tokens=8, switches={20: "gqa:2"}, tokens_per_s=20.0)
    window.add_samples(samples)
    origin = window.session.origin
    assert origin is not None
    # 20 Hz host-memory readings over 2 s: flat at 500 MiB, then +48 MiB within 0.1 s at 1.0 s,
    # which is when the synthetic run switched to GQA (token 20 at 20 tok/s).
    readings = []
    for i in range(41):
        t = i * 0.05
        rss = 500 * MiB + (48 * MiB if t >= 1.05 else 0) + (24 * MiB if 1.0 <= t < 1.05 else 0)
        readings.append(MemoryReading(time_s=origin + t, process_rss=rss))
    window.session.take_readings(readings)
    window.session.feed_spikes(flush=True)
    window._redraw()
    assert len(window.plots.spikes) == 1
    mark = window.plots.spikes[0]
    assert mark.rise == 48 * MiB and mark.after == 548 * MiB
    assert 1.0 <= mark.time_s <= 1.5
    row = [r for r in window.events_table.rows if r.kind.startswith("spike")]
    assert len(row) == 1 and row[0].size == "+48.0 MiB"
    assert row[0].detail.startswith(CAUSE_SWITCH.split(":")[0])  # "mode switch: attention to gqa:2 ..."
    assert 20 <= row[0].token <= 22  # the token generated when the rise ended
    # The readings took over the memory plot's host curve, on the samples' time axis.
    x, _ = window.plots.curve_data("sampled_process_rss")
    assert x[0] == pytest.approx(0.0, abs=1e-6) and x[-1] == pytest.approx(2.0)


def test_oom_forecast_from_samples_and_readings_turns_into_a_warning(qtbot, window):
    window.sampling.sampler.stop()
    qtbot.wait(100)
    window.session.mode = "live"
    window.session.set_state("running")
    samples = synthetic_samples(40, prompt_tokens=8, gpu=True, tokens_per_s=200.0)
    window.add_samples(samples)
    last = samples[-1]
    bpt = 8 * 1024  # the synthetic MHA cache grows 8 KiB per token
    # Far from full: a forecast, no warning.
    window.sampling.device = "cuda:0"
    window.session.last_reading = MemoryReading(time_s=0.0, device_total=80 << 30, device_used=40 << 30)
    window.refresh_stats()
    tile = window.stats_panel.tiles["oom"]
    expected = last.token + (40 << 30) // bpt + 1
    assert expected == 5_242_928 and tile.value.text() == "token 5.2M"  # compact, to fit a big tile
    assert "GPU memory" in tile.note.text()
    assert not window.alert_label.isVisible()
    # 1,000 tokens of room at 200 tok/s: 5 s away, a visible warning.
    window.session.last_reading = MemoryReading(time_s=0.0, device_total=80 << 30, device_used=(80 << 30) - 1000 * bpt)
    window.refresh_stats()
    expected = last.token + 1000 + 1
    assert tile.value.text() == f"token {expected:,}"
    assert window.alert_label.isVisible()
    assert f"out of memory at token {expected:,} (about 5.0 s)" in window.alert_label.text()
    assert window.session.forecast.warning()
    window.session.set_state("idle")


def test_an_oom_event_is_marked_and_the_window_stays_usable(qtbot, window):
    samples = synthetic_samples(10, prompt_tokens=8)
    oom = samples[-1].replace(phase=PHASE_EVENT, event="oom",
                              text="out of memory in decode at token 18 (CUDA out of memory); cache freed. "
                                   "The predictor had said KV 144.0 KiB")
    window.add_samples(samples + [oom])
    window._redraw()
    assert window.plots.markers[-1].kind == "oom"
    assert window.alert_label.isVisible() and "The predictor had said KV 144.0 KiB" in window.alert_label.text()
    assert window.events_table.rows[-1].kind == "out of memory"
    assert window.controls.start_button.isEnabled()


def test_memory_budget_stops_the_run_with_forecast_and_start_works_again(qtbot, window):
    window.controls.budget_edit.setText("14.5MiB")  # the embedded model's weights are 13.07 MiB
    request = window.build_request()
    assert request.memory_budget == int(14.5 * MiB)
    request = RunRequest(source="embedded", max_new_tokens=400, memory_budget=request.memory_budget)
    run_in_window(qtbot, window, request)
    kinds = window.events_table.kinds()
    assert "forecast" in kinds and "budget reached" in kinds
    assert "memory budget" in window.last_error and window.alert_label.isVisible()
    assert window.plots.markers[-1].kind == "budget"
    assert window.state == "idle" and window.controls.start_button.isEnabled()
    tokens = window.decode_tokens
    assert 0 < tokens < 400
    # The window is usable again: the next run starts, and the alert is gone.
    run_in_window(qtbot, window, RunRequest(source="embedded", max_new_tokens=3))
    assert window.decode_tokens == 3 and window.last_error == "" and not window.alert_label.isVisible()


def test_a_bad_budget_is_a_clear_message(qtbot, window):
    window.controls.budget_edit.setText("lots")
    assert not window.start_run()
    assert window.controls.error_label.text().startswith("memory budget: cannot read size 'lots'")


def test_sampling_rate_menu_changes_the_sampler_and_is_remembered(qtbot, window, settings):
    window.rate_actions[50.0].trigger()
    assert window.sampling.sampler.rate_hz == 50.0
    window.save_settings()
    assert float(settings.value("diagnose/sampler_hz")) == 50.0


def test_snapshot_button_is_disabled_without_cuda_and_says_why(window):
    assert not window.run.cuda_available()  # this machine: CPU torch
    assert not window.controls.snapshot_button.isEnabled()
    assert "no CUDA GPU" in window.controls.snapshot_button.toolTip()


def test_gpu_processes_panel_lists_every_process_and_highlights_this_app(qtbot):
    me = os.getpid()
    nvml = FakeNvml([FakeGpu(80 << 30, 30 << 30, 1 << 30, compute=[(me, 3 << 30), (4242, None)]),
                     FakeGpu(80 << 30, 10 << 30, 1 << 30, compute=[(4343, 9 << 30)])])
    panel = GpuProcessesPanel(theme("dark"))
    qtbot.addWidget(panel)
    poller = GpuProcessPoller(0.05, probe_factory=lambda: MemoryProbe("cpu", nvml=nvml))
    poller.updated.connect(panel.show_processes)
    with qtbot.waitSignal(poller.updated, timeout=5_000):
        poller.start()
    assert poller.stop()
    table = panel.table
    assert table.rowCount() == 3 and not table.isHidden()
    cells = [[table.item(r, c).text() for c in range(table.columnCount())] for r in range(3)]
    mine = next(row for row in cells if row[1] == str(me))
    assert mine[2].endswith("(this app)") and mine[3] == "3.0 GiB"
    assert table.item(cells.index(mine), 2).font().bold()
    assert next(row for row in cells if row[1] == "4242")[3] == "n/a"  # N/A, never 0
    assert next(row for row in cells if row[1] == "4343")[0] == "1"
    assert not next(row for row in cells if row[1] == "4343")[2].endswith("(this app)")
    # The engine process (another pid) is this app's too, once the window names it.
    poller.set_app_pids({4343})
    with qtbot.waitSignal(poller.updated, timeout=5_000):
        poller.start()
    assert poller.stop()
    cells = [[panel.table.item(r, c).text() for c in range(panel.table.columnCount())] for r in range(3)]
    assert next(row for row in cells if row[1] == "4343")[2].endswith("(this app)")
    assert next(row for row in cells if row[1] == str(me))[2].endswith("(this app)")
    assert not next(row for row in cells if row[1] == "4242")[2].endswith("(this app)")


def test_gpu_processes_panel_without_a_driver_says_so(qtbot):
    panel = GpuProcessesPanel(theme("dark"))
    qtbot.addWidget(panel)
    nvml = FakeNvml([], init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    poller = GpuProcessPoller(0.05, probe_factory=lambda: MemoryProbe("cpu", nvml=nvml))
    poller.updated.connect(panel.show_processes)
    with qtbot.waitSignal(poller.updated, timeout=5_000):
        poller.start()
    assert poller.stop()
    assert panel.table.rowCount() == 0
    assert panel.note.text().startswith("no GPU processes: no NVIDIA driver")
    assert panel.table.isHidden()  # issue 12, item 10: the reason, not an empty table under it


def test_closing_the_window_stops_every_thread(qtbot, settings):
    before = {t.ident for t in threading.enumerate()}
    w = MainWindow(settings=settings)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: w.calculator.warm, timeout=60_000)
    w.start_run(RunRequest(source="embedded", max_new_tokens=100_000))
    qtbot.waitUntil(lambda: w.decode_tokens >= 2, timeout=120_000)
    w.close()
    assert not w.controller.is_running()
    assert not w.sampling.sampler.is_running() and not w.gpu_poller.is_running()
    assert not w.replay.is_running()
    if os.path.isdir("/proc/self/task"):
        # The OS's own list: the sampler, GPU-process and replay threads are named kvscope-*.
        def ours() -> list[str]:
            names = []
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        names.append(f.read().strip())
                except OSError:
                    pass  # ended while listing
            # Not the generation thread's name: torch's worker pool threads, started from it, inherit
            # its name and live on (a pool); that thread itself is checked by is_running() above.
            # Nor the engine process's pipe reader: the engine is the application's, shared by its
            # windows, and goes when the application quits (test_engine_host_shutdown_ends_process_and_reader).
            return [n for n in names if n.startswith("kvscope-") and not n.startswith("kvscope-generat")
                    and n != "kvscope-engine-"]

        qtbot.waitUntil(lambda: not ours(), timeout=5_000)
    # Python's list: no thread it knows of is still running (an ended Qt thread may leave a dummy entry).
    assert all(t.ident in before or isinstance(t, threading._DummyThread) or not t.is_alive()
               for t in threading.enumerate() if t is not threading.main_thread())


def test_engine_host_shutdown_ends_process_and_reader(qtbot):
    """What the application's quit does to the engine: the process exits, its reader thread ends."""
    from kvscope.workers.engine_link import EngineHost

    host = EngineHost()
    with qtbot.waitSignal(host.message, timeout=120_000, check_params_cb=lambda kind, *_: kind == "ready"):
        host.start()
    process, reader = host._process, host._reader.thread
    assert process.is_alive() and reader.isRunning() and host.pid == process.pid != os.getpid()
    host.shutdown(timeout_s=5.0)
    assert not process.is_alive() and process.exitcode == 0  # it quit when asked, not killed
    qtbot.waitUntil(lambda: reader.isFinished(), timeout=2_000)
    assert host.pid is None and not host.is_alive()


def test_durations_read_well():
    assert format_duration(4.25) == "4.2 s"
    assert format_duration(38) == "38 s"
    assert format_duration(720) == "12 min"
    assert format_duration(3.5 * 3600) == "3.5 h"
    assert format_duration(None) == "n/a"


def test_an_engine_that_cannot_start_fails_the_run_once_and_is_not_restarted_in_a_loop(qtbot):
    """The engine dies before it is ready: the run ends with one line naming the exit code, and the
    host does not respawn it by itself (a broken install must not become a process storm)."""
    from kvscope.workers.engine_link import EngineHost, HostedGenerationController
    from tests.helpers import engine_that_cannot_start

    host = EngineHost(target=engine_that_cannot_start)
    controller = HostedGenerationController(host=host)
    errors: list[str] = []
    controller.errored.connect(errors.append)
    with qtbot.waitSignal(controller.finished, timeout=60_000):
        controller.start(RunRequest(source="embedded", max_new_tokens=4))
    assert errors == ["the engine process ended during the run (exit code 3); the next run starts a new one"]
    assert not controller.is_running()
    qtbot.wait(1_500)
    assert host.starts <= 2 and not host.is_alive()  # the one at construction and the run's, no more
    host.shutdown()


def test_repeated_growth_spikes_are_one_row_that_counts_them(qtbot):
    """Issue 12, item 5: one row per dynamic-cache growth step flooded the table; a run of spikes of one
    cause is one row with a count and the total rise, and anything in between starts a new row."""
    from kvscope.core.live.spikes import Spike
    from kvscope.ui.diagnose import EventsTable
    from tests.synthetic import synthetic_samples as samples

    table = EventsTable(theme("dark"))
    qtbot.addWidget(table)
    growth = "dynamic-cache growth: the cache concatenates per layer"
    for k in range(10):
        table.add_spike(Spike(1.0 + k, "process", 4 << 20, (100 + 4 * k) << 20, (104 + 4 * k) << 20, growth), 10 * k)
    assert table.rowCount() == 1 and table.rows[0].kind == "spikes \u00d710 (this process)"
    assert table.item(0, 3).text() == "+40.0 MiB" and "100.0 MiB \u2192 140.0 MiB (until token 90)" in table.rows[0].detail
    switch = next(s for s in samples(30, switches={20: "mqa"}) if s.is_event).replace(time_s=20.0)
    table.add_event(switch)
    table.add_spike(Spike(21.0, "process", 4 << 20, 140 << 20, 144 << 20, growth), 200)
    table.add_spike(Spike(22.0, "process", 8 << 20, 144 << 20, 152 << 20, "mode switch"), 210)
    assert [r.kind for r in table.rows] == ["spikes \u00d710 (this process)", "switch", "spike (this process)",
                                            "spike (this process)"]
    assert table.rowCount() == 4


def test_the_context_end_is_named_when_it_comes_before_the_memory(qtbot):
    """Issue 12, item 6: "Out of memory: token 2.6M (about 3 days)" on a 4,096-token model; the
    context's end is the limit that comes first, and it says so (and no warning for the far one)."""
    from kvscope.core.prediction.forecast import oom_forecast
    from kvscope.ui.stats import StatsPanel

    # As the engine counts: token = generated so far, context_tokens = the 16-token prompt + those.
    samples = [s.replace(context_tokens=s.token + 16) for s in synthetic_samples(40, prompt_tokens=16)
               if not s.is_event]
    points = [(s.token, s.kv_bytes_reserved) for s in samples]
    last = samples[-1]
    far = oom_forecast(points, last, free=20 * 2**30, free_source="host memory", max_context=4096)
    assert far.context_first == 4096 - 16 and far.token > 2_000_000
    assert far.message() == (f"the context ends at token 4,080, before the host memory would run out "
                             f"(token {far.token:,})")
    assert not far.warning(10**9)
    near = oom_forecast(points, last, free=64 * 2**10, free_source="host memory", max_context=4096)
    assert near.context_first is None and near.token < 4080 and near.message().startswith("out of memory at token")
    panel = StatsPanel()
    qtbot.addWidget(panel)
    panel.show_forecast(far)
    assert panel.tiles["oom"].value.text() == "context first"

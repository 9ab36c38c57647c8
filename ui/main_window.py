"""The main window: the shell that wires the parts that show a run.

The parts own their state and say what happens through signals: the run's machinery (``kvscope.ui.run_control``:
the engine or a thread, replays, the memory sampler, starting, stopping and switching), the Live tab's layout
and widgets (``kvscope.ui.live_tab``: the controls, badges, plots, events, numbers and text), the File menu's outputs
(``kvscope.ui.file_actions``), the menus (``kvscope.ui.menus``), the status line (``kvscope.ui.status_line``), the calculator and the
Servers tab. The run itself is the session model (``kvscope.core.live.session.Session``, no Qt): the window forwards what the
run part delivers (samples, a model loaded, the end) to it, and renders what it announces. Two timers draw: a
fast one (~30 Hz) for curves and text, a slow one (1 Hz) for numbers. What stays here is the wiring, the rendering
of what the run and the session say, the window's settings and its shutdown; the entry points the menus and scripts
call are ``kvscope.ui.window_actions``'s, themes, presenter mode and the window's size ``kvscope.ui.window_looks``'s.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import QMainWindow, QScrollArea, QTabWidget, QWidget

from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.base.sample import Sample
from kvscope.core.live.breakdown import memory_breakdown
from kvscope.core.live.session import Session
from kvscope.core.model.settings import ATTN_IMPLS, attention_choices, cache_choices
from kvscope.ui.calculator import CalculatorTab
from kvscope.ui.controls import FIRST_START_TOKENS, KEYS_HELP  # noqa: F401 - FIRST_START_TOKENS: tests, docs
from kvscope.ui.file_actions import FileActions
from kvscope.ui.live_tab import (COMPACT_W, RIGHT_MAX_W, RIGHT_MIN_W, STACK_BELOW_W,  # noqa: F401 - tests read them
                                 LiveTab)
from kvscope.ui.menus import ATTENTION_KEYS, KEY_MAP, SAMPLER_RATES, build_menus  # noqa: F401 - the names the keys use
from kvscope.ui.run_control import DEFAULT_SAMPLER_HZ, RunControl
from kvscope.ui.servers import ServersTab
from kvscope.ui.stats import compute_stats
from kvscope.ui.status_line import StatusLine
from kvscope.ui.text_view import TEXT_BLOCK_CHARS  # noqa: F401 - TEXT_BLOCK_CHARS: tests
from kvscope.ui.theme import Theme, theme as make_theme
from kvscope.ui.window_actions import WindowActions
from kvscope.ui.window_looks import COMPACT_BANNER_BELOW_H, WindowLooks  # noqa: F401 - tests read it here
from kvscope.workers.gpu_poller import GpuProcessPoller

log = logging.getLogger(__name__)

ORG, APP = "KVScope", "KV Scope"
REDRAW_HZ = 30
STATS_MS = 1000


class MainWindow(WindowActions, WindowLooks, QMainWindow):
    """KV Scope's window. ``add_samples`` is the one way data gets in (live runs and replays)."""

    samples_added = Signal(int)  # decode tokens so far, after each batch
    run_finished = Signal()

    def __init__(self, settings: QSettings | None = None, controller=None, parent: QWidget | None = None,
                 start_engine: bool = True) -> None:
        """``start_engine`` False (a replay) starts the engine process and the memory sampler only
        when a live run starts: a replay loads no model and needs neither."""
        super().__init__(parent)
        self.setWindowTitle("KV Scope")
        self.qsettings = settings if settings is not None else QSettings(ORG, APP)
        self.theme_name = "dark"
        self.presenter = False
        self.theme: Theme = make_theme("dark")
        self.session = Session()
        self.sample_observers: list = []  # e.g. the --metrics-port exporter (kvscope.core.live.metrics): each gets every Sample
        self._build_parts(controller, start_engine)
        build_menus(self)
        shortcut = QShortcut(QKeySequence("Escape"), self)  # 1-5, F, C, Space, Ctrl+S: the menus' own shortcuts
        shortcut.setContext(Qt.ShortcutContext.WindowShortcut)
        shortcut.activated.connect(lambda: self.set_presenter(False) if self.presenter else None)
        self.addAction(self.presenter_action)
        self._connect()
        self.redraw_timer = self._timer(int(1000 / REDRAW_HZ), lambda: self._redraw(settle=False))
        self.redraw_timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.stats_timer = self._timer(STATS_MS, self.refresh_stats)
        self.restore_settings()
        self.apply_theme()
        self.session.set_state("idle")
        self.gpu_poller = GpuProcessPoller(1.0, parent=self)
        self.gpu_poller.updated.connect(self.gpu_panel.show_processes)
        self.run.engine_ready.connect(lambda pid: self.gpu_poller.set_app_pids({pid}))
        if self.run.host is not None and self.run.host.pid is not None:  # the engine's memory is "this app"'s
            self.gpu_poller.set_app_pids({self.run.host.pid})
        self.gpu_poller.start()
        if start_engine:
            self.run.start_sampling()
        self.demo_banner.offer_once(self.qsettings)

    def _timer(self, ms: int, slot) -> QTimer:
        timer = QTimer(self)
        timer.setInterval(ms)
        timer.timeout.connect(slot)
        timer.start()
        return timer

    # ============================================================================================
    # the parts

    def _build_parts(self, controller, start_engine: bool) -> None:
        self.status_line = StatusLine(self.statusBar())
        self.live = LiveTab(self.theme, self.status_line.sampler_label)
        live = self.live
        # The widgets the window's users (tests, scripts, the app) reach for by name.
        self.controls, self.badge_row, self.plots = live.controls, live.badge_row, live.plots
        self.badges = live.badge_row.badges
        self.demo_banner, self.demo_button, self.alert_label = live.demo_banner, live.demo_banner.button, live.alert
        self.events_table, self.gpu_panel, self.diag_tabs = live.events_table, live.gpu_panel, live.diag_tabs
        self.stats_panel, self.text_view, self.breakdown_view = live.stats_panel, live.text_view, live.breakdown_view
        self.stats_scroll, self.right_panel = live.stats_scroll, live.right_panel
        self.live_splitter, self.centre_splitter = live, live.centre_splitter
        self.sampler_label = self.status_line.sampler_label
        self.status_device, self.status_memory = self.status_line.device, self.status_line.memory

        self.calculator = CalculatorTab(self.theme)
        calculator_scroll = QScrollArea()  # at 720p the calculator scrolls, the window fits
        calculator_scroll.setWidget(self.calculator)
        calculator_scroll.setWidgetResizable(True)
        calculator_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.servers = ServersTab(self.theme)  # inference servers' /metrics (issue 15), scraped on its own thread
        self.tabs = QTabWidget()
        self.tabs.addTab(live, "Live")
        self.tabs.addTab(calculator_scroll, "Calculator")
        self.tabs.addTab(self.servers, "Servers")
        self.setCentralWidget(self.tabs)

        self.files = FileActions(self, self.plots, self.stats_panel, self.session, self.controls.snapshot_button,
                                 self._redraw, self.refresh_stats, lambda: self.theme_name)
        self.run = RunControl(self, self.session, self.controls, self.calculator, self.plots, self.files,
                              controller, start_engine)
        self.controller, self.replay, self.sampling = self.run.controller, self.run.replay, self.run.sampling

    def _connect(self) -> None:
        """The parts' signals, to what renders them."""
        run, files, live, status = self.run, self.files, self.live, self.status_line
        run.samples.connect(self.add_samples)
        run.loaded.connect(self.set_model_info)
        run.finished.connect(self._run_ended)
        run.starting.connect(live.clear)
        run.sampler_changed.connect(self._show_sampler_status)
        for part in (run, files):
            part.status.connect(status.message)
            part.error.connect(self._show_error)
        files.recording_changed.connect(self._show_recording)
        c = self.controls
        c.start_button.clicked.connect(lambda: self.run.start_run())
        c.pause_button.clicked.connect(run.toggle_pause)
        c.stop_button.clicked.connect(run.stop_run)
        c.switch_asked.connect(lambda key: run.request_switch(key, c.combo(key).currentData()))
        live.demo_banner.play.connect(self.play_demo)
        ev = self.session.events
        ev.state.connect(self._show_state)
        ev.settings.connect(self._show_settings)
        ev.text.connect(lambda kind, text: self.text_view.pending.append((kind, text)))
        ev.row.connect(self.events_table.add_event)
        ev.spike.connect(live.show_spike)
        ev.origin.connect(lambda origin: setattr(self.plots, "time_origin", origin))
        ev.readings.connect(self.plots.add_memory_readings)
        ev.alert.connect(lambda text, kind: self.alert_label.show_alert(text, kind, self.theme))
        ev.alert_cleared.connect(lambda _kind: self.alert_label.setVisible(False))
        ev.status.connect(status.message)
        ev.forecast.connect(lambda forecast, near: self.stats_panel.show_forecast(
            forecast, self.theme.warning if near else None))

    # ---- the session's state, read where the window's users (tests, scripts, the app) look for it

    # ============================================================================================
    # rendering what the run and the session say

    def add_samples(self, samples: list[Sample]) -> None:
        """Take a batch of samples (live or replayed): buffers now, drawing at the next frame."""
        if not samples:
            return
        self.plots.add_samples(samples)
        self.session.take_samples(samples)
        for observe in self.sample_observers:
            for sample in samples:
                observe(sample)
        self.samples_added.emit(self.session.decode_tokens)

    def set_model_info(self, info) -> None:
        """A model is loaded (or a recording opened): show it and what it can switch to."""
        self.controls.set_model(info.spec, str(info.device))
        self.controls.context_tokens = lambda: getattr(self.session.last_sample, "context_tokens", 0) or 0
        self.controls.tokens_ahead = self.session.tokens_ahead
        self.controls.run_max_context = info.max_context
        self.controls.set_choices(tuple(info.attention_choices) or attention_choices(info.spec),
                                  tuple(info.cache_choices) or cache_choices(info.device),
                                  tuple(info.attn_impl_choices) or ATTN_IMPLS)
        self.badge_row.show_model(info)
        self.setWindowTitle(f"KV Scope \u2014 {safe_text(info.label, limit=NAME_LIMIT)}")  # whole here, where the badge row is too narrow
        self.live.reserve_badges(self.theme)
        self.status_line.show_model(info)
        if self.mode == "live":  # a replay leaves the calculator alone (it reset it to the recording's model)
            self.calculator.set_spec(info.spec, source=f"{info.spec.name}")
            if info.total_memory and str(info.device).startswith(("cuda", "mps")):
                self.calculator.set_detected_memory(info.total_memory, info.device_name)
        self.run.follow_device(info)
        self.session.model_loaded(info)

    def _run_ended(self) -> None:
        self._redraw()
        self.refresh_stats()
        self.run_finished.emit()

    def _show_error(self, message: str) -> None:
        self.controls.error_label.setText(message)
        self.status_line.message(message, 10000)

    def _show_settings(self, s: Sample) -> None:
        """Badges and combos follow the settings a sample carries (the truth, after a switch)."""
        self.badge_row.show_settings(s)
        self.controls.show_settings(s)

    def _show_state(self, state: str) -> None:
        self.controls.show_state(state, self.controller is not None, self.run.cuda_available())
        self.badge_row.show_state(state, {"running": self.theme.curves["allocated"], "paused": self.theme.warning,
                                          "loading": self.theme.warning}.get(state, self.theme.muted))
        self.status_line.show_state(state)
        if state == "idle":
            self.files.run_ended()
        else:
            self._show_recording()

    def _show_recording(self) -> None:
        """The REC badge: the live run being recorded, or the next one armed."""
        recording = self.files.recording_now if self.session.busy and self.mode == "live" else None
        self.badge_row.show_recording(recording, self.files.armed())

    def _show_sampler_status(self) -> None:
        self.status_line.show_sampler(self.sampling, self.mode == "replay")

    def reset_view(self) -> None:
        """Forget the run shown: the session's data and the view of it."""
        self.session.reset()
        self.plots.drop_previous()
        self.live.clear()

    def _redraw(self, settle: bool = True) -> None:
        """A frame: curves, then any text that arrived. Never raises into Qt. The fixed-rate timer
        passes ``settle=False`` (view ranges change one per frame); other callers get them all."""
        try:
            self.session.tick()
            self.plots.redraw(settle=settle)
            self.text_view.flush(self.theme)
        except Exception:  # a drawing bug must not kill the timer (and the demo)
            log.exception("redraw failed")

    def refresh_stats(self) -> None:
        """The slow timer: numbers panel, forecast and status bar memory."""
        try:
            session = self.session
            host = None
            s = session.last_sample
            if s is not None and s.device_total is None:
                import psutil

                host = int(psutil.virtual_memory().available)
            req, info = session.request if session.mode == "live" else None, session.info
            stats = compute_stats(
                s, self.plots.slope_bytes_per_token, info.spec if info else None,
                batch=req.settings.batch if req else 1, kv_dtype=req.settings.kv_dtype if req else None,
                max_context=(req.settings.max_context if req and req.settings.max_context else
                             (info.max_context if info else None)), host_available=host,
                predicted_slope=session.predicted_slope)
            self.stats_panel.show_stats(stats)
            breakdown = memory_breakdown(s) if s is not None else None
            self.stats_panel.show_breakdown(breakdown)
            self.breakdown_view.show_breakdown(breakdown)
            session.refresh_forecast(self.sampling.device, host)
            if s is not None:
                self.status_line.show_memory(s)
        except Exception:
            log.exception("stats refresh failed")

    # ============================================================================================
    # settings and shutdown

    def restore_settings(self) -> None:
        s = self.qsettings
        geometry = s.value("window/geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1600, 1000)
        self.fit_to_screen()
        splitter = s.value("window/live_splitter")
        if splitter is not None:
            self.live_splitter.restoreState(splitter)
        self.theme_name = "light" if s.value("view/theme", "dark") == "light" else "dark"
        self.controls.restore(s)
        try:
            rate = float(s.value("diagnose/sampler_hz", DEFAULT_SAMPLER_HZ) or DEFAULT_SAMPLER_HZ)
        except (TypeError, ValueError):
            rate = DEFAULT_SAMPLER_HZ
        self.sampling.rate_hz = rate if 0 < rate <= 1000 else DEFAULT_SAMPLER_HZ
        if self.sampling.rate_hz in self.rate_actions:
            self.rate_actions[self.sampling.rate_hz].setChecked(True)
        centre = s.value("window/centre_splitter")
        if centre is not None:
            self.centre_splitter.restoreState(centre)
        self.calculator.restore_settings(s)

    def save_settings(self) -> None:
        s = self.qsettings
        if not self.presenter:
            s.setValue("window/geometry", self.saveGeometry())
            s.setValue("window/live_splitter", self.live_splitter.saveState())
            s.setValue("window/centre_splitter", self.centre_splitter.saveState())
        s.setValue("diagnose/sampler_hz", self.sampling.rate_hz)
        s.setValue("view/theme", self.theme_name)
        self.controls.save(s)
        self.calculator.save_settings(s)
        s.sync()

    def shutdown(self) -> None:
        """Stop the run and every helper thread (idempotent)."""
        self.redraw_timer.stop()
        self.stats_timer.stop()
        self.run.shutdown()
        if not self.gpu_poller.stop(timeout_s=2.0):
            log.warning("the GPU process thread did not stop within 2 s")
        self.calculator.shutdown()
        self.servers.shutdown()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt API)
        # Settings are saved after the worker stopped, so they never describe a half-stopped run.
        self.shutdown()
        self.save_settings()
        super().closeEvent(event)

"""The main window: the shell that shows a run. Controls on the left (``ui.controls``), badges, the
three live plots and the events table in the centre, numbers and the streamed text on the right,
the calculator in its own tab.

The run itself is the session model (``core.session.Session``, no Qt): the window forwards what
the controllers deliver (samples, readings, progress, errors, the end) and what the user does
(keys, combos, buttons) to it, and renders what it announces. Everything heavy happens elsewhere:
the model loads and generates in the engine process; samples arrive in small batches and are only
appended to ring buffers here. Two timers draw: a fast one (~30 Hz) for curves and text, a slow one
(1 Hz) for numbers.

Its parts live in their own files: the session (``core.session``), the controls (``ui.controls``),
the badge row (``ui.badges``), the streamed text (``ui.text_view``), the menus (``ui.menus``), the
File actions and replays (``ui.file_actions``). What stays here (about 750 lines) is the shell:
the layout, the wiring between controllers, session and widgets, the run's buttons and keys,
presenter mode, themes, the window's settings and shutdown — one job, the window's own.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from PySide6.QtCore import QEvent, QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (QFrame, QGroupBox, QHBoxLayout, QLabel, QMainWindow, QPushButton, QScrollArea, QSizePolicy, QSplitter, QTabWidget, QVBoxLayout,
                               QWidget)

from core.breakdown import memory_breakdown
from core.safe_text import NAME_LIMIT, safe_text
from core.sample import Sample
from core.session import Session
from core.settings import ATTN_IMPLS, attention_choices, cache_choices
from core.spec import SpecError, human_bytes
from ui.calculator import CalculatorTab
from ui.servers import ServersTab
from ui.controls import FIRST_START_TOKENS, KEYS_HELP, ControlsPanel  # noqa: F401 - FIRST_START_TOKENS: tests, docs
from ui.diagnose import EventsTable, GpuProcessesPanel
from ui.badges import STATE_TEXT, BadgeRow, ElidedLabel
from ui.file_actions import FileActions
from ui.menus import ATTENTION_KEYS, KEY_MAP, SAMPLER_RATES, build_menus  # noqa: F401 - the names the keys use
from ui.plots import LivePlots
from ui.breakdown_view import BreakdownView
from ui.stats import StatsPanel, compute_stats
from ui.text_view import TEXT_BLOCK_CHARS, StreamView  # noqa: F401 - TEXT_BLOCK_CHARS: tests
from ui.theme import Theme, stylesheet, theme as make_theme
from workers.gpu_poller import GpuProcessPoller
from workers.sampler import SamplerControl

log = logging.getLogger(__name__)

ORG, APP = "KVScope", "KV Scope"
REDRAW_HZ = 30
STATS_MS = 1000
#: Column widths (logical px) that let the window fit 1280x720 with every control reachable.
RIGHT_MIN_W, RIGHT_MAX_W = 200, 420
#: Narrower than this, the window lays itself out for a small screen (``_fit_layout_to_width``).
COMPACT_W = 1400
RIGHT_COMPACT_W = 230
#: A plots' column narrower than this stacks the memory plot over the predicted-vs-observed pair.
STACK_BELOW_W = 640
DEFAULT_SAMPLER_HZ = 20.0


def _make_controller(parent: QWidget, warm: bool):
    """The generation controller: the engine host process by default (started now when ``warm``,
    else at the first run), a thread of this process with KVSCOPE_ENGINE=thread (imports torch:
    done once, when the window is built)."""
    from workers.engine_link import HostedGenerationController, controller_class

    cls = controller_class()
    return cls(parent, warm=warm) if cls is HostedGenerationController else cls(parent)


class MainWindow(FileActions, QMainWindow):
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
        self.sample_observers: list = []  # e.g. the --metrics-port exporter (core.metrics): each gets every Sample
        self._engine_device = "auto"  # what 'auto' is in the engine process, once it has said
        self._cuda: bool | None = None
        self._replay_args: tuple[str, float] | None = None

        self.controller = controller
        if self.controller is None:
            try:
                self.controller = _make_controller(self, warm=start_engine)
            except ImportError as exc:  # a UI-only build (replay) still opens
                log.warning("generation worker not available: %s", exc)
        if self.controller is not None:
            self._connect_controller(self.controller)
        self.replay = None
        try:
            from workers.replay import ReplayController

            self.replay = ReplayController(self)
            self._connect_controller(self.replay)
        except ImportError as exc:
            log.warning("replay not available: %s", exc)
        host = getattr(self.controller, "host", None)
        self.sampling = SamplerControl(host, DEFAULT_SAMPLER_HZ, parent=self)
        self.sampling.readings.connect(self.session.take_readings)
        self.sampling.status_changed.connect(self._show_sampler_status)

        self._build_ui()
        build_menus(self)
        self._build_shortcuts()
        self._connect_session()

        self.redraw_timer = QTimer(self)
        self.redraw_timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.redraw_timer.setInterval(int(1000 / REDRAW_HZ))
        self.redraw_timer.timeout.connect(lambda: self._redraw(settle=False))
        self.redraw_timer.start()
        self.stats_timer = QTimer(self)
        self.stats_timer.setInterval(STATS_MS)
        self.stats_timer.timeout.connect(self.refresh_stats)
        self.stats_timer.start()

        self.restore_settings()
        self.apply_theme()
        self.session.set_state("idle")

        self.gpu_poller = GpuProcessPoller(1.0, parent=self)
        self.gpu_poller.updated.connect(self.gpu_panel.show_processes)
        if host is not None:  # the model's GPU memory is the engine process's: "this app" in the table
            host.message.connect(self._on_engine_message)
            if host.pid is not None:
                self.gpu_poller.set_app_pids({host.pid})
        self.gpu_poller.start()
        if start_engine:
            self.sampling.start(self._auto_device())
        self._maybe_offer_demo()

    # ---- the session's state, read where the window's users (tests, scripts, the app) look for it

    @property
    def state(self) -> str:
        return self.session.state

    @property
    def mode(self) -> str:
        return self.session.mode

    @property
    def last_error(self) -> str:
        return self.session.last_error

    @property
    def decode_tokens(self) -> int:
        return self.session.decode_tokens

    @property
    def info(self):
        return self.session.info

    # ============================================================================================
    # construction

    def _build_ui(self) -> None:
        self.controls = ControlsPanel()
        self.controls.start_button.clicked.connect(self.start_run)
        self.controls.pause_button.clicked.connect(self.toggle_pause)
        self.controls.stop_button.clicked.connect(self.stop_run)
        self.controls.snapshot_button.toggled.connect(self._snapshot_toggled)
        self.controls.switch_asked.connect(lambda key: self.request_switch(key, self.controls.combo(key).currentData()))

        # ---- centre: badges over the plots
        self.badge_row = BadgeRow()
        self.badges = self.badge_row.badges
        self.plots = LivePlots(self.theme)
        # ---- first start: the demo recording, offered without blocking anything
        self.demo_banner = QFrame()
        self.demo_banner.setObjectName("banner")
        db = QHBoxLayout(self.demo_banner)
        db.setContentsMargins(10, 4, 4, 4)
        demo_text = QLabel("New here? Replay a run recorded with the embedded model: MHA \u2192 GQA \u2192 MQA, "
                           "flash off \u2192 on, dynamic \u2192 static cache. No model or GPU needed.")
        demo_text.setWordWrap(True)
        self.demo_button = QPushButton("\u25b6 Play the demo recording")
        self.demo_button.setObjectName("primary")
        self.demo_button.clicked.connect(self.play_demo)
        demo_close = QPushButton("\u2715")
        demo_close.setToolTip("Hide (File \u203a Open recording plays it later)")
        demo_close.setFlat(True)
        demo_close.clicked.connect(lambda: self.demo_banner.setVisible(False))
        db.addWidget(demo_text, 1)
        db.addWidget(self.demo_button)
        db.addWidget(demo_close)
        self.demo_banner.setVisible(False)
        # ---- alerts: the OOM forecast warning, an out-of-memory error, the budget reached
        # It floats over the top of the plots rather than pushing them down: the layout never jumps
        # when a warning comes and goes mid-run.
        self.alert_label = QLabel("", self.plots)
        self.alert_label.setObjectName("alert")
        self.alert_label.setWordWrap(True)
        self.alert_label.setVisible(False)
        self.plots.installEventFilter(self)
        # ---- under the plots: the events table and the GPU processes
        self.events_table = EventsTable(self.theme)
        self.gpu_panel = GpuProcessesPanel(self.theme)
        self.diag_tabs = QTabWidget()
        self.diag_tabs.setDocumentMode(True)
        self.diag_tabs.addTab(self.events_table, "Events and spikes")
        self.diag_tabs.addTab(self.gpu_panel, "GPU processes")
        # Elided, not as wide as its text: a long note in presenter type would widen the window past the screen.
        self.sampler_label = ElidedLabel("memory sampler: starting\u2026")
        self.sampler_label.setObjectName("statNote")
        diag = QWidget()
        dl = QVBoxLayout(diag)
        dl.setContentsMargins(0, 0, 0, 0)
        dl.setSpacing(2)
        dl.addWidget(self.diag_tabs, 1)
        dl.addWidget(self.sampler_label)
        self.centre_splitter = QSplitter(Qt.Orientation.Vertical)
        self.centre_splitter.addWidget(self.plots)
        self.centre_splitter.addWidget(diag)
        self.centre_splitter.setStretchFactor(0, 4)
        self.centre_splitter.setStretchFactor(1, 1)
        self.centre_splitter.setSizes([700, 260])
        centre = QWidget()
        cv = QVBoxLayout(centre)
        cv.setContentsMargins(4, 4, 4, 0)
        cv.addWidget(self.demo_banner)
        cv.addWidget(self.badge_row)
        cv.addWidget(self.centre_splitter, 1)

        # ---- right: numbers and the generated text
        self.stats_panel = StatsPanel()
        self.text_view = StreamView()
        text_box = QGroupBox("Generated text")
        tl = QVBoxLayout(text_box)
        tl.setContentsMargins(4, 4, 4, 4)
        tl.addWidget(self.text_view)
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(4, 4, 4, 0)
        # The numbers scroll rather than push the window taller than a 720p projector.
        self.stats_scroll = QScrollArea()
        self.stats_scroll.setWidget(self.stats_panel)
        self.stats_scroll.setWidgetResizable(True)
        self.stats_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.stats_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.stats_scroll.setMinimumHeight(160)
        self.stats_scroll.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        text_box.setMinimumHeight(120)
        rv.addWidget(self.stats_scroll)
        self.breakdown_view = BreakdownView()  # where the memory went (core.breakdown), each slow tick
        rv.addWidget(self.breakdown_view)
        rv.addWidget(text_box, 1)
        right.setMinimumWidth(RIGHT_MIN_W)
        right.setMaximumWidth(RIGHT_MAX_W)
        self.right_panel = right

        self.live_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.live_splitter.addWidget(self.controls)
        self.live_splitter.addWidget(centre)
        self.live_splitter.addWidget(right)
        self.live_splitter.setStretchFactor(0, 0)
        self.live_splitter.setStretchFactor(1, 1)
        self.live_splitter.setStretchFactor(2, 0)
        self.live_splitter.setSizes([320, 1000, 280])

        self.calculator = CalculatorTab(self.theme)
        calculator_scroll = QScrollArea()  # likewise: at 720p the calculator scrolls, the window fits
        calculator_scroll.setWidget(self.calculator)
        calculator_scroll.setWidgetResizable(True)
        calculator_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.tabs = QTabWidget()
        self.tabs.addTab(self.live_splitter, "Live")
        self.tabs.addTab(calculator_scroll, "Calculator")
        self.servers = ServersTab(self.theme)  # inference servers' /metrics (issue 15), scraped on its own thread
        self.tabs.addTab(self.servers, "Servers")
        self.setCentralWidget(self.tabs)

        # ---- status bar
        # The status bar's labels yield (elided) too: in presenter type on 1280 px their text alone is wider
        # than the screen, and a status bar's permanent widgets keep their minimum width.
        self.status_device = ElidedLabel("no model loaded")
        self.status_device.setToolTip("The device the model runs on")
        self.status_memory = ElidedLabel("")
        self.status_memory.setToolTip("Device memory used / total (NVML), or this process's resident memory "
                                      "(RSS) without a GPU")
        self.status_state = QLabel("")
        self.status_sampler = QLabel("")
        self.status_sampler.setToolTip("The memory sampler: readings per second achieved (set in View \u203a Memory "
                                       "sampling rate)")
        sb = self.statusBar()
        sb.addPermanentWidget(self.status_sampler)
        sb.addPermanentWidget(self.status_device)
        sb.addPermanentWidget(self.status_memory)
        sb.addPermanentWidget(self.status_state)

    def _build_shortcuts(self) -> None:
        def key(seq: str, slot) -> None:
            sc = QShortcut(QKeySequence(seq), self)
            sc.setContext(Qt.ShortcutContext.WindowShortcut)
            sc.activated.connect(slot)

        # 1-5, F, C, Space and Ctrl+S are the menu actions' shortcuts (so the menus show them).
        key("Escape", lambda: self.set_presenter(False) if self.presenter else None)
        self.addAction(self.presenter_action)

    def _connect_controller(self, c) -> None:
        c.samples.connect(self.add_samples)
        c.loaded.connect(self.set_model_info)
        c.progress.connect(self.session.progress)
        c.errored.connect(self._on_error)
        c.finished.connect(self._on_finished)
        c.paused_changed.connect(lambda paused: self.session.set_state("paused" if paused else "running"))

    def _connect_session(self) -> None:
        """What the session announces, rendered."""
        ev = self.session.events
        ev.state.connect(self._show_state)
        ev.settings.connect(self._show_settings)
        ev.text.connect(lambda kind, text: self.text_view.pending.append((kind, text)))
        ev.row.connect(self.events_table.add_event)
        ev.spike.connect(self._show_spike)
        ev.origin.connect(lambda origin: setattr(self.plots, "time_origin", origin))
        ev.readings.connect(self.plots.add_memory_readings)
        ev.alert.connect(self._show_alert)
        ev.alert_cleared.connect(lambda _kind: self.alert_label.setVisible(False))
        ev.status.connect(lambda text, ms: self.statusBar().showMessage(text, ms))
        ev.forecast.connect(lambda forecast, near: self.stats_panel.show_forecast(
            forecast, self.theme.warning if near else None))

    # ============================================================================================
    # running

    def build_request(self):
        """The RunRequest the controls describe. Raises SpecError (SettingsError) with a user message."""
        return self.controls.build_request()

    def apply_request(self, request) -> None:
        """Show a RunRequest's choices in the controls (from the command line)."""
        self.controls.apply_request(request)

    def start_run(self, request=None) -> bool:
        """Start generating (``request`` or the controls' settings). False with a message if it cannot."""
        if self.controller is None:
            self._show_error("the generation worker is not available in this build")
            return False
        if self.session.busy:
            return False
        try:
            request = request or self.build_request()
        except SpecError as exc:
            self._show_error(str(exc))
            return False
        # File > Record and the snapshot button apply to this run (a request that names its own wins).
        if self.record_path and self.record_action.isChecked() and not request.record_path:
            request = replace(request, record_path=self.record_path)
        if self.snapshot_path and self.controls.snapshot_button.isChecked() and not request.snapshot_path:
            request = replace(request, snapshot_path=self.snapshot_path)
        self._hold_previous_run(request)  # before this request replaces the last one
        self.session.mode = "live"
        self.session.request = request
        if not self.calculator.warm and getattr(self.controller, "host", None) is None:
            # Thread mode: transformers may still be importing in the calculator's thread, and importing
            # it from the generation thread at the same time breaks it. Start when that is done (no UI
            # wait). The engine process imports it in its own process: nothing to wait for.
            self._start_after_warm_up()
            self.statusBar().showMessage("preparing transformers\u2026")
            return True
        self._start_now(request)
        return True

    def _start_after_warm_up(self) -> None:
        """Start what was asked (a run or a replay) once the calculator's thread has imported
        transformers; the window does not wait meanwhile."""
        self.calculator.warm_up()
        self.session.set_state("loading")
        self.calculator.warmed.connect(self._start_when_warm, Qt.ConnectionType.SingleShotConnection)

    def _start_when_warm(self) -> None:
        if self.state == "loading" and self.mode == "replay" and self._replay_args is not None:
            self._start_replay_now(*self._replay_args)
        elif self.state == "loading" and self.session.request is not None:
            self._start_now(self.session.request)

    def _start_now(self, request) -> None:
        self._show_sampler_status()
        self._clear_view()
        self.controls.error_label.setText("")
        if self.sampling.sampler is None:  # a window opened for a replay: the first live run starts it
            self.sampling.start(self._auto_device())
        self.session.begin_live(request, self.sampling.device)
        self.statusBar().showMessage(f"loading {request.source}\u2026")
        if request.record_path:
            self.last_recording = request.record_path
            self.recording_now = request.record_path
            # One recording per choice: the next run must not overwrite (or fail on) this file.
            self.record_action.setChecked(False)
            self.record_path = None
        if request.snapshot_path:
            self.controls.snapshot_button.setChecked(False)
        self.show_recording_badge()
        self.controller.start(request)

    def _hold_previous_run(self, request) -> None:
        """The live run shown (if it was one) stays on the KV plot, dotted, under the next live run of the same
        model: run it with transformers, then with llama.cpp (or with two settings), and both curves are there.
        A replay, or another model, drops it (like with like)."""
        previous = self.session.request
        same = (self.session.mode == "live" and previous is not None and self.session.decode_tokens > 0
                and previous.source == request.source)
        if same:
            runtime = getattr(previous, "runtime", "transformers")
            cache = self.plots.tokens_cache or ""
            self.plots.hold_previous(f"before: {runtime}{'' if cache in ('', 'dynamic') else ' ' + cache}")
        else:
            self.plots.drop_previous()

    def _active_controller(self):
        return self.replay if self.mode == "replay" else self.controller

    def stop_run(self) -> None:
        controller = self._active_controller()
        if controller is None or self.state == "idle":
            return
        self.session.set_state("stopping")
        # Cooperative: the loop ends after the current token. Short wait, then the finished signal
        # finishes the job, so a slow token never freezes the window.
        if controller.stop(timeout_s=0.2):
            self._on_finished()

    def toggle_pause(self) -> None:
        controller = self._active_controller()
        if controller is None:
            return
        if self.state == "running":
            controller.pause()
        elif self.state == "paused":
            controller.resume()

    recording_now: str | None = None  # the live run being recorded (the REC badge names it)

    def show_recording_badge(self) -> None:
        recording = self.recording_now if self.session.busy and self.mode == "live" else None
        self.badge_row.show_recording(recording, self.record_path if self.record_action.isChecked() else None)

    # ---- the engine and the memory sampler

    def _cuda_available(self) -> bool:
        if self._cuda is None:
            device = self._auto_device()
            if device == "auto":
                return False  # the engine has not said yet
            self._cuda = device.startswith("cuda")
        return self._cuda

    def _auto_device(self) -> str:
        """'cuda' where torch sees a GPU, else 'mps' or 'cpu'. With the engine process, the engine
        says which ('auto' until it has: this process never imports torch); in thread mode
        core.loading decides here."""
        if getattr(self.controller, "host", None) is not None:
            return self._engine_device
        try:
            from core.loading import resolve_device

            return resolve_device("auto")
        except Exception:  # noqa: BLE001 - a UI-only build: host memory is what there is
            return "cpu"

    def _on_engine_message(self, kind: str, payload: object, run: object) -> None:
        if kind == "ready":
            self.gpu_poller.set_app_pids({int(payload)})
        elif kind == "device":
            self._engine_device = str(payload)
            self._cuda = self._engine_device.startswith("cuda")
            self.sampling.device_resolved(self._engine_device)  # the engine's sampler read 'auto' as this

    def set_sampler_rate(self, hz: float) -> None:
        self.sampling.set_rate(hz)
        if hz in getattr(self, "rate_actions", {}):
            self.rate_actions[hz].setChecked(True)

    def _show_sampler_status(self) -> None:
        sampling = self.sampling
        rate = sampling.rate_text()
        note = sampling.notes[0] if sampling.notes else ""
        if self.mode == "replay":
            # The sampler reads this machine; a replay shows the memory that was recorded.
            note = "replay: memory as recorded (spikes from the recorded tokens)"
        self.sampler_label.setText(f"memory sampler {rate} (set {sampling.rate_hz:g} Hz)"
                                   + (f" \u00b7 {note}" if note else ""))
        self.sampler_label.setToolTip("\n".join([f"device probed: {sampling.device}"] + sampling.notes))
        self.status_sampler.setText(f"sampler {rate}")

    # ---- what the session announces

    def _show_spike(self, spike, token: int | None) -> None:
        self.plots.add_spike(spike.time_s, spike.after, spike.rise_bytes, spike.cause)
        self.events_table.add_spike(spike, token)

    def _show_alert(self, text: str, kind: str) -> None:
        color = self.theme.error if kind == "error" else self.theme.warning
        self.alert_label.setText(text)
        self.alert_label.setStyleSheet(f"QLabel#alert {{ color: {color}; background: {self.theme.panel}; border: 2px "
                                       f"solid {color}; border-radius: 6px; padding: 6px 10px; font-weight: 700; "
                                       f"font-size: {self.theme.title_pt}pt; }}")
        self.alert_label.setVisible(True)
        self._place_alert()

    def _place_alert(self) -> None:
        """Across the top of the plots, as tall as its text needs."""
        width = max(self.plots.width() - 24, 100)
        self.alert_label.setFixedWidth(width)
        self.alert_label.setFixedHeight(self.alert_label.heightForWidth(width))
        self.alert_label.move(12, 6)
        self.alert_label.raise_()

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._fit_layout_to_width()

    def _fit_layout_to_width(self) -> None:
        """Below ``COMPACT_W`` (1024x768, 1280x720, 1366x768) the numbers column narrows and the memory plot gets
        60 % of the bottom row; where the plots' column is still under ``STACK_BELOW_W`` (1024 px with the
        controls shown) the memory plot and the predicted-vs-observed pair go one above the other, each the
        column's whole width (side by side they got ~240 px each: titles, time axis and legend cut).
        Applied when the window crosses a width, so a splitter the user drags stays where it is meanwhile."""
        compact = self.width() < COMPACT_W
        left = 0 if self.presenter else max(self.controls.minimumWidth(), 1)
        right = max(self.right_panel.minimumWidth(), RIGHT_COMPACT_W) if compact else None
        centre = self.width() - left - (right or RIGHT_MAX_W)
        # Not in presenter type: stacked, its plots' minimum heights make the window taller than a 720p screen.
        stacked = compact and centre < STACK_BELOW_W and not self.presenter
        key = (compact, stacked, self.presenter)
        if key == getattr(self, "_layout_key", None):
            return
        self._layout_key = key
        bottom = self.plots.splitter.widget(1)
        if isinstance(bottom, QSplitter):
            bottom.setOrientation(Qt.Orientation.Vertical if stacked else Qt.Orientation.Horizontal)
            bottom.setCollapsible(0, False)
            bottom.setCollapsible(1, False)
            bottom.setSizes([3000, 2000] if compact else [1000, 1000])  # in proportion
        if stacked:
            self.centre_splitter.setSizes([8000, 2000])  # the plots take 80 % of the height, the events the rest
            self.plots.splitter.setSizes([3000, 5000])  # the KV plot over the two others
        else:
            self.plots.splitter.setSizes([3000, 2000])  # the KV plot 3:2 over the row of the others, as built
        if compact:
            total = max(sum(self.live_splitter.sizes()), self.width())
            self.live_splitter.setSizes([left, max(total - left - right, 1), right])

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt's name
        if watched is self.plots and event.type() == QEvent.Type.Resize and self.alert_label.isVisible():
            self._place_alert()
        return super().eventFilter(watched, event)

    def _show_settings(self, s: Sample) -> None:
        """Badges and combos follow the settings a sample carries (the truth, after a switch)."""
        self.badge_row.show_settings(s)
        self.controls.show_settings(s)

    def _reserve_badges(self) -> None:
        """The attention and cache badges as wide as the longest choice they may show."""
        self.badge_row.reserve("attention", [c.upper() for c in self.controls.attention_choices], self.theme.title_pt)
        self.badge_row.reserve("cache", [k for k, _ in self.controls.cache_choices], self.theme.title_pt)
        # The kernels a CPU or GPU run names most (core/kernels.py measures them); every run state, whole.
        self.badge_row.reserve("kernel", ["sdpa-flash-cpu", "sdpa-math", "sdpa-flash", "eager"], self.theme.title_pt)
        self.badge_row.reserve("state", list(STATE_TEXT.values()), self.theme.title_pt, most=400)

    def _show_state(self, state: str) -> None:
        self.controls.show_state(state, self.controller is not None, self._cuda_available())
        self.badge_row.show_state(state, {"running": self.theme.curves["allocated"], "paused": self.theme.warning,
                                          "loading": self.theme.warning}.get(state, self.theme.muted))
        self.status_state.setText(STATE_TEXT[state])
        if state == "idle":
            self.recording_now = None
        self.show_recording_badge()

    def _clear_view(self) -> None:
        """Clear plots, text and numbers (a new run or a new recording)."""
        self.plots.reset()
        self.text_view.reset()
        self.stats_panel.show_stats(compute_stats(None, None, None))
        self.stats_panel.show_forecast(None)
        self.events_table.clear_rows()

    def reset_view(self) -> None:
        """Forget the run shown: the session's data and the view of it."""
        self.session.reset()
        self.plots.drop_previous()
        self._clear_view()

    # ---- signals from the controller

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
        self.controls.set_choices(tuple(info.attention_choices) or attention_choices(info.spec),
                                  tuple(info.cache_choices) or cache_choices(info.device),
                                  tuple(info.attn_impl_choices) or ATTN_IMPLS)
        self.badge_row.show_model(info)
        self.setWindowTitle(f"KV Scope \u2014 {safe_text(info.label, limit=NAME_LIMIT)}")  # whole here, where the badge row is too narrow
        self._reserve_badges()
        memory = f" \u00b7 {human_bytes(info.total_memory)}" if info.total_memory else ""
        self.status_device.setText(f"{info.device_name}{memory}")
        self.statusBar().showMessage(f"loaded {safe_text(info.label, limit=NAME_LIMIT)} on {info.device_name} ({info.dtype})", 5000)
        if self.mode == "live":  # a replay leaves the calculator alone (it reset it to the recording's model)
            self.calculator.set_spec(info.spec, source=f"{info.spec.name}")
        if self.mode == "live" and info.total_memory and str(info.device).startswith(("cuda", "mps")):
            self.calculator.set_detected_memory(info.total_memory, info.device_name)
        if self.mode == "live" and str(info.device) != self.sampling.device:
            # The probe must read the device the model is on (NVML and the allocator of that GPU).
            self.sampling.start(str(info.device))
        self.session.model_loaded(info)

    def _on_error(self, message: str) -> None:
        self.session.error(message)
        self._show_error(message)

    def _on_finished(self) -> None:
        if not self.session.finished():
            return
        self._redraw()
        self.refresh_stats()
        self.run_finished.emit()

    def _show_error(self, message: str) -> None:
        self.controls.error_label.setText(message)
        self.statusBar().showMessage(message, 10000)

    # ---- live switches

    def request_switch(self, key: str, value: str) -> None:
        """Switch ``key`` (attention / attn-impl / cache) to ``value`` now, or set it for the next run."""
        self.controls.select(self.controls.combo(key), value)
        self.controls.grey_what_cannot_run()  # what each key offers next follows the settings asked
        if key == "attn-impl" and value != "flash":
            self.controls.last_non_flash = value
        if self.controller is not None and self.mode == "live" and self.state in ("running", "paused", "loading"):
            if not self.session.switch_sent(key, value):
                return  # the same switch is already on its way (or nothing to change)
            self.controller.switch(key, value)  # the engine keeps only the last pending press per axis
            pending = self.session.switches_pending
            if not pending:
                self.statusBar().showMessage(f"{key}: staying with {value}", 3000)
                return
            queued = f" ({pending} queued)" if pending > 1 else ""
            self.statusBar().showMessage(f"switching {key} to {value} after this token\u2026{queued}")

    def attention_key(self, n: int) -> None:
        """Keys 1-5: mha, the middle GQA choice, mqa, mla, the smallest window (its plateau shows soonest)."""
        wanted = self.controls.attention_for_key(n)
        if wanted is None:
            names = {1: "MHA", 2: "GQA", 3: "MQA", 4: "MLA", 5: "a sliding window"}
            self.statusBar().showMessage(f"{names[n]} is not available: {self.controls.last_problem}", 6000)
            return
        self.request_switch("attention", wanted)

    def toggle_flash(self) -> None:
        kernel = self.controls.flash_toggled()
        if kernel is None:
            self.statusBar().showMessage(f"flash attention is not available here: {self.controls.last_problem}", 6000)
        else:
            self.request_switch("attn-impl", kernel)

    def next_cache(self) -> None:
        cache = self.controls.next_cache()
        if cache is None:
            self.statusBar().showMessage(self.controls.last_problem, 6000)
        else:
            self.request_switch("cache", cache)

    # ============================================================================================
    # drawing

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
                if s.device_used is not None and s.device_total is not None:
                    self.status_memory.setText(f"GPU {human_bytes(s.device_used)} / {human_bytes(s.device_total)}")
                elif s.process_rss is not None:
                    self.status_memory.setText(f"host: this process {human_bytes(s.process_rss)} (RSS)")
        except Exception:
            log.exception("stats refresh failed")

    # ============================================================================================
    # looks

    def set_theme(self, name: str) -> None:
        self.theme_name = "light" if name == "light" else "dark"
        self.apply_theme()

    def set_presenter(self, on: bool, fullscreen: bool = True) -> None:
        """Presenter mode: full screen, large type, thick lines, high contrast; the controls hide (keys drive)."""
        was = self.presenter
        self.presenter = bool(on)
        self.presenter_action.setChecked(self.presenter)
        if self.presenter and not was:
            self._normal_geometry = self.saveGeometry()  # leaving presenter mode puts the window back
        if self.presenter:
            self.controls.setVisible(False)
            self.demo_banner.setVisible(False)  # the first-start offer is not for the audience (half a 768 px plot)
        screen = self.screen() or QGuiApplication.primaryScreen()
        wide = screen is None or screen.availableGeometry().width() >= 1600
        self.right_panel.setMaximumWidth(600 if self.presenter else RIGHT_MAX_W)
        self.right_panel.setMinimumWidth((540 if wide else 340) if self.presenter else RIGHT_MIN_W)
        # Large type: on a wide screen the numbers go two abreast so the streamed text keeps some room
        # (on 1280 px they stay one column and scroll); the events table yields some height to the plots.
        self.stats_panel.set_columns(2 if self.presenter and wide else 1)
        if self.presenter and not was:
            self._normal_centre_sizes = self.centre_splitter.sizes()
            total = max(sum(self._normal_centre_sizes), 1)
            self.centre_splitter.setSizes([int(total * 0.72), int(total * 0.28)])
        self.apply_theme()
        self._fit_layout_to_width()  # the controls come and go: the plots' column changes width
        # The controls come back after the normal type is in force: shown while the presenter type's
        # wide badges still were, they would grow the window past its normal size.
        self.controls.setVisible(not self.presenter)
        if fullscreen:
            if self.presenter:
                self.showFullScreen()
            else:
                self.showNormal()
        if not self.presenter and was and getattr(self, "_normal_geometry", None) is not None:
            # After the normal layout's minimum sizes are in force (pending layout requests), else the
            # presenter layout's wider minimum would clamp the restored width.
            geometry, sizes = self._normal_geometry, getattr(self, "_normal_centre_sizes", None)

            def give_back() -> None:
                self.restoreGeometry(geometry)
                if sizes:
                    self.centre_splitter.setSizes(sizes)

            QTimer.singleShot(0, give_back)

    def apply_theme(self) -> None:
        old = self.theme
        self.theme = make_theme(self.theme_name, self.presenter)
        self.text_view.recolor(old, self.theme)
        self.setStyleSheet(stylesheet(self.theme))
        self._reserve_badges()  # the type size changed (presenter mode): so did the widest choice
        self.plots.apply_theme(self.theme)
        self.breakdown_view.apply_theme(self.theme)
        self.calculator.apply_theme(self.theme)
        self.servers.apply_theme(self.theme)
        self.events_table.recolor(old, self.theme)
        self.gpu_panel.theme = self.theme
        if self.theme_name in getattr(self, "theme_actions", {}):
            self.theme_actions[self.theme_name].setChecked(True)
        self._show_state(self.state)

    # ============================================================================================
    # settings

    def fit_to_screen(self) -> None:
        """Never larger than the screen's free area (a 1280x720 projector, a remembered size from a bigger
        monitor): shrink to it, title bar included, and move fully onto it."""
        screen = self.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return
        free = screen.availableGeometry()
        title = 32  # the window manager's title bar, not part of our geometry before the window is shown
        width, height = min(self.width(), free.width()), min(self.height(), free.height() - title)
        if (width, height) != (self.width(), self.height()):
            self.resize(max(width, self.minimumSizeHint().width()), max(height, self.minimumSizeHint().height()))
            self.move(free.left(), free.top())

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
        if self.controller is not None and self.controller.is_running():
            if not self.controller.stop(timeout_s=5.0):
                if hasattr(self.controller, "kill"):  # the engine process: end it, memory and all
                    self.controller.kill()
                else:
                    log.warning("the generation thread did not stop within 5 s")
        if self.replay is not None and self.replay.is_running():
            self.replay.stop(timeout_s=2.0)
        if not self.sampling.stop(timeout_s=2.0):
            log.warning("the memory sampler thread did not stop within 2 s")
        if not self.gpu_poller.stop(timeout_s=2.0):
            log.warning("the GPU process thread did not stop within 2 s")
        self.calculator.shutdown()
        self.servers.shutdown()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt API)
        # Settings are saved after the worker stopped, so they never describe a half-stopped run.
        self.shutdown()
        self.save_settings()
        super().closeEvent(event)

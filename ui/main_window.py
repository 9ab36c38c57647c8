"""The main window: controls, the three live plots, streaming text, live numbers, the calculator tab.

Everything heavy happens elsewhere: the model loads and generates in the generation worker's
thread; samples arrive in small batches and are only appended to ring buffers here. Two timers
draw: a fast one (~30 Hz) for curves and text, a slow one (1 Hz) for numbers.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QColor, QGuiApplication, QKeySequence, QShortcut, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFrame,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QSizePolicy,
    QSplitter,
    QStackedWidget,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from core.attention import parse_attention
from core.caches import parse_cache
from core.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from core.settings import ATTN_IMPLS, RunSettings, attention_choices, cache_choices, parse_attn_impl
from core.spec import SpecError, human_bytes, load_spec, parse_size
from core.spikes import EVENT_LOAD, EVENT_SWITCH, Event, SpikeMonitor
from ui.calculator import CalculatorTab
from ui.diagnose import (OOM_WARN_S, EventsTable, GpuProcessesPanel, GpuProcessPoller, oom_forecast, reading_from_sample,
                         spike_events, spike_threshold)
from ui.plots import LivePlots
from ui.screenshot import ScreenshotError, default_path, save_widget
from ui.stats import StatsPanel, compute_stats
from ui.theme import Theme, stylesheet, theme as make_theme

log = logging.getLogger(__name__)

ORG, APP = "KVScope", "KV Scope"
REDRAW_HZ = 30
STATS_MS = 1000
SOURCES = ("embedded", "folder", "hub")
#: New tokens at first start: a run long enough to watch and to press every key in (the embedded model's
#: context is 4,096 tokens); the window remembers the user's own choice after that.
FIRST_START_TOKENS = 3000
#: Column widths (logical px) that let the window fit 1280x720 with every control reachable.
CONTROLS_MIN_W, RIGHT_MIN_W, RIGHT_MAX_W = 300, 200, 420
SAMPLER_RATES = (5.0, 10.0, 20.0, 50.0, 100.0)
DEFAULT_SAMPLER_HZ = 20.0
#: Readings reach the spike monitor this late, so the run's events (which arrive in their own
#: batches) are known before the readings around them are judged.
SPIKE_LAG_S = 0.3
#: After a run ends the memory plot keeps taking readings this long (the drop when memory is freed).
READINGS_TAIL_S = 2.0
#: The longest paragraph the text view is given (characters); longer streams are cut into paragraphs.
TEXT_BLOCK_CHARS = 2048
ATTENTION_KEYS = {1: "MHA", 2: "GQA", 3: "MQA", 4: "MLA", 5: "Sliding window"}
KEY_MAP = (("1", "MHA: every query head has its own K/V head"),
           ("2", "GQA: the middle group count the model allows"),
           ("3", "MQA: one K/V head"), ("4", "MLA: a compressed latent (re-runs the tokens so far)"),
           ("5", "sliding window: the smallest offered (its plateau shows soonest)"),
           ("F", "flash attention on / off"), ("C", "next cache strategy"), ("Space", "pause / resume"),
           ("F11", "presenter mode (Esc leaves it)"), ("Ctrl+S", "screenshot to your Pictures folder"),
           ("Ctrl+O", "open a recording"), ("Ctrl+Q", "quit"), ("F1", "this list"))
KEYS_HELP = "1\u20135 attention \u00b7 F flash \u00b7 C cache \u00b7 Space pause \u00b7 F11 presenter \u00b7 Ctrl+S screenshot"


def _insert_bounded(cursor: QTextCursor, text: str, fmt: QTextCharFormat, block_len: int) -> int:
    """Insert ``text`` at ``cursor`` (the end of the text view), starting a new paragraph whenever the
    current one (``block_len`` characters so far) would pass TEXT_BLOCK_CHARS: at the last space in
    reach if there is one near the limit, else at the limit. Returns the last paragraph's length."""
    pos = 0
    while pos < len(text):
        if block_len >= TEXT_BLOCK_CHARS:
            cursor.insertBlock()
            block_len = 0
        room = TEXT_BLOCK_CHARS - block_len
        piece = text[pos:pos + room]
        cut = len(piece) == room and pos + room < len(text) and "\n" not in piece
        if cut:
            space = piece.rfind(" ", room * 3 // 4)
            if space > 0:
                piece = piece[:space + 1]
        cursor.insertText(piece, fmt)
        newline = piece.rfind("\n")
        block_len = len(piece) - newline - 1 if newline >= 0 else block_len + len(piece)
        if cut:
            block_len = TEXT_BLOCK_CHARS  # this paragraph is full: the rest starts the next one
        pos += len(piece)
    return block_len


def _default_attention_choices() -> tuple[str, ...]:
    try:
        return attention_choices(load_spec("embedded"))
    except SpecError:  # a damaged install: the keys still offer the plain modes
        return ("mha", "mqa")


def demo_recording_path() -> Path:
    """The demo recording shipped in assets/ (next to the sources, or inside a PyInstaller bundle)."""
    base = Path(getattr(sys, "_MEIPASS", Path(__file__).resolve().parent.parent))
    return base / "assets" / "demo" / "demo.jsonl"


def _make_controller(parent: QWidget, warm: bool):
    """The generation controller: the engine host process by default (started now when ``warm``,
    else at the first run), a thread of this process with KVSCOPE_ENGINE=thread (imports torch:
    done once, when the window is built)."""
    from workers.engine_link import HostedGenerationController, controller_class

    cls = controller_class()
    return cls(parent, warm=warm) if cls is HostedGenerationController else cls(parent)


class ElidedLabel(QLabel):
    """One line of text, cut with an ellipsis where it does not fit; ``text()`` stays the whole text."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._full = ""
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 - Qt's name
        self._full = str(text)
        self._elide()

    def text(self) -> str:
        return self._full

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._elide()

    def changeEvent(self, event) -> None:  # noqa: N802 - a new font (presenter mode, theme) re-elides
        super().changeEvent(event)
        self._elide()

    def _elide(self) -> None:
        shown = self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, max(self.width(), 1))
        if shown != super().text():
            super().setText(shown)


class MainWindow(QMainWindow):
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
        self.info = None  # ModelInfo of the loaded model
        self.request = None  # the RunRequest of the current/last run
        self.last_sample: Sample | None = None
        self.decode_tokens = 0
        self.switch_events = 0
        self.state = "idle"  # idle | loading | running | paused | stopping
        self.last_error = ""
        self._pending_text: list[tuple[str, str]] = []  # (kind, text) waiting for the next redraw
        self._updating = False  # True while the window sets combos itself (not a user switch)
        self._switches_pending = 0  # switches sent to the engine and not answered yet (keys pressed meanwhile)
        # Before a model loads: the embedded model's choices (its spec comes from its preset, no torch).
        self._attention_choices = _default_attention_choices()
        self._cache_choices = cache_choices()
        self._impl_choices = ATTN_IMPLS
        self._last_non_flash = "sdpa"
        # ---- diagnosing (issue 5) and recordings (issue 6)
        self.mode = "live"  # live | replay: where the samples come from
        self.record_path: str | None = None  # the next run is recorded here (File > Record)
        self.snapshot_path: str | None = None  # the next run's allocator snapshot (CUDA)
        self.last_recording: str | None = None  # what File > Export CSV exports
        self.last_reading = None  # newest MemoryReading from the sampler
        self.sampler = None
        self.sampler_device = "cpu"
        self._engine_device = "auto"  # what 'auto' is in the engine process, once it has said
        self.sampler_rate_hz = DEFAULT_SAMPLER_HZ
        self.sampler_achieved_hz: float | None = None
        self.sampler_notes: list[str] = []
        self._origin: float | None = None  # monotonic second that is 0 s on the plots (live runs)
        self._plot_readings = False  # True while a live run is on: readings go to the memory plot
        self._readings_until = 0.0
        self._early_readings: deque = deque(maxlen=20_000)  # readings before the first sample fixes the origin
        self._spike_queue: deque = deque(maxlen=200_000)
        self._load_started: float | None = None
        self.monitor: SpikeMonitor | None = None
        self._monitor_last_t = float("-inf")
        self._monitor_flushed = True
        self._prev_cache: str | None = None
        self._bpt_points: deque = deque(maxlen=32)  # (token, KV bytes) since the last switch
        self.forecast = None
        self.spike_count = 0
        self._cuda: bool | None = None
        self._replay_args: tuple[str, float] | None = None
        self._monitor_threshold = 0

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

        self._build_ui()
        self._build_menus()
        self._build_shortcuts()

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
        self._set_state("idle")

        self.gpu_poller = GpuProcessPoller(1.0, parent=self)
        self.gpu_poller.updated.connect(self.gpu_panel.show_processes)
        host = getattr(self.controller, "host", None)
        if host is not None:  # the model's GPU memory is the engine process's: "this app" in the table
            host.message.connect(self._on_engine_message)
            if host.pid is not None:
                self.gpu_poller.set_app_pids({host.pid})
        self.gpu_poller.start()
        if start_engine:
            self._start_sampler(self._auto_device())
        self._maybe_offer_demo()

    # ============================================================================================
    # construction

    def _build_ui(self) -> None:
        # ---- controls (left)
        self.source_combo = QComboBox()
        self.source_combo.addItem("Embedded demo model", "embedded")
        self.source_combo.addItem("Local folder", "folder")
        self.source_combo.addItem("Hugging Face hub id", "hub")
        self.source_combo.setToolTip("Embedded: a tiny Llama-shaped model with random weights built offline, "
                                     "always available.\nLocal folder: a saved transformers model.\nHub id: "
                                     "org/name, downloaded (or from the local Hugging Face cache).")
        self.folder_edit = QLineEdit()
        self.folder_edit.setPlaceholderText("/path/to/model folder")
        browse = QPushButton("\u2026")
        browse.setToolTip("Choose a model folder")
        browse.clicked.connect(self._browse_folder)
        self.folder_row = QWidget()
        fr = QHBoxLayout(self.folder_row)
        fr.setContentsMargins(0, 0, 0, 0)
        fr.addWidget(self.folder_edit, 1)
        fr.addWidget(browse)
        self.hub_edit = QLineEdit()
        self.hub_edit.setPlaceholderText("org/name, e.g. HuggingFaceTB/SmolLM2-135M")
        self.source_stack = QStackedWidget()
        self.source_stack.addWidget(QWidget())
        self.source_stack.addWidget(self.folder_row)
        self.source_stack.addWidget(self.hub_edit)
        self.source_combo.currentIndexChanged.connect(self.source_stack.setCurrentIndex)
        self.source_combo.currentIndexChanged.connect(lambda i: self.source_stack.setVisible(i != 0))
        self.source_stack.setFixedHeight(self.hub_edit.sizeHint().height())

        self.device_combo = QComboBox()
        self.device_combo.addItems(["auto", "cpu", "cuda", "mps"])
        self.device_combo.setToolTip("Where the model runs. auto: CUDA if present, then MPS, else CPU.")
        self.dtype_combo = QComboBox()
        self.dtype_combo.addItems(["auto", "float32", "bfloat16", "float16"])
        self.dtype_combo.setToolTip("Element type of the weights (and of the KV cache, as transformers stores it).")
        self.attention_combo = QComboBox()
        self.attention_combo.setToolTip("Attention mode. Changing it during a run converts the model and the live "
                                        "cache between two tokens (keys 1\u20135).")
        self.impl_combo = QComboBox()
        self.impl_combo.setToolTip("Attention kernel: eager materialises the scores matrix, sdpa and flash never "
                                   "do (key F toggles flash).")
        self.cache_combo = QComboBox()
        self.cache_combo.setToolTip("Cache strategy: dynamic grows per token, static preallocates the max context, "
                                    "quantized stores 4/2-bit or fp8 codes, offloaded keeps layers in CPU memory "
                                    "(key C: next).")
        self.max_context_spin = QSpinBox()
        self.max_context_spin.setRange(0, 1 << 24)
        self.max_context_spin.setSingleStep(256)
        self.max_context_spin.setSpecialValueText("model max")
        self.max_context_spin.setToolTip("What a static cache preallocates, and the context the stats panel "
                                         "forecasts to. 0: the model's maximum.")
        self.max_tokens_spin = QSpinBox()
        self.max_tokens_spin.setRange(1, 1 << 20)
        self.max_tokens_spin.setValue(FIRST_START_TOKENS)
        self.max_tokens_spin.setToolTip("How many tokens to generate.")
        self.budget_edit = QLineEdit()
        self.budget_edit.setPlaceholderText("none \u00b7 e.g. 1.5GiB")
        self.budget_edit.setToolTip("Limit the model's memory (weights + KV cache + activations) to this size, to show "
                                    "a smaller card's fate on a bigger machine.\nSizes like 64MiB, 1.5GiB or plain "
                                    "bytes. The run stops with a message at the token where it is reached;\nthe events "
                                    "table shows the forecast and where it was reached. Empty: no budget.")
        self.snapshot_button = QPushButton("Allocator snapshot\u2026")
        self.snapshot_button.setCheckable(True)
        self.snapshot_button.toggled.connect(self._snapshot_toggled)
        self.prompt_edit = QPlainTextEdit()
        self.prompt_edit.setPlaceholderText("Prompt")
        self.prompt_edit.setMaximumHeight(110)
        self.prompt_edit.setTabChangesFocus(True)

        self.start_button = QPushButton("Start")
        self.start_button.setObjectName("primary")
        self.start_button.setToolTip("Load the model (in the background) and generate")
        self.pause_button = QPushButton("Pause")
        self.pause_button.setToolTip("Pause or resume between two tokens (Space)")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop after the current token")
        self.start_button.clicked.connect(self.start_run)
        self.pause_button.clicked.connect(self.toggle_pause)
        self.stop_button.clicked.connect(self.stop_run)
        self.error_label = QLabel("")
        self.error_label.setObjectName("error")
        self.error_label.setWordWrap(True)

        model_box = QGroupBox("Model")
        mf = QFormLayout(model_box)
        mf.addRow("Source", self.source_combo)
        mf.addRow("", self.source_stack)
        mf.addRow("Device", self.device_combo)
        mf.addRow("dtype", self.dtype_combo)
        run_box = QGroupBox("Settings (switch live)")
        rf = QFormLayout(run_box)
        rf.addRow("Attention", self.attention_combo)
        rf.addRow("Kernel", self.impl_combo)
        rf.addRow("Cache", self.cache_combo)
        rf.addRow("Max context", self.max_context_spin)
        rf.addRow("New tokens", self.max_tokens_spin)
        rf.addRow("Memory budget", self.budget_edit)
        rf.addRow(self.snapshot_button)  # both columns: the panel stays narrow enough for 1280x720
        prompt_box = QGroupBox("Prompt")
        pl = QVBoxLayout(prompt_box)
        pl.addWidget(self.prompt_edit)
        buttons = QHBoxLayout()
        buttons.addWidget(self.start_button, 2)
        buttons.addWidget(self.pause_button, 1)
        buttons.addWidget(self.stop_button, 1)
        keys = QLabel(KEYS_HELP.replace(" \u00b7 ", "\n"))
        keys.setObjectName("statNote")

        controls = QWidget()
        cl = QVBoxLayout(controls)
        cl.setContentsMargins(6, 6, 6, 6)
        for w in (model_box, run_box, prompt_box):
            cl.addWidget(w)
        cl.addLayout(buttons)
        cl.addWidget(self.error_label)
        cl.addStretch(1)
        cl.addWidget(keys)
        self.controls_scroll = QScrollArea()
        self.controls_scroll.setWidget(controls)
        self.controls_scroll.setWidgetResizable(True)
        self.controls_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.controls_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.controls_scroll.setMinimumWidth(CONTROLS_MIN_W)
        self.controls_scroll.setMaximumWidth(420)
        for combo in (self.source_combo, self.device_combo, self.dtype_combo, self.attention_combo, self.impl_combo,
                      self.cache_combo):
            # Long entries ("offloaded (needs CUDA)") must not widen the panel; the popup shows them whole.
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(8)

        self.attention_combo.activated.connect(lambda _i: self._user_switch("attention"))
        self.impl_combo.activated.connect(lambda _i: self._user_switch("attn-impl"))
        self.cache_combo.activated.connect(lambda _i: self._user_switch("cache"))
        self._fill_choices()

        # ---- centre: badges over the plots
        self.badges: dict[str, QLabel] = {}
        badge_row = QHBoxLayout()
        badge_row.setSpacing(10)
        for key, name, tip in (
            ("model", "", "The model generating"),
            ("attention", "attention", "Attention mode in force"),
            ("kernel", "kernel", "The attention kernel that actually ran (e.g. sdpa-math when flash is "
                                 "unavailable)"),
            ("cache", "cache", "Cache strategy in force"),
            ("state", "", "Run state"),
        ):
            box = QHBoxLayout()
            box.setSpacing(4)
            box.setContentsMargins(0, 0, 0, 0)
            if name:
                label = QLabel(name)
                label.setObjectName("badgeName")
                box.addWidget(label)
            value = ElidedLabel("\u2014") if key == "model" else QLabel("\u2014")
            value.setObjectName("modelName" if key == "model" else "badge")
            if key == "model":
                # A long model name yields its width to the plots: one line, elided (the tooltip has it
                # whole), so the badge row keeps its height at 1280x720 and in presenter mode.
                value.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
                value.setMinimumWidth(80)
            value.setToolTip(tip)
            box.addWidget(value)
            self.badges[key] = value
            if key == "model":
                box.setStretch(box.count() - 1, 1)
            badge_row.addLayout(box, 1 if key == "model" else 0)
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
        self.alert_label = QLabel("")
        self.alert_label.setObjectName("alert")
        self.alert_label.setWordWrap(True)
        self.alert_label.setVisible(False)
        self.alert_kind = ""
        # ---- under the plots: the events table and the GPU processes
        self.events_table = EventsTable(self.theme)
        self.gpu_panel = GpuProcessesPanel(self.theme)
        self.diag_tabs = QTabWidget()
        self.diag_tabs.setDocumentMode(True)
        self.diag_tabs.addTab(self.events_table, "Events and spikes")
        self.diag_tabs.addTab(self.gpu_panel, "GPU processes")
        self.sampler_label = QLabel("memory sampler: starting\u2026")
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
        cv.addLayout(badge_row)
        cv.addWidget(self.alert_label)
        cv.addWidget(self.centre_splitter, 1)

        # ---- right: numbers and the generated text
        self.stats_panel = StatsPanel()
        self.text_view = QPlainTextEdit()
        self.text_view.setReadOnly(True)
        self.text_view.setToolTip("The prompt (dim) and the generated text as it streams. Markers show where a "
                                  "switch took effect.")
        self.text_view.setMaximumBlockCount(2000)
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
        rv.addWidget(text_box, 1)
        right.setMinimumWidth(RIGHT_MIN_W)
        right.setMaximumWidth(RIGHT_MAX_W)
        self.right_panel = right

        self.live_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.live_splitter.addWidget(self.controls_scroll)
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
        self.setCentralWidget(self.tabs)

        # ---- status bar
        self.status_device = QLabel("no model loaded")
        self.status_device.setToolTip("The device the model runs on")
        self.status_memory = QLabel("")
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

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self.record_action = QAction("Record the next run\u2026", self, checkable=True)
        self.record_action.setToolTip("Write every sample of the next run to a .jsonl recording (flushed per sample)")
        self.record_action.triggered.connect(self._record_triggered)
        file_menu.addAction(self.record_action)
        open_action = QAction("Open recording\u2026", self)
        open_action.setShortcut(QKeySequence.StandardKey.Open)
        open_action.triggered.connect(lambda: self.open_recording(ask=True))
        file_menu.addAction(open_action)
        demo_action = QAction("Play the demo recording", self)
        demo_action.triggered.connect(self.play_demo)
        file_menu.addAction(demo_action)
        file_menu.addSeparator()
        self.export_csv_action = QAction("Export CSV\u2026", self)
        self.export_csv_action.triggered.connect(lambda: self.export_csv(ask=True))
        file_menu.addAction(self.export_csv_action)
        for fmt in ("PNG", "SVG"):
            action = QAction(f"Export plots as {fmt}\u2026", self)
            action.triggered.connect(lambda _c=False, f=fmt.lower(): self.export_plots(fmt=f, ask=True))
            file_menu.addAction(action)
        summary = QAction("Export summary image\u2026", self)
        summary.triggered.connect(lambda: self.export_summary(ask=True))
        file_menu.addAction(summary)
        file_menu.addSeparator()
        shot = QAction("Save screenshot", self)
        shot.setShortcut(QKeySequence("Ctrl+S"))
        shot.setToolTip("A PNG of the window in your Pictures folder (the status bar says where)")
        shot.triggered.connect(lambda: self.save_screenshot())
        file_menu.addAction(shot)
        shot_as = QAction("Save screenshot as\u2026", self)
        shot_as.triggered.connect(lambda: self.save_screenshot(ask=True))
        file_menu.addAction(shot_as)
        file_menu.addSeparator()
        quit_action = QAction("Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
        self.file_menu = file_menu

        run_menu = bar.addMenu("&Run")
        for text, slot, shortcut in (("Start", self.start_run, None), ("Pause / resume", self.toggle_pause, "Space"),
                                     ("Stop", self.stop_run, None)):
            action = QAction(text, self)
            action.triggered.connect(slot)
            if shortcut:
                action.setShortcut(QKeySequence(shortcut))
                self.addAction(action)  # the key works wherever the focus is in the window
            run_menu.addAction(action)
        run_menu.addSeparator()
        # The keys a speaker presses, as menu entries: the menu shows which number is which mode.
        switch_keys = [(f"{name} attention", lambda _c=False, n=n: self.attention_key(n), str(n))
                       for n, name in ATTENTION_KEYS.items()]
        switch_keys += [("Flash attention on / off", self.toggle_flash, "F"), ("Next cache strategy", self.next_cache, "C")]
        for text, slot, shortcut in switch_keys:
            action = QAction(text, self)
            action.setShortcut(QKeySequence(shortcut))
            action.triggered.connect(slot)
            self.addAction(action)
            run_menu.addAction(action)

        view = bar.addMenu("&View")
        group = QActionGroup(self)
        self.theme_actions = {}
        for name in ("dark", "light"):
            action = QAction(f"{name.capitalize()} theme", self, checkable=True)
            action.triggered.connect(lambda _c=False, n=name: self.set_theme(n))
            group.addAction(action)
            view.addAction(action)
            self.theme_actions[name] = action
        view.addSeparator()
        self.presenter_action = QAction("Presenter mode", self, checkable=True)
        self.presenter_action.setShortcut(QKeySequence("F11"))
        self.presenter_action.triggered.connect(lambda checked: self.set_presenter(checked))
        view.addAction(self.presenter_action)
        view.addSeparator()
        rate_menu = view.addMenu("Memory sampling rate")
        rate_group = QActionGroup(self)
        self.rate_actions = {}
        for hz in SAMPLER_RATES:
            action = QAction(f"{hz:g} Hz", self, checkable=True)
            action.triggered.connect(lambda _c=False, r=hz: self.set_sampler_rate(r))
            rate_group.addAction(action)
            rate_menu.addAction(action)
            self.rate_actions[hz] = action
        help_menu = bar.addMenu("&Help")
        keys = QAction("Keys\u2026", self)
        keys.setShortcut(QKeySequence("F1"))
        keys.triggered.connect(self.show_keys)
        help_menu.addAction(keys)
        about = QAction("About KV Scope\u2026", self)
        about.triggered.connect(self.show_about)
        help_menu.addAction(about)

    def show_keys(self) -> None:
        rows = "".join(f"<tr><td><b>{k}</b></td><td>{what}</td></tr>" for k, what in KEY_MAP)
        QMessageBox.information(self, "KV Scope keys", f"<table cellspacing='6'>{rows}</table>")

    def show_about(self) -> None:
        from core import __version__

        QMessageBox.about(self, "About KV Scope",
                          f"<b>KV Scope {__version__}</b><p>See the KV cache grow token by token, and predict "
                          "what a context will cost before anything is loaded.</p><p>Bytes = 2 \u00d7 layers "
                          "\u00d7 KV heads \u00d7 head_dim \u00d7 tokens \u00d7 batch \u00d7 bytes per "
                          "element.</p><p>Memory in binary units: 1 GiB = 1,073,741,824 bytes.</p>")

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
        c.progress.connect(self._on_progress)
        c.errored.connect(self._on_error)
        c.finished.connect(self._on_finished)
        c.paused_changed.connect(lambda paused: self._set_state("paused" if paused else "running"))

    # ============================================================================================
    # choices

    def _fill_choices(self) -> None:
        """Fill the attention / kernel / cache combos from the loaded model's choices (or defaults)."""
        self._updating = True
        try:
            current = self.attention_combo.currentData()
            self.attention_combo.clear()
            self.attention_combo.addItem("as built", "")
            for key in self._attention_choices:
                self.attention_combo.addItem(key, key)
            self._select(self.attention_combo, current or "")

            current = self.impl_combo.currentData() or "sdpa"
            self.impl_combo.clear()
            for key in ATTN_IMPLS:
                self.impl_combo.addItem(key, key)
                if key not in self._impl_choices:
                    self._disable_item(self.impl_combo, key, "not available here")
            self._select(self.impl_combo, current)

            current = self.cache_combo.currentData() or "dynamic"
            self.cache_combo.clear()
            for key, reason in self._cache_choices:
                self.cache_combo.addItem(key if reason is None else f"{key} ({reason})", key)
                if reason:
                    self._disable_item(self.cache_combo, key, reason)
            self._select(self.cache_combo, current)
        finally:
            self._updating = False

    @staticmethod
    def _disable_item(combo: QComboBox, key: str, reason: str) -> None:
        i = combo.findData(key)
        item = combo.model().item(i)
        if item is not None:
            item.setEnabled(False)
            item.setToolTip(reason)

    def _select(self, combo: QComboBox, key: str) -> bool:
        i = combo.findData(key)
        if i < 0:
            return False
        was, self._updating = self._updating, True
        combo.setCurrentIndex(i)
        self._updating = was
        return True

    # ============================================================================================
    # running

    def build_request(self):
        """The RunRequest the controls describe. Raises SpecError (SettingsError) with a user message."""
        from core.request import RunRequest

        kind = self.source_combo.currentData()
        if kind == "folder":
            source = self.folder_edit.text().strip()
            if not source:
                raise SpecError("choose a model folder (or pick the embedded demo model)")
        elif kind == "hub":
            source = self.hub_edit.text().strip()
            if source.count("/") != 1:
                raise SpecError("a hub id looks like org/name")
        else:
            source = "embedded"
        attention = self.attention_combo.currentData() or ""
        settings = RunSettings(
            attention=parse_attention(attention) if attention else None,
            cache=parse_cache(self.cache_combo.currentData() or "dynamic"),
            attn_impl=parse_attn_impl(self.impl_combo.currentData() or "sdpa"),
            max_context=self.max_context_spin.value() or None,
        )
        prompt = self.prompt_edit.toPlainText().strip()
        budget_text = self.budget_edit.text().strip()
        budget = None
        if budget_text and budget_text.lower() not in ("none", "off", "0"):
            try:
                budget = parse_size(budget_text)
            except SpecError as exc:
                raise SpecError(f"memory budget: {exc}") from exc
        kwargs = dict(source=source, device=self.device_combo.currentText(), dtype=self.dtype_combo.currentText(),
                      max_new_tokens=self.max_tokens_spin.value(), settings=settings, memory_budget=budget)
        if prompt:
            kwargs["prompt"] = prompt
        return RunRequest(**kwargs)

    def apply_request(self, request) -> None:
        """Show a RunRequest's choices in the controls (from the command line)."""
        if request.source == "embedded":
            self.source_combo.setCurrentIndex(0)
        elif Path(request.source).expanduser().exists():
            self.source_combo.setCurrentIndex(1)
            self.folder_edit.setText(request.source)
        else:
            self.source_combo.setCurrentIndex(2)
            self.hub_edit.setText(request.source)
        self.device_combo.setCurrentText(request.device)
        if self.dtype_combo.findText(request.dtype) < 0:
            self.dtype_combo.addItem(request.dtype)
        self.dtype_combo.setCurrentText(request.dtype)
        s = request.settings
        self._select(self.attention_combo, s.attention.key if s.attention else "")
        self._select(self.impl_combo, s.attn_impl)
        if not self._select(self.cache_combo, s.cache.key):
            self.cache_combo.addItem(s.cache.key, s.cache.key)
            self._select(self.cache_combo, s.cache.key)
        self.max_context_spin.setValue(s.max_context or 0)
        self.max_tokens_spin.setValue(request.max_new_tokens)
        self.prompt_edit.setPlainText(request.prompt)
        self.budget_edit.setText(human_bytes(request.memory_budget).replace(" ", "")
                                 if request.memory_budget else "")

    def start_run(self, request=None) -> bool:
        """Start generating (``request`` or the controls' settings). False with a message if it cannot."""
        if self.controller is None:
            self._show_error("the generation worker is not available in this build")
            return False
        if self.state in ("loading", "running", "paused", "stopping"):
            return False
        try:
            request = request or self.build_request()
        except SpecError as exc:
            self._show_error(str(exc))
            return False
        # File > Record and the snapshot button apply to this run (a request that names its own wins).
        if self.record_path and self.record_action.isChecked() and not request.record_path:
            request = replace(request, record_path=self.record_path)
        if self.snapshot_path and self.snapshot_button.isChecked() and not request.snapshot_path:
            request = replace(request, snapshot_path=self.snapshot_path)
        self.mode = "live"
        self.request = request
        if not self.calculator.warm:
            # transformers is still being imported in the calculator's thread; importing it from the
            # generation thread at the same time breaks it. Start when that is done (no UI wait).
            self.calculator.warm_up()
            self._set_state("loading")
            self.statusBar().showMessage("preparing transformers\u2026")
            self.calculator.warmed.connect(self._start_when_warm, Qt.ConnectionType.SingleShotConnection)
            return True
        self._start_now(request)
        return True

    def _start_when_warm(self) -> None:
        if self.state == "loading" and self.mode == "replay" and self._replay_args is not None:
            self._start_replay_now(*self._replay_args)
        elif self.state == "loading" and self.request is not None:
            self._start_now(self.request)

    def _start_now(self, request) -> None:
        self.mode = "live"
        self._switches_pending = 0
        self._show_sampler_status()
        self.reset_view()
        self.error_label.setText("")
        self.last_error = ""
        self._set_state("loading")
        self.statusBar().showMessage(f"loading {request.source}\u2026")
        # Readings from now on belong to this run (the load itself is the first thing to see).
        self._plot_readings = True
        self._load_started = time.monotonic()
        if self.sampler is None:  # a window opened for a replay: the first live run starts it
            self._start_sampler(self._auto_device())
        self._new_monitor(self.sampler_device)
        if request.record_path:
            self.last_recording = request.record_path
            # One recording per choice: the next run must not overwrite (or fail on) this file.
            self.record_action.setChecked(False)
        if request.snapshot_path:
            self.snapshot_button.setChecked(False)
        self.controller.start(request)

    def _active_controller(self):
        return self.replay if self.mode == "replay" else self.controller

    def stop_run(self) -> None:
        controller = self._active_controller()
        if controller is None or self.state == "idle":
            return
        self._set_state("stopping")
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

    # ---- recordings (File menu)

    def open_recording(self, path: str | None = None, speed: float = 1.0, ask: bool = False) -> bool:
        """Play a recording through this window (plots, markers, text, stats) at ``speed`` x its pace."""
        if ask:
            chosen, _ = QFileDialog.getOpenFileName(self, "Open recording", str(Path.home()),
                                                    "KV Scope recordings (*.jsonl);;All files (*)")
            if not chosen:
                return False
            path = chosen
        if self.replay is None:
            self._show_error("replay is not available in this build")
            return False
        if self.state != "idle":
            self._show_error("stop the current run first (a recording replays into the same plots)")
            return False
        if not path:
            return False
        self.mode = "replay"
        self._replay_args = (str(path), float(speed))
        self.last_recording = str(path)
        if not self.calculator.warm:
            # Same reason as start_run: the stats use the predictor, which must not import
            # transformers while the calculator's thread does.
            self.calculator.warm_up()
            self._set_state("loading")
            self.calculator.warmed.connect(self._start_when_warm, Qt.ConnectionType.SingleShotConnection)
            return True
        self._start_replay_now(str(path), float(speed))
        return True

    def _start_replay_now(self, path: str, speed: float) -> None:
        self.mode = "replay"
        self._show_sampler_status()
        self.reset_view()
        self.request = None
        self.error_label.setText("")
        self.last_error = ""
        self._plot_readings = False
        self._set_state("loading")
        self.statusBar().showMessage(f"replaying {Path(path).name}" + (
            "" if speed == 1 else f" at {speed:g}x" if speed < float("inf") else " unpaced"))
        self._new_monitor(None)
        self.replay.start(path, speed)

    def play_demo(self) -> bool:
        """Replay the demo recording from assets/ (first start offers it)."""
        self.demo_banner.setVisible(False)
        path = demo_recording_path()
        if not path.is_file():
            self._show_error(f"the demo recording is missing ({path})")
            return False
        return self.open_recording(str(path))

    def _maybe_offer_demo(self) -> None:
        """First start only: a banner offering the demo (non-modal: screenshots and tests never wait on it)."""
        if self.qsettings.value("app/first_start_done", False, type=bool):
            return
        self.qsettings.setValue("app/first_start_done", True)
        self.qsettings.sync()
        if demo_recording_path().is_file():
            self.demo_banner.setVisible(True)

    def set_record_path(self, path: str | None) -> None:
        """Record the next run to ``path`` (.jsonl); None: do not record."""
        self.record_path = str(path) if path else None
        self.record_action.setChecked(bool(path))
        if path:
            self.statusBar().showMessage(f"the next run will be recorded to {path}", 5000)

    def _record_triggered(self, checked: bool) -> None:
        if not checked:
            return
        chosen, _ = QFileDialog.getSaveFileName(self, "Record the next run to", self.record_path or str(
            Path.home() / time.strftime("kvscope-%Y%m%d-%H%M%S.jsonl")), "KV Scope recordings (*.jsonl)")
        if not chosen:
            self.record_action.setChecked(False)
            return
        if not chosen.endswith(".jsonl"):
            chosen += ".jsonl"
        self.set_record_path(chosen)

    def export_csv(self, path: str | None = None, ask: bool = False) -> int | None:
        """The current/last recording's samples as CSV (core.export). Returns the rows written."""
        from core.export import export_csv
        from core.recording import RecordingError

        if not self.last_recording:
            self._show_error("nothing to export yet: record a run (File \u203a Record) or open a recording")
            return None
        if ask:
            default = str(Path(self.last_recording).with_suffix(".csv"))
            chosen, _ = QFileDialog.getSaveFileName(self, "Export CSV", default, "CSV (*.csv)")
            if not chosen:
                return None
            path = chosen
        try:
            rows = export_csv(self.last_recording, path)
        except (RecordingError, OSError) as exc:
            self._show_error(str(exc))
            return None
        self.statusBar().showMessage(f"wrote {rows:,} samples to {path}", 5000)
        return rows

    def export_plots(self, base: str | None = None, fmt: str = "png", ask: bool = False) -> list[Path]:
        """Each plot to its own file: ``<base>-kv.<fmt>``, ``-memory``, ``-compare`` (PNG or SVG)."""
        fmt = fmt.lower()
        if ask:
            default = str(Path.home() / f"kvscope.{fmt}")
            chosen, _ = QFileDialog.getSaveFileName(self, f"Export plots as {fmt.upper()}", default,
                                                    f"{fmt.upper()} (*.{fmt})")
            if not chosen:
                return []
            base = chosen
        if not base:
            return []
        stem = Path(base)
        if stem.suffix.lower() in (".png", ".svg"):
            stem = stem.with_suffix("")
        self._redraw()
        written = []
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
            for which in self.plots.EXPORTABLE:
                target = stem.with_name(f"{stem.name}-{which}.{fmt}")
                self.plots.export_plot(which, str(target))
                written.append(target)
        except (OSError, RuntimeError, ValueError) as exc:
            self._show_error(f"cannot export the plots: {exc}")
            return written
        self.statusBar().showMessage(f"saved {', '.join(p.name for p in written)} in {stem.parent}", 5000)
        return written

    def export_summary(self, path: str | None = None, ask: bool = False) -> Path | None:
        """One 1920x1080 PNG for a slide: the three plots and the key numbers."""
        from ui.screenshot import ScreenshotError
        from ui.summary import render_summary

        if ask:
            chosen, _ = QFileDialog.getSaveFileName(self, "Export summary image", str(Path.home() / "kvscope-summary.png"),
                                                    "PNG (*.png)")
            if not chosen:
                return None
            path = chosen
        if not path:
            return None
        self._redraw()
        self.refresh_stats()
        info = self.info
        title = info.label if info else "KV Scope"
        s = self.last_sample
        parts = []
        if info is not None:
            parts.append(f"{info.spec.num_layers} layers, {info.spec.num_query_heads} query / "
                         f"{info.spec.num_kv_heads} KV heads of {info.spec.head_dim}")
            parts.append(info.device_name)
        if s is not None:
            parts.append(f"now: {s.attention.upper()} \u00b7 {s.kernel or s.attn_impl} \u00b7 {s.cache} cache")
        tiles = self.stats_panel.tiles
        numbers = [(tiles[k].name.text(), tiles[k].value.text(), tiles[k].note.text())
                   for k in ("kv_now", "bytes_per_token", "kv_at_max", "tokens_fit", "oom")]
        numbers.append(("Switches / spikes", f"{self.switch_events} / {self.spike_count}",
                        f"{self.decode_tokens:,} tokens generated"))
        try:
            saved = render_summary(path, make_theme(self.theme_name, presenter=False), title, " \u00b7 ".join(parts),
                                   numbers, [self.plots.kv_widget, self.plots.mem_widget, self.plots.cmp_widget])
        except ScreenshotError as exc:
            self._show_error(str(exc))
            return None
        self.statusBar().showMessage(f"summary saved to {saved}", 5000)
        return saved

    # ---- allocator snapshot (CUDA)

    def _cuda_available(self) -> bool:
        if self._cuda is None:
            device = self._auto_device()
            if device == "auto":
                return False  # the engine has not said yet
            self._cuda = device.startswith("cuda")
        return self._cuda

    def _snapshot_toggled(self, checked: bool) -> None:
        if not checked:
            self.snapshot_path = None
            return
        if self.snapshot_path is None:
            chosen, _ = QFileDialog.getSaveFileName(self, "Save the allocator snapshot to", str(
                Path.home() / time.strftime("kvscope-snapshot-%Y%m%d-%H%M%S.pickle")), "Snapshot (*.pickle)")
            if not chosen:
                self.snapshot_button.setChecked(False)
                return
            self.snapshot_path = chosen
        self.statusBar().showMessage(f"the next run records the CUDA allocator's history to {self.snapshot_path}",
                                     5000)

    # ---- the memory sampler (its own thread, independent of tokens)

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
            if self.sampler_device == "auto":  # the engine's sampler read 'auto' as this device
                self.sampler_device = self._engine_device
                self._show_sampler_status()

    def _start_sampler(self, device: str) -> None:
        """(Re)start the fixed-rate memory sampler for ``device`` at the chosen rate."""
        try:
            from workers.sampler import MemorySampler
        except ImportError as exc:
            self.sampler_label.setText(f"memory sampler not available: {exc}")
            return
        if self.sampler is not None:
            self.sampler.stop(timeout_s=1.0)
        self.sampler_device = device
        self.sampler_notes = []
        self.sampler_achieved_hz = None
        host = getattr(self.controller, "host", None)
        if host is not None:  # the model runs in the engine process: measure that process, from inside it
            from workers.engine_link import HostedSampler

            sampler = HostedSampler(device, self.sampler_rate_hz, parent=self, host=host)
        else:
            sampler = MemorySampler(device, self.sampler_rate_hz, parent=self)
        sampler.readings.connect(self._on_readings)
        sampler.rate_measured.connect(self._on_sampler_rate)
        sampler.note.connect(self._on_sampler_note)
        sampler.errored.connect(self._on_sampler_note)
        self.sampler = sampler
        sampler.start()
        self._show_sampler_status()

    def set_sampler_rate(self, hz: float) -> None:
        self.sampler_rate_hz = float(hz)
        if self.sampler is not None:
            self.sampler.set_rate(self.sampler_rate_hz)
        if hz in getattr(self, "rate_actions", {}):
            self.rate_actions[hz].setChecked(True)
        self.sampler_achieved_hz = None
        self._show_sampler_status()

    def _on_sampler_rate(self, hz: float) -> None:
        self.sampler_achieved_hz = hz
        self._show_sampler_status()

    def _on_sampler_note(self, line: str) -> None:
        if line not in self.sampler_notes:
            self.sampler_notes.append(line)
        self._show_sampler_status()

    def _show_sampler_status(self) -> None:
        rate = ("off" if self.sampler is None else "measuring\u2026" if self.sampler_achieved_hz is None
                else f"{self.sampler_achieved_hz:.1f} Hz")
        note = self.sampler_notes[0] if self.sampler_notes else ""
        if self.mode == "replay":
            # The sampler reads this machine; a replay shows the memory that was recorded.
            note = "replay: memory as recorded (spikes from the recorded tokens)"
        self.sampler_label.setText(f"memory sampler {rate} (set {self.sampler_rate_hz:g} Hz)"
                                   + (f" \u00b7 {note}" if note else ""))
        self.sampler_label.setToolTip("\n".join([f"device probed: {self.sampler_device}"] + self.sampler_notes))
        self.status_sampler.setText(f"sampler {rate}")

    def _on_readings(self, readings: list) -> None:
        """A batch from the sampler: to the memory plot and the spike monitor while a live run is on."""
        if not readings:
            return
        self.last_reading = readings[-1]
        if self.mode != "live" or not (self._plot_readings or time.monotonic() < self._readings_until):
            return
        if self._origin is None:
            self._early_readings.extend(readings)  # placed once the first sample fixes the time axis
            return
        self.plots.add_memory_readings(readings, self._origin)
        self._spike_queue.extend(readings)

    def _fix_origin(self, samples: list[Sample], arrival: float) -> None:
        """Tie the samples' run clock to the sampler's monotonic clock.

        A sample produced at run time ``time_s`` arrives here after some delivery delay, so
        ``arrival - time_s`` is the run's start on the monotonic clock plus that delay; the
        smallest value seen is the best estimate (delays are milliseconds).
        """
        best = min(arrival - s.time_s for s in samples)
        first = self._origin is None
        if first or best < self._origin - 0.002:
            self._origin = best
            self.plots.time_origin = best
        if not first:
            return
        early = list(self._early_readings)
        self._early_readings.clear()
        self.plots.add_memory_readings(early, self._origin)
        self._spike_queue.extend(early)
        if self.monitor is not None and self._load_started is not None:
            # Loading is a state, not an instant: mark it every quarter second from Start to the
            # load event, so a spike anywhere in it is put down to the load.
            load_end = next((s.time_s for s in samples if s.event == "load"), samples[0].time_s)
            t = self._load_started - self._origin
            while t < load_end:
                self.monitor.add_event(Event(t, EVENT_LOAD, "loading the model"))
                t += 0.25

    def _new_monitor(self, device: str | None, keep_queue: bool = False) -> None:
        self._monitor_threshold = spike_threshold(device)
        self.monitor = SpikeMonitor(min_rise_bytes=self._monitor_threshold)
        self._monitor_flushed = False
        if not keep_queue:
            self._monitor_last_t = float("-inf")
            self._spike_queue.clear()
            self._early_readings.clear()

    def _feed_spikes(self, flush: bool = False) -> None:
        """Judge readings older than SPIKE_LAG_S (live runs); each spike found is marked and listed."""
        if self.monitor is None or self._origin is None or self.mode != "live":
            return
        cutoff = time.monotonic() - (0.0 if flush else SPIKE_LAG_S)
        found = []
        while self._spike_queue and self._spike_queue[0].time_s <= cutoff:
            r = self._spike_queue.popleft()
            t = r.time_s - self._origin
            if t <= self._monitor_last_t:
                continue
            self._monitor_last_t = t
            found.extend(self.monitor.feed(replace(r, time_s=t)))
        if flush and not self._monitor_flushed:
            self._monitor_flushed = True
            found.extend(self.monitor.flush())
        self._show_spikes(found)

    def _show_spikes(self, spikes: list) -> None:
        for spike in spikes:
            self.spike_count += 1
            self.plots.add_spike(spike.time_s, spike.after, spike.rise_bytes, spike.cause)
            self.events_table.add_spike(spike, self._token_at(spike.time_s))

    def _token_at(self, time_s: float) -> int | None:
        """The last token generated at or before ``time_s`` (plot seconds), or None before the prefill."""
        import numpy as np

        times = self.plots.times.column("time")
        tokens = self.plots.tokens.column("token")
        n = min(len(times), len(tokens))
        if n == 0:
            return None
        i = int(np.searchsorted(times[:n], time_s, side="right")) - 1
        return None if i < 0 else int(tokens[i])

    def _show_alert(self, text: str, kind: str) -> None:
        color = self.theme.error if kind == "error" else self.theme.warning
        self.alert_kind = kind
        self.alert_label.setText(text)
        self.alert_label.setStyleSheet(f"QLabel#alert {{ color: {color}; border: 2px solid {color}; border-radius: 6px;"
                                       f" padding: 6px 10px; font-weight: 700; font-size: {self.theme.title_pt}pt; }}")
        self.alert_label.setVisible(True)

    def _clear_alert(self, kind: str | None = None) -> None:
        if kind is None or self.alert_kind == kind:
            self.alert_kind = ""
            self.alert_label.setVisible(False)

    def reset_view(self) -> None:
        """Clear plots, text and numbers (a new run or a new recording)."""
        self.plots.reset()
        self.text_view.clear()
        self._pending_text.clear()
        self.last_sample = None
        self.decode_tokens = 0
        self.switch_events = 0
        self.spike_count = 0
        self.stats_panel.show_stats(compute_stats(None, None, None))
        self.stats_panel.show_forecast(None)
        self.events_table.clear_rows()
        self._clear_alert()
        self._origin = None
        self._early_readings.clear()
        self._spike_queue.clear()
        self._bpt_points.clear()
        self._prev_cache = None
        self.forecast = None

    # ---- signals from the controller

    def add_samples(self, samples: list[Sample]) -> None:
        """Take a batch of samples (live or replayed): buffers now, drawing at the next frame."""
        if not samples:
            return
        if self.mode == "live" and self._plot_readings:
            self._fix_origin(samples, time.monotonic())
        self.plots.add_samples(samples)
        spikes = []
        for s in samples:
            if self.monitor is not None:
                for event in spike_events(s, self._prev_cache):
                    self.monitor.add_event(event)
                if self.mode == "replay" and not s.is_event and s.time_s > self._monitor_last_t:
                    # A replay has no sampler: what each recorded token measured is the series.
                    self._monitor_last_t = s.time_s
                    spikes.extend(self.monitor.feed(reading_from_sample(s)))
            self._prev_cache = s.cache
            if s.phase == PHASE_EVENT:
                self.events_table.add_event(s)
                if s.switch_key is not None and self._switches_pending:
                    self._switches_pending -= 1  # a key's switch has been applied, refused or found a no-op
                    if not self._switches_pending and s.event == "switch":
                        self.statusBar().showMessage(s.text, 4000)
                if s.event == "switch":
                    self.switch_events += 1
                    self._bpt_points.clear()  # a step is not a slope: the forecast starts afresh
                    self._pending_text.append(("marker", f" \u27e8{self.plots.markers[-1].label}\u27e9 "
                                               if self.plots.markers else " \u27e8switch\u27e9 "))
                    self._show_settings(s)
                elif s.event in ("oom", "budget"):
                    self._pending_text.append(("marker", f" \u27e8{s.event}\u27e9 "))
                    what = "Out of memory" if s.event == "oom" else "Memory budget reached"
                    self._show_alert(f"\u26a0 {what} at token {s.token}: {s.text}", "error")
                    self.statusBar().showMessage(s.text, 8000)
                elif s.event in ("refused", "forecast", "error", "note"):
                    self.statusBar().showMessage(s.text, 8000)
                    if s.event in ("refused", "error", "note"):
                        # The engine's settings after a refused (or no-op) switch: the controls
                        # must show what runs, not what was asked for.
                        self._show_settings(s)
                continue
            if s.phase == PHASE_PREFILL:
                self.events_table.add_event(s)
                self._pending_text.append(("prompt", s.text))
            elif s.phase == PHASE_DECODE:
                self.decode_tokens += 1
                self._pending_text.append(("token", s.text))
                if s.kv_bytes_observed is not None:
                    self._bpt_points.append((s.token, s.kv_bytes_observed))
            if self.last_sample is None:
                self._show_settings(s)
            self.last_sample = s
        self._show_spikes(spikes)
        if self.state == "loading":
            self._set_state("running")
        self.samples_added.emit(self.decode_tokens)

    def set_model_info(self, info) -> None:
        """A model is loaded (or a recording opened): show it and what it can switch to."""
        self.info = info
        self._attention_choices = tuple(info.attention_choices) or attention_choices(info.spec)
        self._cache_choices = tuple(info.cache_choices) or cache_choices(info.device)
        self._impl_choices = tuple(info.attn_impl_choices) or ATTN_IMPLS
        self._fill_choices()
        self.badges["model"].setText(info.label)
        self.badges["model"].setToolTip(f"{info.label}\nsource: {info.source}\n{info.spec.num_layers} layers, "
                                        f"{info.spec.num_query_heads} query / {info.spec.num_kv_heads} KV heads of "
                                        f"{info.spec.head_dim}, {info.dtype}")
        memory = f" \u00b7 {human_bytes(info.total_memory)}" if info.total_memory else ""
        self.status_device.setText(f"{info.device_name}{memory}")
        self.statusBar().showMessage(f"loaded {info.label} on {info.device_name} ({info.dtype})", 5000)
        self.calculator.set_spec(info.spec, source=f"{info.spec.name}")
        if info.total_memory and str(info.device).startswith(("cuda", "mps")):
            self.calculator.set_detected_memory(info.total_memory, info.device_name)
        if self.state == "loading":
            self._set_state("running")
        if self.mode == "live":
            device = str(info.device)
            if device != self.sampler_device:
                # The probe must read the device the model is on (NVML and the allocator of that GPU).
                self._start_sampler(device)
            if self.monitor is not None and spike_threshold(device) != self._monitor_threshold:
                # A GPU run is judged by the GPU's threshold from here on (the load was host memory).
                self._new_monitor(device, keep_queue=True)
        elif self.monitor is not None and spike_threshold(str(info.device)) != self._monitor_threshold:
            self._new_monitor(str(info.device))

    def _on_progress(self, text: str) -> None:
        self.statusBar().showMessage(text)
        if text.startswith(("switching", "re-running")) and self.monitor is not None and self._origin is not None:
            # The re-run's memory rises before its switch event arrives: tell the spike monitor now,
            # so those spikes are the conversion's, not "unknown".
            self.monitor.add_event(Event(time.monotonic() - self._origin, EVENT_SWITCH, text))

    def _on_error(self, message: str) -> None:
        self.last_error = message
        self._show_error(message)

    def _on_finished(self) -> None:
        if self.state == "idle":
            return
        if self.mode == "live":
            # Keep reading a little longer: the drop when the cache is freed belongs to the run.
            self._plot_readings = False
            self._readings_until = time.monotonic() + READINGS_TAIL_S
        elif self.monitor is not None and not self._monitor_flushed:
            self._monitor_flushed = True
            self._show_spikes(self.monitor.flush())
        self._clear_alert("warning")
        self._set_state("idle")
        self._redraw()
        self.refresh_stats()
        if not self.last_error:
            self.statusBar().showMessage(f"run ended after {self.decode_tokens} tokens", 5000)
        self.run_finished.emit()

    def _show_error(self, message: str) -> None:
        self.error_label.setText(message)
        self.statusBar().showMessage(message, 10000)

    # ---- live switches

    def _user_switch(self, key: str) -> None:
        """A combo changed by the user: during a run it is a live switch, otherwise the next run's setting."""
        if self._updating:
            return
        combo = {"attention": self.attention_combo, "attn-impl": self.impl_combo, "cache": self.cache_combo}[key]
        value = combo.currentData()
        if not value:
            return
        self.request_switch(key, value)

    def request_switch(self, key: str, value: str) -> None:
        """Switch ``key`` (attention / attn-impl / cache) to ``value`` now, or set it for the next run."""
        combo = {"attention": self.attention_combo, "attn-impl": self.impl_combo, "cache": self.cache_combo}[key]
        self._select(combo, value)
        if key == "attn-impl" and value != "flash":
            self._last_non_flash = value
        if self.controller is not None and self.state in ("running", "paused", "loading"):
            self.controller.switch(key, value)
            self._switches_pending += 1
            queued = f" ({self._switches_pending} queued)" if self._switches_pending > 1 else ""
            self.statusBar().showMessage(f"switching {key} to {value} after this token\u2026{queued}")

    def attention_key(self, n: int) -> None:
        """Keys 1-5: mha, the middle GQA choice, mqa, mla, the smallest window (its plateau shows soonest)."""
        choices = list(self._attention_choices)
        gqa = [c for c in choices if c.startswith("gqa:")]
        wanted = {
            1: "mha" if "mha" in choices else None,
            2: gqa[len(gqa) // 2] if gqa else None,
            3: "mqa" if "mqa" in choices else None,
            4: "mla" if "mla" in choices else None,
            5: next((c for c in reversed(choices) if c.startswith("window")), None),  # the smallest
        }.get(n)
        names = {1: "MHA", 2: "GQA", 3: "MQA", 4: "MLA", 5: "a sliding window"}
        if wanted is None:
            self.statusBar().showMessage(f"{names[n]} is not available for this model", 4000)
            return
        self.request_switch("attention", wanted)

    def toggle_flash(self) -> None:
        current = self.impl_combo.currentData() or "sdpa"
        if current == "flash":
            self.request_switch("attn-impl", self._last_non_flash or "sdpa")
        elif "flash" in self._impl_choices:
            self.request_switch("attn-impl", "flash")
        else:
            self.statusBar().showMessage("flash attention is not available here", 4000)

    def next_cache(self) -> None:
        available = [k for k, reason in self._cache_choices if reason is None]
        if not available:
            return
        current = self.cache_combo.currentData() or "dynamic"
        nxt = available[(available.index(current) + 1) % len(available)] if current in available else available[0]
        self.request_switch("cache", nxt)

    def _show_settings(self, s: Sample) -> None:
        """Badges and combos follow the settings a sample carries (the truth, after a switch)."""
        self.badges["attention"].setText(s.attention.upper() if ":" not in s.attention else s.attention.upper())
        self.badges["kernel"].setText(s.kernel or s.attn_impl)
        self.badges["cache"].setText(s.cache)
        self._select(self.attention_combo, s.attention)
        self._select(self.impl_combo, s.attn_impl)
        self._select(self.cache_combo, s.cache)

    # ============================================================================================
    # drawing

    def _redraw(self, settle: bool = True) -> None:
        """A frame: curves, then any text that arrived. Never raises into Qt. The fixed-rate timer
        passes ``settle=False`` (view ranges change one per frame); other callers get them all."""
        try:
            self._feed_spikes(flush=self.state == "idle" and time.monotonic() > self._readings_until
                              and not self._monitor_flushed and not self._spike_queue and self.mode == "live")
            self.plots.redraw(settle=settle)
            if self._pending_text:
                self._flush_text()
        except Exception:  # a drawing bug must not kill the timer (and the demo)
            log.exception("redraw failed")

    def _recolor_text(self, old: Theme, new: Theme) -> None:
        """Text already streamed takes the new theme's colours (prompt, tokens, markers): light text
        from the dark theme would be unreadable on the light background."""
        mapping = {QColor(old.muted).rgb(): QColor(new.muted), QColor(old.text).rgb(): QColor(new.text),
                   QColor(old.curves["marker"]).rgb(): QColor(new.curves["marker"])}
        if all(QColor(c).rgb() == k for k, c in mapping.items()):
            return
        cursor = QTextCursor(self.text_view.document())
        block = self.text_view.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                colour = mapping.get(fragment.charFormat().foreground().color().rgb())
                if fragment.isValid() and colour is not None:
                    cursor.setPosition(fragment.position())
                    cursor.setPosition(fragment.position() + fragment.length(), QTextCursor.MoveMode.KeepAnchor)
                    f = QTextCharFormat()
                    f.setForeground(colour)
                    cursor.mergeCharFormat(f)
                it += 1
            block = block.next()

    def _flush_text(self) -> None:
        t = self.theme
        cursor = self.text_view.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        formats = {}
        for kind, color, bold in (("prompt", t.muted, False), ("token", t.text, False),
                                  ("marker", t.curves["marker"], True)):
            f = QTextCharFormat()
            f.setForeground(QColor(color))
            if bold:
                f.setFontWeight(700)
            formats[kind] = f
        # Consecutive pieces of the same kind go in as one insertion, cut into paragraphs of at most
        # TEXT_BLOCK_CHARS: Qt lays out a whole paragraph on every insertion into it, and a stream of
        # tokens without newlines would otherwise grow one paragraph forever (quadratic: 200 KB without
        # a space took minutes). setMaximumBlockCount then bounds what is kept.
        block_len = cursor.block().length() - 1
        run_kind, run_text = None, []
        for kind, text in self._pending_text + [(None, "")]:
            if kind != run_kind and run_text:
                block_len = _insert_bounded(cursor, "".join(run_text), formats[run_kind], block_len)
                run_text = []
            run_kind = kind
            run_text.append(text)
        self._pending_text.clear()
        bar = self.text_view.verticalScrollBar()
        bar.setValue(bar.maximum())

    def refresh_stats(self) -> None:
        """The slow timer: numbers panel and status bar memory."""
        try:
            host = None
            s = self.last_sample
            if s is not None and s.device_total is None:
                import psutil

                host = int(psutil.virtual_memory().available)
            req = self.request
            stats = compute_stats(
                s, self.plots.slope_bytes_per_token, self.info.spec if self.info else None,
                batch=req.settings.batch if req else 1, kv_dtype=req.settings.kv_dtype if req else None,
                max_context=(req.settings.max_context if req and req.settings.max_context else
                             (self.info.max_context if self.info else None)), host_available=host)
            self.stats_panel.show_stats(stats)
            self._refresh_forecast(s, host)
            if s is not None:
                if s.device_used is not None and s.device_total is not None:
                    self.status_memory.setText(f"GPU {human_bytes(s.device_used)} / {human_bytes(s.device_total)}")
                elif s.process_rss is not None:
                    self.status_memory.setText(f"host: this process {human_bytes(s.process_rss)} (RSS)")
        except Exception:
            log.exception("stats refresh failed")

    def _refresh_forecast(self, s: Sample | None, host: int | None) -> None:
        """'Out of memory at token N (about T s)', a warning when it is near."""
        free, source = None, ""
        r = self.last_reading
        if (self.mode == "live" and r is not None and r.device_free is not None
                and self.sampler_device.startswith("cuda")):
            free, source = r.device_free, "GPU memory"
        elif s is not None and s.device_total is not None and s.device_used is not None:
            free, source = s.device_total - s.device_used, "GPU memory"
        elif self.mode == "live" and host is not None:
            free, source = host, "host memory"
        budget = self.request.memory_budget if (self.mode == "live" and self.request is not None) else None
        self.forecast = oom_forecast(list(self._bpt_points), s, free=free, free_source=source, budget=budget,
                                     max_context=getattr(self.info, "max_context", None))
        near = self.forecast is not None and self.forecast.warning(OOM_WARN_S) and self.state in ("running", "paused")
        self.stats_panel.show_forecast(self.forecast, self.theme.warning if near else None)
        if near:
            self._show_alert(f"\u26a0 Warning: {self.forecast.message()}", "warning")
        else:
            self._clear_alert("warning")

    # ============================================================================================
    # state, looks

    def _set_state(self, state: str) -> None:
        self.state = state
        running = state in ("loading", "running", "paused", "stopping")
        self.start_button.setEnabled(not running and self.controller is not None)
        self.pause_button.setEnabled(state in ("running", "paused"))
        self.snapshot_button.setEnabled(not running and self._cuda_available())
        self.snapshot_button.setToolTip(
            "Record the CUDA allocator's history (every allocation with its Python stack) for the whole next run\n"
            "and save it as a .pickle that https://pytorch.org/memory_viz opens."
            if self._cuda_available() else
            "Allocator snapshots record the CUDA caching allocator: this machine has no CUDA GPU torch can use.")
        self.pause_button.setText("Resume" if state == "paused" else "Pause")
        self.stop_button.setEnabled(running and state != "stopping")
        for w in (self.source_combo, self.source_stack, self.device_combo, self.dtype_combo, self.max_context_spin,
                  self.max_tokens_spin, self.prompt_edit, self.budget_edit):
            w.setEnabled(not running)
        text = {"idle": "idle", "loading": "\u23f3 loading", "running": "\u25cf running", "paused": "\u275a\u275a paused",
                "stopping": "stopping\u2026"}[state]
        self.badges["state"].setText(text)
        self.status_state.setText(text)
        color = {"running": self.theme.curves["allocated"], "paused": self.theme.warning,
                 "loading": self.theme.warning}.get(state, self.theme.muted)
        self.badges["state"].setStyleSheet(f"color: {color};")

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
        self.controls_scroll.setVisible(not self.presenter)
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
        self._recolor_text(old, self.theme)
        self.setStyleSheet(stylesheet(self.theme))
        self.plots.apply_theme(self.theme)
        self.calculator.apply_theme(self.theme)
        self.events_table.theme = self.theme
        self.gpu_panel.theme = self.theme
        if self.theme_name in getattr(self, "theme_actions", {}):
            self.theme_actions[self.theme_name].setChecked(True)
        self._set_state(self.state)

    def save_screenshot(self, path: str | None = None, ask: bool = False) -> Path | None:
        """Save the whole window as a PNG (Ctrl+S: to the Pictures folder). Returns the path."""
        if ask:
            chosen, _ = QFileDialog.getSaveFileName(self, "Save screenshot", str(default_path()), "PNG (*.png)")
            if not chosen:
                return None
            path = chosen
        try:
            saved = save_widget(self, path or default_path())
        except ScreenshotError as exc:
            self._show_error(str(exc))
            return None
        self.statusBar().showMessage(f"screenshot saved to {saved}", 5000)
        return saved

    def _browse_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Model folder", self.folder_edit.text() or str(Path.home()))
        if folder:
            self.folder_edit.setText(folder)

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
        s.beginGroup("run")
        kind = str(s.value("source_kind", "embedded"))
        self.source_combo.setCurrentIndex(SOURCES.index(kind) if kind in SOURCES else 0)
        self.source_stack.setVisible(self.source_combo.currentIndex() != 0)
        self.folder_edit.setText(str(s.value("folder", "") or ""))
        self.hub_edit.setText(str(s.value("hub_id", "") or ""))
        for combo, key in ((self.device_combo, "device"), (self.dtype_combo, "dtype")):
            value = s.value(key)
            if value and combo.findText(str(value)) >= 0:
                combo.setCurrentText(str(value))
        for combo, key in ((self.attention_combo, "attention"), (self.impl_combo, "attn_impl"),
                           (self.cache_combo, "cache")):
            value = s.value(key)
            if value is not None:
                self._select(combo, str(value))
        try:
            self.max_context_spin.setValue(int(s.value("max_context", 0) or 0))
            self.max_tokens_spin.setValue(int(s.value("max_new_tokens", FIRST_START_TOKENS) or FIRST_START_TOKENS))
        except (TypeError, ValueError):
            pass
        prompt = s.value("prompt")
        if prompt:
            self.prompt_edit.setPlainText(str(prompt))
        else:
            try:
                from core.request import DEFAULT_PROMPT
            except ImportError:
                DEFAULT_PROMPT = "Every token keeps a key and a value in every layer, so the cache grows: "
            self.prompt_edit.setPlainText(DEFAULT_PROMPT)
        s.endGroup()
        try:
            rate = float(s.value("diagnose/sampler_hz", DEFAULT_SAMPLER_HZ) or DEFAULT_SAMPLER_HZ)
        except (TypeError, ValueError):
            rate = DEFAULT_SAMPLER_HZ
        self.sampler_rate_hz = rate if 0 < rate <= 1000 else DEFAULT_SAMPLER_HZ
        if self.sampler_rate_hz in self.rate_actions:
            self.rate_actions[self.sampler_rate_hz].setChecked(True)
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
        s.setValue("diagnose/sampler_hz", self.sampler_rate_hz)
        s.setValue("view/theme", self.theme_name)
        s.beginGroup("run")
        s.setValue("source_kind", self.source_combo.currentData())
        s.setValue("folder", self.folder_edit.text())
        s.setValue("hub_id", self.hub_edit.text())
        s.setValue("device", self.device_combo.currentText())
        s.setValue("dtype", self.dtype_combo.currentText())
        s.setValue("attention", self.attention_combo.currentData() or "")
        s.setValue("attn_impl", self.impl_combo.currentData() or "sdpa")
        s.setValue("cache", self.cache_combo.currentData() or "dynamic")
        s.setValue("max_context", self.max_context_spin.value())
        s.setValue("max_new_tokens", self.max_tokens_spin.value())
        s.setValue("prompt", self.prompt_edit.toPlainText())
        s.endGroup()
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
        if self.sampler is not None and not self.sampler.stop(timeout_s=2.0):
            log.warning("the memory sampler thread did not stop within 2 s")
        if not self.gpu_poller.stop(timeout_s=2.0):
            log.warning("the GPU process thread did not stop within 2 s")
        self.calculator.shutdown()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt API)
        # Settings are saved after the worker stopped, so they never describe a half-stopped run.
        self.shutdown()
        self.save_settings()
        super().closeEvent(event)

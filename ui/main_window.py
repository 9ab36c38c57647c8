"""The main window: controls, the three live plots, streaming text, live numbers, the calculator tab.

Everything heavy happens elsewhere: the model loads and generates in the generation worker's
thread; samples arrive in small batches and are only appended to ring buffers here. Two timers
draw: a fast one (~30 Hz) for curves and text, a slow one (1 Hz) for numbers.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QColor, QKeySequence, QShortcut, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
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
from core.settings import RunSettings, parse_attn_impl
from core.spec import SpecError, human_bytes
from ui.calculator import CalculatorTab
from ui.plots import LivePlots
from ui.screenshot import ScreenshotError, default_path, save_widget
from ui.stats import StatsPanel, compute_stats
from ui.theme import Theme, stylesheet, theme as make_theme

log = logging.getLogger(__name__)

ORG, APP = "KVScope", "KV Scope"
REDRAW_HZ = 30
STATS_MS = 1000
DEFAULT_ATTENTION = ("mha", "gqa:4", "gqa:2", "mqa", "mla", "window:256")
DEFAULT_CACHES = (("dynamic", None), ("static", None), ("quantized:4", None), ("quantized:2", None),
                  ("quantized:hqq:4", None), ("quantized:fp8", None), ("offloaded", "needs CUDA"))
IMPLS = ("eager", "sdpa", "flash")
SOURCES = ("embedded", "folder", "hub")
MARKED_EVENTS = ("switch", "oom", "budget", "error")
KEYS_HELP = "1\u20135 attention \u00b7 F flash \u00b7 C cache \u00b7 Space pause \u00b7 F11 presenter \u00b7 Ctrl+S screenshot"


def _controller_class():
    """The generation worker's controller (imports torch: done once, when the window is built)."""
    from workers.generation import GenerationController

    return GenerationController


class MainWindow(QMainWindow):
    """KV Scope's window. ``add_samples`` is the one way data gets in (live runs and replays)."""

    samples_added = Signal(int)  # decode tokens so far, after each batch
    run_finished = Signal()

    def __init__(self, settings: QSettings | None = None, controller=None, parent: QWidget | None = None) -> None:
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
        self._attention_choices = DEFAULT_ATTENTION
        self._cache_choices = DEFAULT_CACHES
        self._impl_choices = IMPLS
        self._last_non_flash = "sdpa"

        self.controller = controller
        if self.controller is None:
            try:
                self.controller = _controller_class()(self)
            except ImportError as exc:  # a UI-only build (replay) still opens
                log.warning("generation worker not available: %s", exc)
        if self.controller is not None:
            self._connect_controller(self.controller)

        self._build_ui()
        self._build_menus()
        self._build_shortcuts()

        self.redraw_timer = QTimer(self)
        self.redraw_timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.redraw_timer.setInterval(int(1000 / REDRAW_HZ))
        self.redraw_timer.timeout.connect(self._redraw)
        self.redraw_timer.start()
        self.stats_timer = QTimer(self)
        self.stats_timer.setInterval(STATS_MS)
        self.stats_timer.timeout.connect(self.refresh_stats)
        self.stats_timer.start()

        self.restore_settings()
        self.apply_theme()
        self._set_state("idle")

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
        self.max_tokens_spin.setValue(256)
        self.max_tokens_spin.setToolTip("How many tokens to generate.")
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
        self.controls_scroll.setMinimumWidth(310)
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
            value = QLabel("\u2014")
            value.setObjectName("modelName" if key == "model" else "badge")
            if key == "model":
                # A long model name yields its width to the plots instead of widening the window.
                value.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
                value.setMinimumWidth(120)
            value.setToolTip(tip)
            box.addWidget(value)
            self.badges[key] = value
            if key == "model":
                box.setStretch(box.count() - 1, 1)
            badge_row.addLayout(box, 1 if key == "model" else 0)
        self.plots = LivePlots(self.theme)
        centre = QWidget()
        cv = QVBoxLayout(centre)
        cv.setContentsMargins(4, 4, 4, 0)
        cv.addLayout(badge_row)
        cv.addWidget(self.plots, 1)

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
        rv.addWidget(self.stats_panel)
        rv.addWidget(text_box, 1)
        right.setMinimumWidth(240)
        right.setMaximumWidth(420)
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
        self.tabs = QTabWidget()
        self.tabs.addTab(self.live_splitter, "Live")
        self.tabs.addTab(self.calculator, "Calculator")
        self.setCentralWidget(self.tabs)

        # ---- status bar
        self.status_device = QLabel("no model loaded")
        self.status_device.setToolTip("The device the model runs on")
        self.status_memory = QLabel("")
        self.status_memory.setToolTip("Device memory used / total (NVML), or this process's resident memory "
                                      "(RSS) without a GPU")
        self.status_state = QLabel("")
        sb = self.statusBar()
        sb.addPermanentWidget(self.status_device)
        sb.addPermanentWidget(self.status_memory)
        sb.addPermanentWidget(self.status_state)

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        shot = QAction("Save screenshot\u2026", self)
        shot.triggered.connect(lambda: self.save_screenshot(ask=True))
        file_menu.addAction(shot)
        file_menu.addSeparator()
        quit_action = QAction("Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
        self.file_menu = file_menu

        run_menu = bar.addMenu("&Run")
        for text, slot in (("Start", self.start_run), ("Pause / resume", self.toggle_pause), ("Stop", self.stop_run)):
            action = QAction(text, self)
            action.triggered.connect(slot)
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
        help_menu = bar.addMenu("&Help")
        keys = QAction("Keys: " + KEYS_HELP, self)
        keys.setEnabled(False)
        help_menu.addAction(keys)

    def _build_shortcuts(self) -> None:
        def key(seq: str, slot) -> None:
            sc = QShortcut(QKeySequence(seq), self)
            sc.setContext(Qt.ShortcutContext.WindowShortcut)
            sc.activated.connect(slot)

        for n in range(1, 6):
            key(str(n), lambda n=n: self.attention_key(n))
        key("F", self.toggle_flash)
        key("C", self.next_cache)
        key("Space", self.toggle_pause)
        key("Ctrl+S", lambda: self.save_screenshot())
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
            for key in IMPLS:
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
        from core.generate import RunRequest

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
        kwargs = dict(source=source, device=self.device_combo.currentText(), dtype=self.dtype_combo.currentText(),
                      max_new_tokens=self.max_tokens_spin.value(), settings=settings)
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
        if self.state == "loading" and self.request is not None:
            self._start_now(self.request)

    def _start_now(self, request) -> None:
        self.reset_view()
        self.error_label.setText("")
        self.last_error = ""
        self._set_state("loading")
        self.statusBar().showMessage(f"loading {request.source}\u2026")
        self.controller.start(request)

    def stop_run(self) -> None:
        if self.controller is None or self.state == "idle":
            return
        self._set_state("stopping")
        # Cooperative: the loop ends after the current token. Short wait, then the finished signal
        # finishes the job, so a slow token never freezes the window.
        if self.controller.stop(timeout_s=0.2):
            self._on_finished()

    def toggle_pause(self) -> None:
        if self.controller is None:
            return
        if self.state == "running":
            self.controller.pause()
        elif self.state == "paused":
            self.controller.resume()

    def reset_view(self) -> None:
        """Clear plots, text and numbers (a new run or a new recording)."""
        self.plots.reset()
        self.text_view.clear()
        self._pending_text.clear()
        self.last_sample = None
        self.decode_tokens = 0
        self.switch_events = 0
        self.stats_panel.show_stats(compute_stats(None, None, None))

    # ---- signals from the controller

    def add_samples(self, samples: list[Sample]) -> None:
        """Take a batch of samples (live or replayed): buffers now, drawing at the next frame."""
        if not samples:
            return
        self.plots.add_samples(samples)
        for s in samples:
            if s.phase == PHASE_EVENT:
                if s.event == "switch":
                    self.switch_events += 1
                    self._pending_text.append(("marker", f" \u27e8{self.plots.markers[-1].label}\u27e9 "
                                               if self.plots.markers else " \u27e8switch\u27e9 "))
                    self._show_settings(s)
                elif s.event in ("refused", "oom", "budget", "forecast", "error"):
                    self.statusBar().showMessage(s.text, 8000)
                continue
            if s.phase == PHASE_PREFILL:
                self._pending_text.append(("prompt", s.text))
            elif s.phase == PHASE_DECODE:
                self.decode_tokens += 1
                self._pending_text.append(("token", s.text))
            if self.last_sample is None:
                self._show_settings(s)
            self.last_sample = s
        if self.state == "loading":
            self._set_state("running")
        self.samples_added.emit(self.decode_tokens)

    def set_model_info(self, info) -> None:
        """A model is loaded (or a recording opened): show it and what it can switch to."""
        self.info = info
        self._attention_choices = tuple(info.attention_choices) or DEFAULT_ATTENTION
        self._cache_choices = tuple(info.cache_choices) or DEFAULT_CACHES
        self._impl_choices = tuple(info.attn_impl_choices) or IMPLS
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

    def _on_progress(self, text: str) -> None:
        self.statusBar().showMessage(text)

    def _on_error(self, message: str) -> None:
        self.last_error = message
        self._show_error(message)

    def _on_finished(self) -> None:
        if self.state == "idle":
            return
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
            self.statusBar().showMessage(f"switching {key} to {value} after this token\u2026", 3000)

    def attention_key(self, n: int) -> None:
        """Keys 1-5: mha, the middle GQA choice, mqa, mla, window."""
        choices = list(self._attention_choices)
        gqa = [c for c in choices if c.startswith("gqa:")]
        wanted = {
            1: "mha" if "mha" in choices else None,
            2: gqa[len(gqa) // 2] if gqa else None,
            3: "mqa" if "mqa" in choices else None,
            4: "mla" if "mla" in choices else None,
            5: next((c for c in choices if c.startswith("window")), None),
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

    def _redraw(self) -> None:
        """The fixed-rate frame: curves, then any text that arrived. Never raises into Qt."""
        try:
            self.plots.redraw()
            if self._pending_text:
                self._flush_text()
        except Exception:  # a drawing bug must not kill the timer (and the demo)
            log.exception("redraw failed")

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
        # Consecutive pieces of the same kind go in as one insertion.
        run_kind, run_text = None, []
        for kind, text in self._pending_text + [(None, "")]:
            if kind != run_kind and run_text:
                cursor.insertText("".join(run_text), formats[run_kind])
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
                max_context=(req.settings.max_context if req else None), host_available=host)
            self.stats_panel.show_stats(stats)
            if s is not None:
                if s.device_used is not None and s.device_total is not None:
                    self.status_memory.setText(f"GPU {human_bytes(s.device_used)} / {human_bytes(s.device_total)}")
                elif s.process_rss is not None:
                    self.status_memory.setText(f"host: this process {human_bytes(s.process_rss)} (RSS)")
        except Exception:
            log.exception("stats refresh failed")

    # ============================================================================================
    # state, looks

    def _set_state(self, state: str) -> None:
        self.state = state
        running = state in ("loading", "running", "paused", "stopping")
        self.start_button.setEnabled(not running and self.controller is not None)
        self.pause_button.setEnabled(state in ("running", "paused"))
        self.pause_button.setText("Resume" if state == "paused" else "Pause")
        self.stop_button.setEnabled(running and state != "stopping")
        for w in (self.source_combo, self.source_stack, self.device_combo, self.dtype_combo, self.max_context_spin,
                  self.max_tokens_spin, self.prompt_edit):
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
        self.presenter = bool(on)
        self.presenter_action.setChecked(self.presenter)
        self.controls_scroll.setVisible(not self.presenter)
        self.right_panel.setMaximumWidth(560 if self.presenter else 420)
        self.right_panel.setMinimumWidth(380 if self.presenter else 250)
        self.apply_theme()
        if fullscreen:
            if self.presenter:
                self.showFullScreen()
            else:
                self.showNormal()

    def apply_theme(self) -> None:
        self.theme = make_theme(self.theme_name, self.presenter)
        self.setStyleSheet(stylesheet(self.theme))
        self.plots.apply_theme(self.theme)
        self.calculator.apply_theme(self.theme)
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

    def restore_settings(self) -> None:
        s = self.qsettings
        geometry = s.value("window/geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1600, 1000)
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
            self.max_tokens_spin.setValue(int(s.value("max_new_tokens", 256) or 256))
        except (TypeError, ValueError):
            pass
        prompt = s.value("prompt")
        if prompt:
            self.prompt_edit.setPlainText(str(prompt))
        else:
            try:
                from core.generate import DEFAULT_PROMPT
            except ImportError:
                DEFAULT_PROMPT = "Every token keeps a key and a value in every layer, so the cache grows: "
            self.prompt_edit.setPlainText(DEFAULT_PROMPT)
        s.endGroup()
        self.calculator.restore_settings(s)

    def save_settings(self) -> None:
        s = self.qsettings
        if not self.presenter:
            s.setValue("window/geometry", self.saveGeometry())
            s.setValue("window/live_splitter", self.live_splitter.saveState())
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
                log.warning("the generation thread did not stop within 5 s")
        self.calculator.shutdown()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt API)
        # Settings are saved after the worker stopped, so they never describe a half-stopped run.
        self.shutdown()
        self.save_settings()
        super().closeEvent(event)

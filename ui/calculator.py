"""The calculator tab: what a context costs for any model, from the predictor alone (no weights).

A spec is loaded in a pool thread (the first one imports transformers, which takes seconds);
after that every slider move recomputes in well under a frame: ``core.predict.predict`` is about
0.1 ms, the chart is 72 of those and "the largest context that fits" is a binary search.

About 800 lines, one tab: its inputs (a model, sliders), its outputs (the numbers, the formula from
``core.calc.kv_formula``, the stacked chart) and the background spec loads are one widget's parts;
the arithmetic is all in ``core`` (predict, calc). The models on this machine come from the controls'
scan (``ui.controls.InstalledModels``, shared through the window's settings).
"""

from __future__ import annotations

import html
import logging
import math
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QObject, QRunnable, QSettings, Qt, QThreadPool, Signal
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from core.attention import native_attention, parse_attention
from core.caches import parse_cache
from core.predict import kv_bytes, max_context_that_fits, predict
from core.safe_text import NAME_LIMIT, safe_text
from core.settings import RunSettings, attention_choices, cache_choices
from core.longlived import freeze_long_lived
from core.sources import load_spec
from core.spec import ModelSpec, SpecError, human_bytes, parse_size, preset_names
from core.calc import SEARCH_LIMIT, kv_formula
from core.parallel import Parallelism, max_context_per_gpu, predict_parallel
from core.llamacpp import CACHE_TYPES, formula_llamacpp, max_context_llamacpp, predict_llamacpp
from ui.controls import IMPORT_LOCK, FollowsInstalled, InstalledModels
from ui.forms import form_box
from ui.axes import BytesAxis, format_count, format_tokens
from ui.theme import Theme, theme as make_theme

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float8", "int8", "int4")
KV_DTYPES = (None, "float32", "bfloat16", "float16", "float8", "int8", "int4", "int2")
MEMORY_CHOICES = ("8 GiB  laptop GPU", "12 GiB  RTX 4070", "16 GiB  RTX 4080", "24 GiB  RTX 4090",
                  "32 GiB  RTX 5090", "48 GiB  L40S", "80 GiB  A100 / H100", "141 GiB  H200",
                  "192 GiB  B200")
MIN_CONTEXT_CEILING = 128 * 1024  # the slider reaches at least 128K, beyond a shorter model's max (flagged)
SLIDER_STEPS = 1000
CHART_POINTS = 72
#: (tensor parallel, pipeline parallel) layouts the GPUs box offers.
GPU_LAYOUTS = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2))


TIMES = " \u00d7 "
#: Marks the model combo's entries that list installed models (and their separator), to refill them.
INSTALLED_ROLE = Qt.ItemDataRole.UserRole + 1


def _gpus_text(tp: int, pp: int) -> str:
    if tp * pp == 1:
        return "1 GPU"
    parts = ([f"TP {tp}"] if tp > 1 else []) + ([f"PP {pp}"] if pp > 1 else [])
    return f"{tp * pp} GPUs ({TIMES.join(parts)})"


class _SpecSignals(QObject):
    done = Signal(int, object, str)  # request id, ModelSpec or None, error message
    warmed = Signal()


class _WarmJob(QRunnable):
    """Imports transformers once, before anything else may import it from another thread.

    transformers' lazy package is not safe to initialise from two threads at once (a second thread
    sees a half-initialised module: "cannot import name 'AutoConfig'"). The window runs this first
    and starts the generation thread only after it finished.
    """

    def __init__(self, signals: _SpecSignals) -> None:
        super().__init__()
        self.signals = signals

    def run(self) -> None:
        try:
            # Loading the embedded preset's spec goes through AutoConfig, the meta-device model build
            # and cache_utils: all of transformers that a spec load or a model load starts from.
            with IMPORT_LOCK:  # not while the installed-model scan imports huggingface_hub
                load_spec("embedded")
            # The window's long-lived objects (Qt, pyqtgraph, torch, transformers) are all alive now:
            # out of the collector's walks, so full collections stop pausing the UI thread.
            freeze_long_lived()
        except Exception:  # the spec loads report their own errors
            log.exception("importing transformers")
        finally:
            self.signals.warmed.emit()


class _SpecJob(QRunnable):
    """Loads a spec off the UI thread (transformers' first import and a hub fetch take seconds)."""

    def __init__(self, request_id: int, source: str, signals: _SpecSignals) -> None:
        super().__init__()
        self.request_id, self.source, self.signals = request_id, source, signals

    def run(self) -> None:
        try:
            spec = load_spec(self.source)
        except SpecError as exc:
            self.signals.done.emit(self.request_id, None, str(exc))
        except Exception as exc:  # never a silent dead job; the message is shown in the tab
            log.exception("loading spec %s", self.source)
            self.signals.done.emit(self.request_id, None, f"{type(exc).__name__}: {exc}")
        else:
            self.signals.done.emit(self.request_id, spec, "")


class TokensLog2Axis(pg.AxisItem):
    """x axis whose values are log2(tokens), labelled in tokens (1K, 32K, 128K)."""

    def tickValues(self, minVal, maxVal, size):  # noqa: N802 (pyqtgraph API)
        lo, hi = math.floor(minVal), math.ceil(maxVal)
        step = 1
        while (hi - lo) / step > max(size / 55.0, 2):
            step += 1
        major = [v for v in range(lo, hi + 1) if v % step == 0 and minVal <= v <= maxVal]
        return [(step, major)]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 (pyqtgraph API)
        return [format_tokens(2 ** int(round(v))) for v in values]


@dataclass(frozen=True)
class CalcState:
    """What the tab shows after an update (for tests and the window's screenshot checks)."""

    context: int
    settings: RunSettings
    weights: int
    kv: int
    activations: int
    total: int
    memory: int | None
    max_fit: int | None


class _StopSlider(QSlider):
    """A slider whose arrow keys go from stop to stop (the context slider's powers of two: 4K, 8K, 16K...),
    not one of its thousand fine steps; Page Up/Down go two stops. Without stops, Qt's own keys."""

    def __init__(self) -> None:
        super().__init__(Qt.Orientation.Horizontal)
        self.stops: list[int] = []  # slider positions, ascending

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt's name
        keys = {Qt.Key.Key_Right: 1, Qt.Key.Key_Up: 1, Qt.Key.Key_Left: -1, Qt.Key.Key_Down: -1,
                Qt.Key.Key_PageUp: 2, Qt.Key.Key_PageDown: -2}
        move = keys.get(Qt.Key(event.key()))
        if not self.stops or move is None:
            super().keyPressEvent(event)
            return
        self.setValue(self.stop_from(self.value(), move))
        event.accept()

    def stop_from(self, position: int, move: int) -> int:
        """The position ``move`` stops away from ``position`` (which need not be a stop)."""
        import bisect

        if move > 0:
            i = bisect.bisect_right(self.stops, position) + move - 1
        else:
            i = bisect.bisect_left(self.stops, position) + move
        return self.stops[min(max(i, 0), len(self.stops) - 1)]


class _Slider(QWidget):
    """A labelled discrete slider over ``values`` with a text for the current one."""

    changed = Signal()

    def __init__(self, title: str, tooltip: str) -> None:
        super().__init__()
        self.values: list = [None]
        self.fmt = str
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.slider = _StopSlider()
        self.slider.setMinimumWidth(160)
        self.value_label = QLabel()
        self.value_label.setMinimumWidth(110)
        self.value_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        layout.addWidget(self.slider, 1)
        layout.addWidget(self.value_label)
        self.title = title
        self.setToolTip(tooltip)
        self.slider.valueChanged.connect(self._moved)

    def set_values(self, values: list, fmt=str, current=None, stops: list | None = None) -> None:
        """The values in order; ``stops``: the values the arrow keys go between (default: every one)."""
        self.values, self.fmt = list(values), fmt
        self.slider.stops = [self.values.index(v) for v in stops if v in self.values] if stops else []
        self.slider.blockSignals(True)
        self.slider.setRange(0, len(self.values) - 1)
        index = self.values.index(current) if current in self.values else 0
        self.slider.setValue(index)
        self.slider.blockSignals(False)
        self.value_label.setText(self.fmt(self.value()))

    def value(self):
        return self.values[min(self.slider.value(), len(self.values) - 1)]

    def set_value(self, value) -> None:
        if value in self.values:
            self.slider.setValue(self.values.index(value))

    def _moved(self) -> None:
        self.value_label.setText(self.fmt(self.value()))
        self.changed.emit()


class CalculatorTab(FollowsInstalled, QWidget):
    """Preset / config / hub id in, sliders for the settings, a stacked chart and the numbers out."""

    updated = Signal(object)  # CalcState
    spec_loaded = Signal(object)  # ModelSpec

    def __init__(self, theme: Theme | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.theme = theme or make_theme("dark")
        self.spec: ModelSpec | None = None
        self.state: CalcState | None = None
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(1)
        self._signals = _SpecSignals()
        self._signals.done.connect(self._spec_done)
        self._signals.warmed.connect(self._on_warmed)
        self.warm = False
        self._request_id = 0
        self._specs: dict[str, ModelSpec] = {}
        self._detected: tuple[int, str] | None = None
        self._chart_key = None
        self._fit_key = None
        self._fit: int | None = None

        # ---- inputs
        self.model_combo = QComboBox()
        self.model_combo.setEditable(True)
        self.model_combo.addItems(preset_names())
        self._preset_count = self.model_combo.count()
        self.installed: InstalledModels | None = None  # the models on this machine, listed after the presets
        self.model_combo.setToolTip("A preset, a model already on this machine (after the presets), a path to a "
                                    "config.json, a model folder or a .gguf file, or a Hugging Face hub id\n(org/name; "
                                    "the config alone is fetched). Press Enter to load.")
        self.model_combo.lineEdit().returnPressed.connect(lambda: self.load_model(self.model_combo.currentText()))
        self.model_combo.activated.connect(self._model_activated)
        browse = QPushButton("Config\u2026")
        browse.setToolTip("Choose a config.json (or a model folder's config)")
        browse.clicked.connect(self._browse)
        self.model_status = QLabel("")
        self.model_status.setObjectName("statNote")
        self.model_status.setWordWrap(True)
        self.model_status.setTextFormat(Qt.TextFormat.PlainText)  # model names come from files: never HTML

        self.context = _Slider("Context", "Tokens in the cache (prompt + generated), on a log scale.")
        self.batch = _Slider("Batch", "Sequences generated at once; KV and activations scale with it.")
        self.dtype = _Slider("Weights dtype", "Element type of the weights (int4/int8: quantized weights).")
        self.kv_dtype = _Slider("KV dtype", "Element type of the cached K/V; 'as weights' is what transformers' "
                                             "caches store by default.")
        self.attention = _Slider("Attention", "Attention mode: how many K/V heads (or a latent, or a window) "
                                              "each layer caches per token.")
        self.batch.set_values([2 ** i for i in range(9)], lambda v: f"{v}")
        self.dtype.set_values(list(WEIGHT_DTYPES), str, "bfloat16")
        self.kv_dtype.set_values(list(KV_DTYPES), lambda v: "as weights" if v is None else v)
        self.cache_combo = QComboBox()
        self.cache_combo.addItems([key for key, _ in cache_choices()])
        self.cache_combo.setToolTip("Cache strategy: dynamic grows per token; static preallocates the context; "
                                    "quantized stores 4/2-bit or fp8 codes.")
        self.memory_combo = QComboBox()
        self.memory_combo.setEditable(True)
        self.memory_combo.addItems(MEMORY_CHOICES)
        self.memory_combo.setCurrentText("24 GiB  RTX 4090")
        self.memory_combo.setToolTip("GPU memory to fit into: detected from the loaded model's device, picked, "
                                     "or typed (e.g. 24GiB, 80 GB).")
        self.memory_combo.currentTextChanged.connect(lambda _t: self.recompute())
        # Tensor x pipeline parallel, as vLLM splits a model (core.parallel): the numbers are then one GPU's.
        self.gpus_combo = QComboBox()
        for tp, pp in GPU_LAYOUTS:
            self.gpus_combo.addItem(_gpus_text(tp, pp))
        self.gpus_combo.setToolTip("How many GPUs share the model: tensor parallel splits every layer's K/V heads "
                                   "(replicated past the KV-head count), pipeline parallel splits the layers.\n"
                                   "With more than one, the numbers, the chart and what fits are the busiest GPU's; "
                                   "GPU memory is per GPU.")
        self.gpus_combo.currentIndexChanged.connect(lambda _i: self._settings_changed())
        # The runtime: transformers' caches grow per token; llama.cpp allocates the whole context at load
        # (core.llamacpp, its rules). Under llama.cpp the Cache list holds its cache types (K = V).
        self.runtime_combo = QComboBox()
        self.runtime_combo.addItem("transformers (grows per token)", "transformers")
        self.runtime_combo.addItem("llama.cpp (allocated at load)", "llama.cpp")
        self.runtime_combo.setToolTip("transformers: the cache holds the tokens so far (a dynamic cache).\n"
                                      "llama.cpp (LM Studio, Ollama): the whole context's KV cache is allocated when the "
                                      "model loads, padded to 256 cells; a .gguf model gives its exact weights.")
        self.runtime_combo.currentIndexChanged.connect(lambda _i: self._runtime_changed())
        self._transformers_cache = "dynamic"

        self.context.changed.connect(self.recompute)
        self.cache_combo.currentIndexChanged.connect(lambda _i: self._settings_changed())
        for s in (self.batch, self.dtype, self.kv_dtype, self.attention):
            s.changed.connect(self._settings_changed)

        model_row = QHBoxLayout()
        model_row.addWidget(self.model_combo, 1)
        model_row.addWidget(browse)
        inputs = form_box("Model and settings", [
            ("Model", model_row), ("", self.model_status), ("Runtime", self.runtime_combo), ("Context", self.context),
            ("Batch", self.batch),
            ("Weights", self.dtype), ("KV dtype", self.kv_dtype), ("Attention", self.attention),
            ("Cache", self.cache_combo), ("GPU memory", self.memory_combo), ("GPUs", self.gpus_combo)])

        # ---- outputs
        self.headline = QLabel("Loading\u2026")
        self.headline.setObjectName("headline")
        self.headline.setWordWrap(True)
        self.fits_label = QLabel("")
        self.fits_label.setToolTip("The largest context whose predicted total (weights + KV + activation peak) "
                                   "fits in the GPU memory above (core.predict.max_context_that_fits).")
        self.fits_label.setObjectName("headline")
        self.fits_label.setWordWrap(True)  # never wider than the column: at 1024x768 its one line cut the numbers off
        self.numbers = {}
        numbers_box = QGroupBox("Breakdown at this context")
        grid = QGridLayout(numbers_box)
        tips = {
            "weights": "Parameters x bytes per element (parameter count from a meta-device build of the config).",
            "kv": "Exact bytes of the KV cache for this context, mirroring transformers' cache classes.",
            "activations": "Peak transient bytes of one forward pass (the larger of the prefill and one decode step).",
            "total": "weights + KV + activations: what must fit on the GPU (plus the runtime's own few hundred MiB).",
            "per_token": "KV bytes added per token of context.",
        }
        names = {"weights": "Weights", "kv": "KV cache", "activations": "Activations (peak)", "total": "Total",
                 "per_token": "KV per token"}
        self.number_names: dict[str, QLabel] = {}
        for row, key in enumerate(names):
            name = QLabel(names[key])
            name.setObjectName("statName")
            value = QLabel("\u2014")
            value.setObjectName("statValue")
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            for w in (name, value):
                w.setToolTip(tips[key])
            grid.addWidget(name, row, 0)
            grid.addWidget(value, row, 1)
            self.numbers[key] = value
            self.number_names[key] = name
        self.formula_label = QLabel("")
        self.formula_label.setObjectName("formula")
        self.formula_label.setWordWrap(True)
        self.formula_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.formula_label.setToolTip("The KV-cache formula with this model's numbers substituted; the result is "
                                      "the exact bytes a dynamic cache of full-attention layers holds.")
        self.error_label = QLabel("")
        self.error_label.setTextFormat(Qt.TextFormat.PlainText)  # errors quote files: never HTML
        self.error_label.setObjectName("error")
        self.error_label.setWordWrap(True)

        self.chart = pg.PlotWidget(axisItems={"left": BytesAxis(orientation="left"),
                                              "bottom": TokensLog2Axis(orientation="bottom")})
        self.chart.setMinimumHeight(180)  # the whole tab fits 1280x720 (else it scrolls)
        self.chart.setToolTip("Predicted memory vs context (log scale), stacked: weights, KV cache, activation "
                              "peak. Horizontal line: the GPU's memory. Vertical lines: this context, the "
                              "largest that fits and the model's trained maximum.")
        plot = self.chart.getPlotItem()
        plot.setMenuEnabled(False)
        plot.hideButtons()
        plot.setMouseEnabled(x=False, y=False)
        self._legend = plot.addLegend(offset=(10, 10))
        self._zero = pg.PlotDataItem()
        self._layers = {k: pg.PlotDataItem() for k in ("weights", "kv", "activations")}
        self._fills = {}
        self._swatches = {}
        lower = self._zero
        for key, name in (("weights", "weights"), ("kv", "KV cache"), ("activations", "activations")):
            plot.addItem(self._layers[key])
            fill = pg.FillBetweenItem(lower, self._layers[key])
            plot.addItem(fill)
            self._fills[key] = fill
            # A legend sample of a FillBetweenItem crashes pyqtgraph 0.14's ItemSample; a filled
            # stand-in curve (never added to the plot) draws the same swatch.
            swatch = pg.PlotDataItem([0], [0], fillLevel=0)
            self._swatches[key] = swatch
            self._legend.addItem(swatch, name)
            lower = self._layers[key]
        self.memory_line = pg.InfiniteLine(angle=0, movable=False, label="", labelOpts={"position": 0.02,
                                           "anchors": [(0, 1), (0, 1)]})
        self.context_line = pg.InfiniteLine(angle=90, movable=False, label="", labelOpts={"position": 0.95,
                                            "anchors": [(1, 0), (1, 0)]})
        self.fit_line = pg.InfiniteLine(angle=90, movable=False, label="", labelOpts={"position": 0.80,
                                        "anchors": [(0, 0), (0, 0)]})
        self.trained_line = pg.InfiniteLine(angle=90, movable=False, label="", labelOpts={"position": 0.65,
                                            "anchors": [(1, 0), (1, 0)]})
        for line in (self.memory_line, self.context_line, self.fit_line, self.trained_line):
            plot.addItem(line, ignoreBounds=line is not self.memory_line)

        right = QVBoxLayout()
        right.addWidget(self.headline)
        right.addWidget(self.fits_label)
        right.addWidget(numbers_box)
        formula_box = QGroupBox("KV cache formula")
        fl = QVBoxLayout(formula_box)
        fl.addWidget(self.formula_label)
        right.addWidget(formula_box)
        right.addWidget(self.error_label)
        right.addStretch(1)

        top = QHBoxLayout()
        left_col = QVBoxLayout()
        left_col.addWidget(inputs)
        left_col.addStretch(1)
        top.addLayout(left_col, 5)
        top.addLayout(right, 4)
        outer = QVBoxLayout(self)
        outer.addLayout(top, 0)
        outer.addWidget(self.chart, 1)
        inputs.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self.apply_theme(self.theme)

    # ---------------------------------------------------------------------------------------------
    # model

    warmed = Signal()

    def warm_up(self) -> None:
        """Import transformers in the pool thread (first job; spec loads queue behind it)."""
        if not self.warm and not getattr(self, "_warming", False):
            self._warming = True
            self.pool.start(_WarmJob(self._signals))

    def _on_warmed(self) -> None:
        self.warm = True
        self.warmed.emit()

    # ---- the installed models, after the presets (use_installed: FollowsInstalled)

    def _fill_installed(self) -> None:
        combo = self.model_combo
        current = self.current_source()
        text = combo.currentText()
        combo.blockSignals(True)
        try:
            for i in reversed(range(combo.count())):
                if combo.itemData(i, INSTALLED_ROLE):
                    combo.removeItem(i)
            models = self.installed.models if self.installed is not None else []
            at = self._preset_count
            if models:
                combo.insertSeparator(at)
                combo.setItemData(at, True, INSTALLED_ROLE)
            for k, m in enumerate(models, start=at + 1):
                combo.insertItem(k, m.describe(), m.source)
                combo.setItemData(k, True, INSTALLED_ROLE)
                combo.setItemData(k, f"{m.describe()}\n{m.source}", Qt.ItemDataRole.ToolTipRole)
            i = combo.findData(current) if current else -1
            if i >= 0:
                combo.setCurrentIndex(i)
            else:
                combo.setEditText(text)
        finally:
            combo.blockSignals(False)

    def current_source(self) -> str:
        """What the model combo names: an installed entry's path, else the text (a preset, path or hub id)."""
        combo = self.model_combo
        i = combo.currentIndex()
        if i >= 0 and combo.itemData(i) and combo.itemText(i) == combo.currentText():
            return str(combo.itemData(i))
        return combo.currentText().strip()

    def _model_activated(self, index: int) -> None:
        self.load_model(str(self.model_combo.itemData(index) or self.model_combo.itemText(index)))

    def _resolve(self, source: str) -> str:
        """A typed installed model's name or entry text ('llama3.2:1b') is that model's path."""
        if self.installed is not None:
            for m in self.installed.models:
                if source in (m.label, m.describe()):
                    return m.source
        return source

    def load_model(self, source: str) -> None:
        """Load a spec (preset, config path, model folder, GGUF file, installed model's name, hub id) in the
        background; the tab updates when it arrives."""
        source = self._resolve(source.strip())
        if not source:
            return
        if source in self._specs:
            self.set_spec(self._specs[source])
            return
        self.warm_up()
        self._request_id += 1
        self.model_status.setText(f"loading {safe_text(source, limit=NAME_LIMIT)}\u2026")
        listed = self.model_combo.findData(source)
        if listed >= 0:
            self.model_combo.setCurrentIndex(listed)
        elif self.model_combo.currentText() != source:
            self.model_combo.setCurrentText(source)
        self.pool.start(_SpecJob(self._request_id, source, self._signals))
        self._pending_source = source

    def _spec_done(self, request_id: int, spec: ModelSpec | None, error: str) -> None:
        if request_id != self._request_id:
            return  # a newer model was asked for meanwhile
        if spec is None:
            self.model_status.setText("")
            self.error_label.setText(safe_text(error))
            return
        self._specs[self._pending_source] = spec
        self.set_spec(spec)
        self._follow_installed(self._pending_source)

    def _follow_installed(self, source: str) -> None:
        """A GGUF runs in llama.cpp (Ollama, LM Studio): picking one shows llama.cpp's allocation, at the context its
        Ollama Modelfile sets (num_ctx) when it sets one."""
        model = next((m for m in (self.installed.models if self.installed is not None else []) if m.source == source),
                     None)
        if model is None and not (isinstance(self.spec.config, dict) and self.spec.config.get("gguf")):
            return
        if self.runtime != "llama.cpp":
            self.runtime_combo.setCurrentIndex(self.runtime_combo.findData("llama.cpp"))
        if model is not None and model.num_ctx:
            self.set_context(model.num_ctx)

    def set_spec(self, spec: ModelSpec, source: str | None = None) -> None:
        """Show ``spec`` (also used for the model the Live tab loaded)."""
        if source:
            self._specs[source] = spec
            if self.model_combo.findText(source) < 0:
                self.model_combo.addItem(source)
            self.model_combo.setCurrentText(source)
        self.spec = spec
        self.error_label.setText("")
        ceiling = max(spec.max_position_embeddings, MIN_CONTEXT_CEILING)
        self._context_values = sorted({int(round(2 ** (math.log2(ceiling) * i / SLIDER_STEPS)))
                                       for i in range(SLIDER_STEPS + 1)} | {2 ** k for k in range(int(math.log2(ceiling)) + 1)})
        current = self.context.value() if self.context.values != [None] else 4096
        current = min(self._context_values, key=lambda v: abs(v - (current or 4096)))
        self.context.set_values(self._context_values, lambda v: f"{format_tokens(v)} tokens", current,
                                stops=[2 ** k for k in range(int(math.log2(ceiling)) + 1)])
        self.dtype.set_values(list(WEIGHT_DTYPES), str, spec.dtype if spec.dtype in WEIGHT_DTYPES else "bfloat16")
        choices = list(attention_choices(spec))
        self.attention.set_values(choices, str, native_attention(spec).key)
        self._fill_caches()
        self.model_status.setText(
            f"{safe_text(spec.label, limit=NAME_LIMIT)}: {spec.num_layers} layers, {spec.num_query_heads} query / "
            f"{spec.num_kv_heads} KV heads "
            f"of {spec.head_dim}, {format_count(spec.num_parameters)} parameters, trained to "
            f"{format_tokens(spec.max_position_embeddings)} tokens")
        self._chart_key = None
        self.spec_loaded.emit(spec)
        self.recompute()

    @property
    def runtime(self) -> str:
        return self.runtime_combo.currentData() or "transformers"

    def _fill_caches(self) -> None:
        """The Cache list for the runtime: transformers' strategies (the sink and h2o sizes follow the model's
        context), or llama.cpp's cache types."""
        llama = self.runtime == "llama.cpp"
        cache = self.cache_combo.currentText()
        keys = list(CACHE_TYPES) if llama else [key for key, _ in cache_choices(spec=self.spec)]
        if cache not in keys:
            cache = "f16" if llama else self._transformers_cache
        self.cache_combo.blockSignals(True)
        self.cache_combo.clear()
        self.cache_combo.addItems(keys if cache in keys else keys + [cache])
        self.cache_combo.setCurrentText(cache)
        self.cache_combo.blockSignals(False)
        for w in (self.batch, self.dtype, self.kv_dtype, self.attention, self.gpus_combo):
            w.setEnabled(not llama)
            w.setToolTip(w.toolTip().split("\n(llama.cpp")[0] + ("\n(llama.cpp: not used; one sequence, the file's "
                                                                 "weights, the model's own attention)" if llama else ""))

    def _runtime_changed(self) -> None:
        if self.runtime == "llama.cpp":
            self._transformers_cache = self.cache_combo.currentText()
        self._fill_caches()
        self._fit_key = None
        self._settings_changed()

    def set_context(self, tokens: int) -> None:
        """Move the context slider to the value nearest ``tokens``."""
        if self.spec is None:
            return
        nearest = min(self._context_values, key=lambda v: abs(v - tokens))
        self.context.set_value(nearest)

    def set_detected_memory(self, total: int | None, device_name: str) -> None:
        """Offer the memory of the device the Live tab loaded onto (selected when it is a GPU)."""
        if not total:
            return
        text = f"{human_bytes(total)}  {device_name} (detected)"
        if self.memory_combo.findText(text) < 0:
            self.memory_combo.insertItem(0, text)
        self.memory_combo.setCurrentText(text)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model config", "", "config (*.json);;all files (*)")
        if path:
            self.model_combo.setCurrentText(path)
            self.load_model(path)

    # ---------------------------------------------------------------------------------------------
    # compute

    def memory_bytes(self) -> int | None:
        """The GPU memory typed or picked (the leading size of the combo's text), or None if unreadable."""
        text = self.memory_combo.currentText().strip()
        if not text:
            return None
        head = text.split("  ")[0].split("(")[0].strip()
        try:
            return parse_size(head)
        except SpecError:
            return None

    def current_settings(self) -> RunSettings:
        context = self.context.value()
        cache = parse_cache("dynamic" if self.runtime == "llama.cpp" else self.cache_combo.currentText())
        return RunSettings(batch=self.batch.value(), weight_dtype=self.dtype.value(), kv_dtype=self.kv_dtype.value(),
                           attention=parse_attention(self.attention.value()), cache=cache,
                           max_context=context if cache.name == "static" else None,
                           attn_impl="eager" if cache.needs_attention_weights else "sdpa")

    def parallelism(self) -> Parallelism:
        tp, pp = GPU_LAYOUTS[max(self.gpus_combo.currentIndex(), 0)]
        return Parallelism(tensor=tp, pipeline=pp)

    def _predict(self, spec: ModelSpec, settings: RunSettings, context: int):
        """The prediction the numbers show: the model's, or with several GPUs the busiest GPU's share; under
        llama.cpp what it allocates at load for this context (core.llamacpp)."""
        if self.runtime == "llama.cpp":
            return predict_llamacpp(spec, context, self.cache_combo.currentText() or "f16")
        parallel = self.parallelism()
        if parallel.single:
            return predict(spec, settings, context)
        shares = predict_parallel(spec, settings, parallel, context).per_gpu()
        return max(shares, key=lambda share: share.total)

    def _settings_changed(self) -> None:
        self._chart_key = None
        self.recompute()

    def recompute(self) -> None:
        """Update every number, the formula and the chart for the current inputs (about a millisecond)."""
        spec = self.spec
        if spec is None:
            return
        try:
            settings = self.current_settings()
            context = int(self.context.value())
            parallel = self.parallelism()
            p = self._predict(spec, settings, context)
            memory = self.memory_bytes()
            ceiling = self._context_values[-1]
            llama = self.runtime == "llama.cpp"
            fit_key = (spec, settings.with_(max_context=None), memory, ceiling, parallel, self.runtime,
                       self.cache_combo.currentText())
            if fit_key != self._fit_key:
                # Depends on everything but the context slider: cached so dragging it stays cheap.
                self._fit_key = fit_key
                if not memory:
                    self._fit = None
                elif llama:
                    self._fit = max_context_llamacpp(spec, memory, self.cache_combo.currentText() or "f16", ceiling)
                elif parallel.single:  # calc's search (core.calc.calculate): not capped at the slider's end
                    self._fit = max_context_that_fits(spec, settings.with_(max_context=None), memory, limit=SEARCH_LIMIT)
                else:
                    self._fit = max_context_per_gpu(spec, settings.with_(max_context=None), parallel, memory, SEARCH_LIMIT)
            fit = self._fit
            formula = (formula_llamacpp(spec, context, self.cache_combo.currentText() or "f16") if llama else
                       kv_formula(spec, settings, context, times=" \u00d7 "))
        except SpecError as exc:  # SettingsError too: e.g. quantized cache on sliding layers
            self.error_label.setText(safe_text(exc))
            return
        self.error_label.setText("")
        b = p.breakdown
        self.state = CalcState(context, settings, int(b.weights or 0), int(b.kv_cache or 0), int(b.activations or 0),
                               p.total, memory, fit)
        n = self.numbers
        n["weights"].setText(human_bytes(b.weights))
        n["kv"].setText(human_bytes(b.kv_cache))
        n["activations"].setText("not predicted" if b.activations is None else human_bytes(b.activations))
        # llama.cpp's activations are its compute buffer (core.llamacpp_compute: the CPU backend's, byte for byte)
        self.number_names["activations"].setText("Compute buffer" if llama else "Activations (peak)")
        for w in (self.number_names["activations"], n["activations"]):
            w.setToolTip("llama.cpp's compute buffer (sched_reserve: the largest of its reserved graphs through its "
                         "allocator), exact for the CPU backend; CUDA and Metal follow other kernels, not checked yet"
                         if llama else "Peak transient bytes of one forward pass (the larger of the prefill and one "
                         "decode step).")
        n["total"].setText(human_bytes(p.total))
        # With several GPUs the four sizes are the busiest GPU's share; KV per token and the formula stay totals.
        each = "" if parallel.single or llama else " per GPU"
        for key, name in (("weights", "Weights"), ("kv", "KV cache"), ("total", "Total")):
            self.number_names[key].setText(name + each)
        if each and not llama:
            self.number_names["activations"].setText("Activations (peak)" + each)
        self.number_names["per_token"].setText("KV per token" + (" (all GPUs)" if each else ""))
        per_token = (p.kv_bytes_per_token if llama else kv_bytes(spec, settings.with_(cache=parse_cache("dynamic")), 1))
        n["per_token"].setText(human_bytes(per_token))
        t = self.theme
        beyond = context > spec.max_position_embeddings
        fits_now = memory is not None and p.total <= memory
        verdict = "" if memory is None else (f"<span style='color:{t.curves['allocated']}'>fits</span>" if fits_now
                                             else f"<span style='color:{t.error}'>does not fit</span>")
        per_gpu = "" if parallel.single else f" per GPU (the busiest of {parallel.gpus})"
        self.headline.setText(
            f"{human_bytes(p.total)}{per_gpu} at {format_tokens(context)} tokens"
            + (f" \u2014 {verdict} in {human_bytes(memory)}" if memory else "")
            + (f"<br><span style='font-size:{t.font_pt}pt;color:{t.warning}'>beyond {html.escape(safe_text(spec.label, limit=NAME_LIMIT))}'s trained "
               f"context of {format_tokens(spec.max_position_embeddings)}</span>" if beyond else ""))
        if memory is None:
            self.fits_label.setText("<span style='font-size:small'>type a GPU memory size to see what fits</span>")
        elif fit is None:
            self.fits_label.setText(f"Weights alone do not fit in {human_bytes(memory)}")
        else:
            more = "+" if fit >= (ceiling if llama else SEARCH_LIMIT) else ""
            where = "" if parallel.single else f" on every one of {parallel.gpus} GPUs"
            past = (f"<br><span style='font-size:small'>past the trained {format_tokens(spec.max_position_embeddings)}"
                    "</span>" if fit > spec.max_position_embeddings else "")
            self.fits_label.setText(f"Largest context that fits{where}: {fit:,}{more} tokens{past}")
        self.formula_label.setText(formula if parallel.single or llama else f"All GPUs: {formula}")
        self._update_chart(spec, settings, context, memory, fit)
        self.updated.emit(self.state)

    def _chart_start(self) -> int:
        """The chart shows the last 10 doublings below the ceiling: where memory actually moves."""
        return max(1, self._context_values[-1] >> 10)

    def _update_chart(self, spec: ModelSpec, settings: RunSettings, context: int, memory: int | None,
                      fit: int | None) -> None:
        key = (spec, settings.with_(max_context=None), self.parallelism(), self.runtime, self.cache_combo.currentText())
        ceiling = self._context_values[-1]
        if key != self._chart_key:
            self._chart_key = key
            xs = np.unique(np.round(np.geomspace(self._chart_start(), ceiling, CHART_POINTS)).astype(np.int64))
            w, kv, act = [], [], []
            for n in xs:
                s = settings.with_(max_context=int(n)) if settings.cache.name == "static" else settings
                p = self._predict(spec, s, int(n))
                w.append(p.breakdown.weights or 0)
                kv.append(p.breakdown.kv_cache or 0)
                act.append(p.breakdown.activations or 0)
            lx = np.log2(xs.astype(float))
            w, kv, act = (np.asarray(a, dtype=float) for a in (w, kv, act))
            self._zero.setData(lx, np.zeros_like(lx))
            self._layers["weights"].setData(lx, w)
            self._layers["kv"].setData(lx, w + kv)
            self._layers["activations"].setData(lx, w + kv + act)
            self.chart.getPlotItem().setXRange(math.log2(self._chart_start()), math.log2(ceiling), padding=0.01)
        self.context_line.setValue(math.log2(context))
        self.context_line.label.setFormat(format_tokens(context))
        self.trained_line.setValue(math.log2(spec.max_position_embeddings))
        self.trained_line.label.setFormat(f"trained max {format_tokens(spec.max_position_embeddings)}")
        self.trained_line.setVisible(spec.max_position_embeddings < ceiling)
        if memory:
            self.memory_line.setValue(memory)
            self.memory_line.label.setFormat(f"GPU {human_bytes(memory)}")
            self.memory_line.setVisible(True)
        else:
            self.memory_line.setVisible(False)
        if fit is not None and fit < ceiling:
            self.fit_line.setValue(math.log2(max(fit, 1)))
            self.fit_line.label.setFormat(f"fits up to {format_tokens(fit)}")
            self.fit_line.setVisible(True)
        else:
            self.fit_line.setVisible(False)

    # ---------------------------------------------------------------------------------------------
    # looks and settings

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        self.chart.setBackground(theme.background)
        plot = self.chart.getPlotItem()
        font = QFont()
        font.setPointSize(theme.axis_pt)
        for side in ("left", "bottom"):
            axis = plot.getAxis(side)
            axis.setTickFont(font)
            axis.setTextPen(theme.muted)
            axis.setPen(theme.border)
        plot.showGrid(x=True, y=True, alpha=theme.grid_alpha)
        plot.setLabel("bottom", "context (tokens, log scale)", **{"color": theme.muted, "font-size": f"{theme.axis_pt}pt"})
        self._legend.setLabelTextColor(theme.text)
        self._legend.setLabelTextSize(f"{theme.font_pt}pt")
        for key, fill in self._fills.items():
            color = QColor(theme.curves[key])
            self._layers[key].setPen(pg.mkPen(color, width=max(1.0, theme.line_width / 2)))
            color.setAlpha(170)
            fill.setBrush(pg.mkBrush(color))
            self._swatches[key].setPen(pg.mkPen(theme.curves[key]))
            self._swatches[key].setBrush(pg.mkBrush(color))
        self._zero.setPen(None)
        lines = ((self.memory_line, theme.curves["budget"], Qt.PenStyle.SolidLine),
                 (self.context_line, theme.curves["context"], Qt.PenStyle.SolidLine),
                 (self.fit_line, theme.curves["allocated"], Qt.PenStyle.DashLine),
                 (self.trained_line, theme.muted, Qt.PenStyle.DotLine))
        label_font = QFont()
        label_font.setPointSize(theme.font_pt)
        label_font.setBold(True)
        for line, color, style in lines:
            line.setPen(pg.mkPen(color, width=theme.marker_width + 0.5, style=style))
            line.label.setColor(color)
            line.label.setFont(label_font)
        if self.spec is not None:
            self.recompute()

    def save_settings(self, s: QSettings) -> None:
        s.beginGroup("calculator")
        s.setValue("model", self.current_source())
        if self.spec is not None:
            s.setValue("context", int(self.context.value()))
        for name, slider in (("batch", self.batch), ("dtype", self.dtype), ("kv_dtype", self.kv_dtype),
                             ("attention", self.attention)):
            s.setValue(name, "" if slider.value() is None else str(slider.value()))
        s.setValue("cache", self.cache_combo.currentText() if self.runtime != "llama.cpp" else self._transformers_cache)
        s.setValue("runtime", self.runtime)
        s.setValue("memory", self.memory_combo.currentText())
        s.setValue("gpus", self.gpus_combo.currentText())
        s.endGroup()

    def restore_settings(self, s: QSettings) -> None:
        """Restore the last model and settings (the model loads in the background, then the sliders apply)."""
        s.beginGroup("calculator")
        model = str(s.value("model", "llama-3-8b") or "llama-3-8b")
        saved = {k: s.value(k) for k in ("context", "batch", "dtype", "kv_dtype", "attention", "cache", "memory", "gpus",
                                         "runtime")}
        s.endGroup()
        if saved["runtime"] == "llama.cpp":
            self.runtime_combo.setCurrentIndex(self.runtime_combo.findData("llama.cpp"))
        if saved["gpus"] and self.gpus_combo.findText(str(saved["gpus"])) >= 0:
            self.gpus_combo.setCurrentText(str(saved["gpus"]))
        if saved["cache"] and self.cache_combo.findText(str(saved["cache"])) >= 0:
            self.cache_combo.setCurrentText(str(saved["cache"]))
        if saved["memory"]:
            self.memory_combo.setCurrentText(str(saved["memory"]))

        def apply(_spec) -> None:
            self.spec_loaded.disconnect(apply)
            try:
                if saved["context"]:
                    self.set_context(int(saved["context"]))
                if saved["batch"]:
                    self.batch.set_value(int(saved["batch"]))
                if saved["dtype"]:
                    self.dtype.set_value(str(saved["dtype"]))
                self.kv_dtype.set_value(str(saved["kv_dtype"]) if saved["kv_dtype"] else None)
                if saved["attention"]:
                    self.attention.set_value(str(saved["attention"]))
            except (TypeError, ValueError):
                pass  # settings from another version: keep the defaults

        self.spec_loaded.connect(apply)
        self.use_installed(InstalledModels.for_settings(s))
        self.installed.refresh()  # the window's controls asked already: the same scan is not started twice
        self.model_combo.setCurrentText(model)
        self.load_model(model)

    def shutdown(self, timeout_ms: int = 3000) -> None:
        """Wait for a spec load and a scan for installed models in flight (no pool thread may outlive the window)."""
        self.pool.waitForDone(timeout_ms)
        if self.installed is not None:
            self.installed.wait(timeout_ms)

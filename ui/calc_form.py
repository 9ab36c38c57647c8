"""The calculator's form: the model picker and the settings a calculation reads, and what they say as a ``CalcInputs``.

The form owns its widgets and their remembered values; it loads nothing and computes nothing. It says when the
user chose a model (``source_chosen``) and when an input changed (``changed``: True where the chart's curve
changes with it, False where only its lines move: the context, the GPU memory). ``kvscope.ui.calculator.CalculatorTab``
composes it with the results (``kvscope.ui.calc_results``) and the chart.
"""

from __future__ import annotations

import bisect

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QSlider,
                               QVBoxLayout, QWidget)

from kvscope.core import runtimes
from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.model.attention import native_attention
from kvscope.core.model.settings import attention_choices
from kvscope.core.model.spec import ModelSpec, SpecError, human_bytes, parse_size, preset_names
from kvscope.core.prediction.parallel import Parallelism
from kvscope.core.runtimes.calculator import (GPU_LAYOUTS, KV_DTYPES, WEIGHT_DTYPES, CalcInputs, context_stops,
                                              context_values, gpus_text, offered, rules_for)
from kvscope.ui.axes import format_count, format_tokens
from kvscope.ui.forms import form_box
from kvscope.workers.installed_models import FollowsInstalled

MEMORY_CHOICES = ("8 GiB  laptop GPU", "12 GiB  RTX 4070", "16 GiB  RTX 4080", "24 GiB  RTX 4090",
                  "32 GiB  RTX 5090", "48 GiB  L40S", "80 GiB  A100 / H100", "141 GiB  H200",
                  "192 GiB  B200")
#: Marks the model combo's entries that list installed models (and their separator), to refill them.
INSTALLED_ROLE = Qt.ItemDataRole.UserRole + 1
#: The sliders' names in the settings, with the attribute of each.
SLIDERS = (("batch", "batch"), ("dtype", "dtype"), ("kv_dtype", "kv_dtype"), ("attention", "attention"))


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


class CalcForm(FollowsInstalled, QWidget):
    """"Model and settings": the model picker (presets, then the installed models), the runtime and its inputs."""

    #: A model the user chose (Enter in the picker, an entry picked, a config browsed to): the tab loads it.
    source_chosen = Signal(str)
    #: An input changed; True where the chart's curve changes with it (False: the context, the GPU memory).
    changed = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec: ModelSpec | None = None  # the model the inputs are set for (its contexts, dtype, attention)
        self.context_values: list[int] = [4096]
        self._caches: dict[str, str] = {}  # the cache chosen per runtime, kept while another runtime is shown
        self.model_combo = QComboBox()
        self.model_combo.setEditable(True)
        self.model_combo.addItems(preset_names())
        self._preset_count = self.model_combo.count()
        self.model_combo.setToolTip("A preset, a model already on this machine (after the presets), a path to a "
                                    "config.json, a model folder or a .gguf file, or a Hugging Face hub id\n(org/name; "
                                    "the config alone is fetched). Press Enter to load.")
        self.model_combo.lineEdit().returnPressed.connect(lambda: self.source_chosen.emit(self.model_combo.currentText()))
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
        self.cache_combo.setToolTip("Cache strategy: dynamic grows per token; static preallocates the context; "
                                    "quantized stores 4/2-bit or fp8 codes.")
        self.memory_combo = QComboBox()
        self.memory_combo.setEditable(True)
        self.memory_combo.addItems(MEMORY_CHOICES)
        self.memory_combo.setCurrentText("24 GiB  RTX 4090")
        self.memory_combo.setToolTip("GPU memory to fit into: detected from the loaded model's device, picked, "
                                     "or typed (e.g. 24GiB, 80 GB).")
        # Tensor x pipeline parallel, as vLLM splits a model (kvscope.core.prediction.parallel): the numbers are then one GPU's.
        self.gpus_combo = QComboBox()
        for tp, pp in GPU_LAYOUTS:
            self.gpus_combo.addItem(gpus_text(tp, pp))
        self.gpus_combo.setToolTip("How many GPUs share the model: tensor parallel splits every layer's K/V heads "
                                   "(replicated past the KV-head count), pipeline parallel splits the layers.\n"
                                   "With more than one, the numbers, the chart and what fits are the busiest GPU's; "
                                   "GPU memory is per GPU.")
        # The runtimes the registry gives calculator rules (transformers' caches grow per token; another runtime's may
        # be the whole context's, allocated at load); the Cache list holds the runtime's own.
        self.runtime_combo = QComboBox()
        for name, rules in offered():
            self.runtime_combo.addItem(rules.label, name)
        self.runtime_combo.setToolTip("\n".join(rules.tip for _, rules in offered()))
        self.fill_caches()

        self.memory_combo.currentTextChanged.connect(lambda _t: self.changed.emit(False))
        self.gpus_combo.currentIndexChanged.connect(lambda _i: self._settings_changed())
        self.runtime_combo.currentIndexChanged.connect(lambda _i: self._runtime_changed())
        self.context.changed.connect(lambda: self.changed.emit(False))
        self.cache_combo.currentIndexChanged.connect(lambda _i: self._settings_changed())
        for s in (self.batch, self.dtype, self.kv_dtype, self.attention):
            s.changed.connect(self._settings_changed)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_combo, 1)
        model_row.addWidget(browse)
        box = form_box("Model and settings", [
            ("Model", model_row), ("", self.model_status), ("Runtime", self.runtime_combo), ("Context", self.context),
            ("Batch", self.batch), ("Weights", self.dtype), ("KV dtype", self.kv_dtype), ("Attention", self.attention),
            ("Cache", self.cache_combo), ("GPU memory", self.memory_combo), ("GPUs", self.gpus_combo)])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(box)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)

    # ---- the model picker

    def installed_models(self) -> list:
        return self.installed.models if self.installed is not None else []

    def _fill_installed(self) -> None:
        """The installed models after the presets (``use_installed``: FollowsInstalled), keeping the choice."""
        combo = self.model_combo
        current = self.current_source()
        text = combo.currentText()
        combo.blockSignals(True)
        try:
            for i in reversed(range(combo.count())):
                if combo.itemData(i, INSTALLED_ROLE):
                    combo.removeItem(i)
            models = self.installed_models()
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
        self.source_chosen.emit(str(self.model_combo.itemData(index) or self.model_combo.itemText(index)))

    def resolve(self, source: str) -> str:
        """A typed installed model's name or entry text ('llama3.2:1b') is that model's path."""
        for m in self.installed_models():
            if source in (m.label, m.describe()):
                return m.source
        return source

    def show_loading(self, source: str) -> None:
        """``source`` is loading: the status says so and the picker shows it."""
        self.model_status.setText(f"loading {safe_text(source, limit=NAME_LIMIT)}\u2026")
        listed = self.model_combo.findData(source)
        if listed >= 0:
            self.model_combo.setCurrentIndex(listed)
        elif self.model_combo.currentText() != source:
            self.model_combo.setCurrentText(source)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model config", "", "config (*.json);;all files (*)")
        if path:
            self.model_combo.setCurrentText(path)
            self.source_chosen.emit(path)

    def show_spec(self, spec: ModelSpec, source: str | None = None) -> None:
        """Set the inputs for ``spec``: its contexts (the nearest to the one shown), dtype, attention modes and caches,
        and a line about it; ``source``: the name the picker shows for it."""
        if source:
            if self.model_combo.findText(source) < 0:
                self.model_combo.addItem(source)
            self.model_combo.setCurrentText(source)
        self.spec = spec
        self.context_values = context_values(spec)
        current = self.context.value() if self.context.values != [None] else 4096
        current = min(self.context_values, key=lambda v: abs(v - (current or 4096)))
        self.context.set_values(self.context_values, lambda v: f"{format_tokens(v)} tokens", current,
                                stops=context_stops(spec))
        self.dtype.set_values(list(WEIGHT_DTYPES), str, spec.dtype if spec.dtype in WEIGHT_DTYPES else "bfloat16")
        self.attention.set_values(list(attention_choices(spec)), str, native_attention(spec).key)
        self.fill_caches()
        self.model_status.setText(
            f"{safe_text(spec.label, limit=NAME_LIMIT)}: {spec.num_layers} layers, {spec.num_query_heads} query / "
            f"{spec.num_kv_heads} KV heads of {spec.head_dim}, {format_count(spec.num_parameters)} parameters, "
            f"trained to {format_tokens(spec.max_position_embeddings)} tokens")

    # ---- the runtime and its inputs

    @property
    def runtime(self) -> str:
        return self.runtime_combo.currentData() or runtimes.DEFAULT

    def follow_runtime(self, source: str) -> None:
        """A model its runtime claims (a GGUF, as Ollama and LM Studio run it) shows that runtime's
        allocation, at the context its Ollama Modelfile sets (num_ctx) when it sets one."""
        model = next((m for m in self.installed_models() if m.source == source), None)
        gguf = self.spec.config.get("gguf") if isinstance(self.spec.config, dict) else None
        claimed = runtimes.claimed_by(gguf or source)
        listed = self.runtime_combo.findData(claimed) if claimed else -1
        if listed >= 0:
            self.runtime_combo.setCurrentIndex(listed)
        if model is not None and model.num_ctx:
            self.set_context(model.num_ctx)

    def fill_caches(self) -> None:
        """The Cache list of the runtime (its rules' caches; the sink and h2o sizes follow the model's context),
        and the inputs it does not read greyed, saying why."""
        rules = rules_for(self.runtime)
        keys = rules.caches(self.spec)
        cache = self.cache_combo.currentText()
        if cache not in keys:
            cache = self._caches.get(self.runtime) or rules.default_cache
        self.cache_combo.blockSignals(True)
        self.cache_combo.clear()
        self.cache_combo.addItems(keys if cache in keys else keys + [cache])
        self.cache_combo.setCurrentText(cache)
        self.cache_combo.blockSignals(False)
        for name, w in (("batch", self.batch), ("weight_dtype", self.dtype), ("kv_dtype", self.kv_dtype),
                        ("attention", self.attention), ("gpus", self.gpus_combo)):
            used = name in rules.inputs
            w.setEnabled(used)
            w.setToolTip(w.toolTip().split("\n(")[0] + ("" if used else "\n" + rules.unused_note))

    def _runtime_changed(self) -> None:
        self.fill_caches()
        self._settings_changed()

    def _settings_changed(self) -> None:
        self._caches[self.runtime] = self.cache_combo.currentText()
        self.changed.emit(True)

    def set_context(self, tokens: int) -> None:
        """Move the context slider to the value nearest ``tokens``."""
        if self.spec is None:
            return
        self.context.set_value(min(self.context_values, key=lambda v: abs(v - tokens)))

    def set_detected_memory(self, total: int | None, device_name: str) -> None:
        """Offer the memory of the device the Live tab loaded onto (selected when it is a GPU)."""
        if not total:
            return
        text = f"{human_bytes(total)}  {device_name} (detected)"
        if self.memory_combo.findText(text) < 0:
            self.memory_combo.insertItem(0, text)
        self.memory_combo.setCurrentText(text)

    # ---- what the inputs say

    def memory_bytes(self) -> int | None:
        """The GPU memory typed or picked (the leading size of the combo's text), or None if unreadable."""
        head = self.memory_combo.currentText().strip().split("  ")[0].split("(")[0].strip()
        try:
            return parse_size(head) if head else None
        except SpecError:
            return None

    def parallelism(self) -> Parallelism:
        tp, pp = GPU_LAYOUTS[max(self.gpus_combo.currentIndex(), 0)]
        return Parallelism(tensor=tp, pipeline=pp)

    def inputs(self) -> CalcInputs:
        """What the inputs say, for the model (``kvscope.core.runtimes.calculator``)."""
        parallel = self.parallelism()
        return CalcInputs(context=int(self.context.value() or 4096), runtime=self.runtime, batch=self.batch.value(),
                          weight_dtype=self.dtype.value(), kv_dtype=self.kv_dtype.value(),
                          attention=self.attention.value(), cache=self.cache_combo.currentText(),
                          memory=self.memory_bytes(), tensor=parallel.tensor, pipeline=parallel.pipeline)

    # ---- settings

    def save(self, s: QSettings) -> None:
        s.beginGroup("calculator")
        s.setValue("model", self.current_source())
        if self.spec is not None:
            s.setValue("context", int(self.context.value()))
        for name, attribute in SLIDERS:
            value = getattr(self, attribute).value()
            s.setValue(name, "" if value is None else str(value))
        s.setValue("cache", self.cache_combo.currentText())
        s.setValue("runtime", self.runtime)
        s.setValue("memory", self.memory_combo.currentText())
        s.setValue("gpus", self.gpus_combo.currentText())
        s.endGroup()

    def restore(self, s: QSettings) -> tuple[str, dict]:
        """The last model (returned, to load) and the choices that do not depend on it (applied now); the others
        are returned too, for ``apply_saved`` once the model is in."""
        s.beginGroup("calculator")
        model = str(s.value("model", "llama-3-8b") or "llama-3-8b")
        saved = {k: s.value(k) for k in ("context", "batch", "dtype", "kv_dtype", "attention", "cache", "memory", "gpus",
                                         "runtime")}
        s.endGroup()
        if saved["runtime"] and self.runtime_combo.findData(str(saved["runtime"])) >= 0:
            self.runtime_combo.setCurrentIndex(self.runtime_combo.findData(str(saved["runtime"])))
        if saved["gpus"] and self.gpus_combo.findText(str(saved["gpus"])) >= 0:
            self.gpus_combo.setCurrentText(str(saved["gpus"]))
        if saved["cache"] and self.cache_combo.findText(str(saved["cache"])) >= 0:
            self.cache_combo.setCurrentText(str(saved["cache"]))
        if saved["memory"]:
            self.memory_combo.setCurrentText(str(saved["memory"]))
        return model, saved

    def apply_saved(self, saved: dict) -> None:
        """The remembered context and sliders, on the model now shown."""
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

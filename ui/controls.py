"""The controls panel: model source, run settings (switch live), prompt, Start / Pause / Stop.

It turns what the user chose into a ``RunRequest`` (``build_request``) and shows a request's or a
running engine's settings (``apply_request``, ``show_settings``). It decides nothing about a run:
the window forwards a combo the user changed (``switch_asked``) and the buttons; the combos then
follow what the engine reports, never what was asked for.

Where the model comes from is the Source list's (``kvscope.ui.source_picker``: the installed models follow the shared
scan, ``kvscope.workers.installed_models``); the panel builds the request around it. Which runtime a request names, and
whether its switches are judged ahead, is the registry's answer (``kvscope.core.runtimes``): the panel never compares a
runtime's name.
"""

from __future__ import annotations

import dataclasses

import logging

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from kvscope.core import runtimes
from kvscope.core.base.sample import Sample
from kvscope.core.model.request import DEFAULT_PROMPT, RunForm, RunRequest
from kvscope.core.model.settings import ATTN_IMPLS, attention_choices, cache_choices
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import SpecError, human_bytes, parse_size
from kvscope.ui.forms import form_box
from kvscope.ui.key_offers import SWITCH_KEYS, KeyOffers
from kvscope.ui.source_picker import SOURCES, SourcePicker, disable_item  # noqa: F401 - SOURCES: tests import it here
from kvscope.workers.installed_models import InstalledModels, saved_folders  # noqa: F401 - saved_folders: tests

log = logging.getLogger(__name__)

#: New tokens at first start: a run long enough to watch and to press every key in (the embedded model's
#: context is 4,096 tokens); the window remembers the user's own choice after that.
FIRST_START_TOKENS = 3000
CONTROLS_MIN_W = 300
KEYS_HELP = "1\u20135 attention \u00b7 F flash \u00b7 C cache \u00b7 Space pause \u00b7 F11 presenter \u00b7 Ctrl+S screenshot"
#: The quality probe is on by default for the embedded model and for a transformers model whose weights on disk are
#: at most this (1 GiB: ~500M parameters in bf16, ~250M in float32). It runs one more decode step of the model as
#: loaded per token and keeps a second, full cache (benchmarks/quality_probe.py: ~0.5x the tokens/s on a CPU), which
#: a small model's tokens can afford; a larger model's user turns it on.
PROBE_DEFAULT_MAX_BYTES = 1 << 30


def probe_is_cheap_for(source: str, runtime: str) -> bool:
    """Whether the window turns the quality probe on by default for a run of ``source``: the embedded model, or a
    model folder (an installed model's too) whose weight files are at most ``PROBE_DEFAULT_MAX_BYTES``, under the
    transformers runtime (the probe is its own). A hub id (not on disk yet) is not."""
    if runtime != "transformers":
        return False
    if source == "embedded":
        return True
    size = _weights_bytes(source)
    return size is not None and size <= PROBE_DEFAULT_MAX_BYTES


def _weights_bytes(folder: str) -> int | None:
    """Bytes of a model folder's weight files (safetensors, .bin, .pt), or None where it holds none or cannot be read."""
    from pathlib import Path

    try:
        sizes = [f.stat().st_size for f in Path(folder).expanduser().iterdir()
                 if f.is_file() and f.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    except OSError:
        return None
    return sum(sizes) if sizes else None


def _prompt_text(text: str) -> str:
    """The prompt as typed ('' when blank): stripped, the default prompt lost its trailing space and Start
    ran 18 tokens where the first run (and the command line) ran 19."""
    return text if text.strip() else ""


def _default_attention_choices() -> tuple[str, ...]:
    try:
        return attention_choices(load_spec("embedded"))
    except SpecError:  # a damaged install: the keys still offer the plain modes
        return ("mha", "mqa")


class ControlsPanel(KeyOffers, QScrollArea):
    """The left column. ``switch_asked(key)``: the user picked another attention / kernel / cache."""

    switch_asked = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._updating = False  # True while the panel sets combos itself (not a user's choice)
        # Before a model loads: the embedded model's choices (its spec comes from its preset, no torch).
        self.attention_choices = _default_attention_choices()
        self.cache_choices = cache_choices()
        self.impl_choices = ATTN_IMPLS
        self.last_non_flash = "sdpa"
        # What a key may offer (issue 25): the loaded model's spec and device, the settings in force, the
        # switches the engine refused from a state (never proposed again from it) and the last reason a key had none.
        self.model_spec = None
        self.model_device: str | None = None
        self.runtime = runtimes.DEFAULT
        self.running: dict[str, str] = {}
        self.refusals: dict[tuple[str, str, tuple[str, str, str]], str] = {}
        self.last_problem = ""
        self.context_tokens = lambda: 0  # the run's tokens so far (the window's session tells)
        self.tokens_ahead = lambda: 0  # the tokens the run will still generate (a static cache must hold them)
        self.run_max_context: int | None = None  # what a static cache of this run preallocates (the model's info)
        self._build()

    def _build(self) -> None:
        self.source = SourcePicker(self)
        src = self.source
        src.model_changed.connect(self.use_models_own_settings)
        src.model_changed.connect(self._probe_default)
        # The Source list's widgets, by the names the window's users (tests, scripts) reach for.
        self.source_combo, self.source_stack, self.installed_combo = src.combo, src.stack, src.installed_combo
        self.folder_edit, self.hub_edit = src.folder_edit, src.hub_edit
        self.add_folder_button = src.add_folder_button

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
        self.quality_check = QCheckBox("Quality probe")
        self.quality_check.setToolTip(
            "Compare every token with the model as loaded (its own attention, a full cache, the same tokens, "
            "teacher-forced):\nhow often the next token is the same (top-1) and the KL divergence, in the strip "
            "under the KV plot,\non the attention badge and in the frontier (KV bytes per token against quality).\n"
            "Costs one more decode step of the loaded model per token (about half the tokens/s) and a second, full "
            f"cache.\nOn by default for the embedded model and models of at most {human_bytes(PROBE_DEFAULT_MAX_BYTES)} "
            "of weights; choosing another model sets it again.")
        self._probe_default()
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
        self.error_label = QLabel("")
        self.error_label.setObjectName("error")
        self.error_label.setWordWrap(True)

        model_box = form_box("Model", [("Source", self.source_combo), ("", self.source_stack),
                                       ("Device", self.device_combo), ("dtype", self.dtype_combo)])
        run_box = form_box("Settings (switch live)", [
            ("Attention", self.attention_combo), ("Kernel", self.impl_combo), ("Cache", self.cache_combo),
            ("Max context", self.max_context_spin), ("New tokens", self.max_tokens_spin),
            ("Memory budget", self.budget_edit), self.quality_check,
            self.snapshot_button])  # both columns: the panel stays narrow enough for 1280x720
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
        self.setWidget(controls)
        self.setWidgetResizable(True)
        self.setFrameShape(QScrollArea.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setMinimumWidth(CONTROLS_MIN_W)
        self.setMaximumWidth(420)
        for combo in (self.source_combo, self.device_combo, self.dtype_combo, self.attention_combo, self.impl_combo,
                      self.cache_combo):
            # Long entries ("offloaded (needs CUDA)") must not widen the panel; the popup shows them whole.
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(8)
        for key in SWITCH_KEYS:
            self.combo(key).activated.connect(lambda _i, k=key: self._activated(k))
        self.fill_choices()

    # ---- the Source list (``kvscope.ui.source_picker``) and its installed models

    @property
    def installed(self) -> InstalledModels | None:
        """The shared scan of the models on this machine (the Source list's)."""
        return self.source.installed

    def use_installed(self, installed: InstalledModels) -> None:
        self.source.use_installed(installed)

    def add_model_folder(self, folder: str) -> None:
        """Look for models in ``folder`` too (remembered); its first model is chosen once found."""
        self.source.add_model_folder(folder)

    # ---- choices

    def combo(self, key: str) -> QComboBox:
        """The combo of a switch axis (attention / attn-impl / cache)."""
        return {"attention": self.attention_combo, "attn-impl": self.impl_combo, "cache": self.cache_combo}[key]

    def set_choices(self, attention: tuple[str, ...], cache: tuple, impl: tuple[str, ...]) -> None:
        """What the loaded model (and device) can switch to; the combos are refilled."""
        self.attention_choices, self.cache_choices, self.impl_choices = attention, cache, impl
        self.fill_choices()

    def fill_choices(self) -> None:
        """Fill the attention / kernel / cache combos from the choices, keeping the current selection."""
        self._updating = True
        try:
            current = self.attention_combo.currentData()
            self.attention_combo.clear()
            self.attention_combo.addItem("as built", "")
            for key in self.attention_choices:
                self.attention_combo.addItem(key, key)
            self.select(self.attention_combo, current or "")

            current = self.impl_combo.currentData() or "sdpa"
            self.impl_combo.clear()
            for key in self._impls_listed():
                self.impl_combo.addItem(key, key)
                if key not in self.impl_choices:
                    disable_item(self.impl_combo, key, "not available here")
            self.select(self.impl_combo, current)

            current = self.cache_combo.currentData() or "dynamic"
            self.cache_combo.clear()
            for key, reason in self.cache_choices:
                self.cache_combo.addItem(key if reason is None else f"{key} ({reason})", key)
                if reason:
                    disable_item(self.cache_combo, key, reason)
            self.select(self.cache_combo, current)
            self.grey_what_cannot_run()
        finally:
            self._updating = False

    def probe_is_cheap(self) -> bool:
        """Whether the quality probe is on by default for the model chosen (``probe_is_cheap_for``)."""
        try:
            source, entry, _ = self.source.chosen()
        except SpecError:
            return False
        return entry is None and probe_is_cheap_for(source, runtimes.DEFAULT)

    def _probe_default(self) -> None:
        """Another model is chosen: the quality probe as its size sets it (``probe_is_cheap``); the user may change it."""
        if hasattr(self, "quality_check"):
            self.quality_check.setChecked(self.probe_is_cheap())

    def use_models_own_settings(self) -> None:
        """Another model is chosen: it runs as it is built (its own attention, sdpa, a dynamic cache) unless the user
        then asks otherwise (issue 37: after an MHA run of the embedded model, a 1-KV-head model picked from the
        list ran as MHA, 4x its own KV per token, without being asked)."""
        self.select(self.attention_combo, "")
        self.select(self.impl_combo, "sdpa")
        self.select(self.cache_combo, "dynamic")
        self.refusals.clear()  # learned from another model's run

    def select(self, combo: QComboBox, key: str) -> bool:
        """Show ``key`` in ``combo`` (not a user's choice: no switch follows). False if it has no such entry."""
        i = combo.findData(key)
        if i < 0:
            return False
        was, self._updating = self._updating, True
        combo.setCurrentIndex(i)
        self._updating = was
        return True

    def _activated(self, key: str) -> None:
        if not self._updating and self.combo(key).currentData():
            self.switch_asked.emit(key)

    def show_settings(self, s: Sample) -> None:
        """The combos follow the settings a sample carries (the truth, after a switch or a refusal); a
        setting the choices do not list (a size given on the command line, 'sink:4+60') is added."""
        self.runtime = s.runtime
        self.running = {"attention": s.attention, "attn-impl": s.attn_impl, "cache": s.cache}
        if s.event == "refused" and s.switch_key in SWITCH_KEYS and s.switch_after:
            # What the engine refused from these settings is not offered again from them.
            reason = s.text.split(" refused: ", 1)[-1]
            self.refusals[(s.switch_key, s.switch_after, self._state(self.running))] = reason
        for combo, key in ((self.attention_combo, s.attention), (self.impl_combo, s.attn_impl),
                           (self.cache_combo, s.cache)):
            if not self.select(combo, key) and key:
                combo.addItem(key, key)
                self.select(combo, key)
        self.grey_what_cannot_run()
        if runtimes.reloads_cache(s.runtime):  # another KV type is a reload of the runtime's context: say so
            for i in range(self.cache_combo.count()):
                key = self.cache_combo.itemData(i)
                if key and key in dict(self.cache_choices):
                    self.cache_combo.setItemText(i, f"{key} KV" if key == s.cache else f"reload with {key} KV")

    # ---- requests

    def build_request(self) -> RunRequest:
        """The RunRequest the controls describe. Raises SpecError (SettingsError) with a user message."""
        request = self._request()
        label = self.source.label()  # an installed model as its users name it, not its snapshot hash or blob digest
        return dataclasses.replace(request, label=label) if label else request

    def _request(self) -> RunRequest:
        """The request of the runtime the Source entry chosen runs (the default one for the window's own entries),
        made by that runtime from the form (``kvscope.core.runtimes.form_request``)."""
        source, entry, store_context = self.source.chosen()
        budget_text = self.budget_edit.text().strip()
        budget = None
        if budget_text and budget_text.lower() not in ("none", "off", "0"):
            try:
                budget = parse_size(budget_text)
            except SpecError as exc:
                raise SpecError(f"memory budget: {exc}") from exc
        form = RunForm(source=source, entry=entry, device=self.device_combo.currentText(),
                       dtype=self.dtype_combo.currentText(), attention=self.attention_combo.currentData() or "",
                       attn_impl=self.impl_combo.currentData() or "sdpa",
                       cache=self.cache_combo.currentData() or "dynamic",
                       max_context=self.max_context_spin.value() or None, store_context=store_context,
                       max_new_tokens=self.max_tokens_spin.value(), prompt=_prompt_text(self.prompt_edit.toPlainText()),
                       memory_budget=budget, quality_probe=self.quality_check.isChecked())
        return runtimes.form_request(runtimes.entry_runtime(entry) or runtimes.DEFAULT, form)

    def apply_request(self, request: RunRequest) -> None:
        """Show a RunRequest's choices in the controls (from the command line)."""
        self.source.show(request)
        self.device_combo.setCurrentText(request.device)
        if self.dtype_combo.findText(request.dtype) < 0:
            self.dtype_combo.addItem(request.dtype)
        self.dtype_combo.setCurrentText(request.dtype)
        s = request.settings
        self.select(self.attention_combo, s.attention.key if s.attention else "")
        self.select(self.impl_combo, s.attn_impl)
        if not self.select(self.cache_combo, s.cache.key):
            self.cache_combo.addItem(s.cache.key, s.cache.key)
            self.select(self.cache_combo, s.cache.key)
        self.max_context_spin.setValue(s.max_context or 0)
        self.max_tokens_spin.setValue(request.max_new_tokens)
        self.quality_check.setChecked(bool(request.quality_probe))
        self.prompt_edit.setPlainText(request.prompt)
        self.budget_edit.setText(human_bytes(request.memory_budget).replace(" ", "")
                                 if request.memory_budget else "")

    # ---- state

    def show_state(self, state: str, can_start: bool, cuda: bool) -> None:
        """Enable what the run state allows: settings that need a new load are locked while a run is on."""
        running = state in ("loading", "running", "paused", "stopping")
        self.start_button.setEnabled(not running and can_start)
        self.pause_button.setEnabled(state in ("running", "paused"))
        self.pause_button.setText("Resume" if state == "paused" else "Pause")
        self.stop_button.setEnabled(running and state != "stopping")
        self.snapshot_button.setEnabled(not running and cuda)
        self.snapshot_button.setToolTip(
            "Record the CUDA allocator's history (every allocation with its Python stack) for the whole next run\n"
            "and save it as a .pickle that https://pytorch.org/memory_viz opens."
            if cuda else
            "Allocator snapshots record the CUDA caching allocator: this machine has no CUDA GPU torch can use.")
        self.source.set_enabled(not running)
        for w in (self.device_combo, self.dtype_combo, self.max_context_spin, self.max_tokens_spin, self.prompt_edit,
                  self.budget_edit, self.quality_check):
            w.setEnabled(not running)

    # ---- settings (QSettings group "run")

    def restore(self, s: QSettings) -> None:
        s.beginGroup("run")
        try:
            self.source.restore(s)
            for combo, key in ((self.device_combo, "device"), (self.dtype_combo, "dtype")):
                value = s.value(key)
                if value and combo.findText(str(value)) >= 0:
                    combo.setCurrentText(str(value))
            for key, name in zip(SWITCH_KEYS, ("attention", "attn_impl", "cache")):
                value = s.value(name)
                if value is not None:
                    self.select(self.combo(key), str(value))
            try:
                self.max_context_spin.setValue(int(s.value("max_context", 0) or 0))
                self.max_tokens_spin.setValue(int(s.value("max_new_tokens", FIRST_START_TOKENS) or FIRST_START_TOKENS))
            except (TypeError, ValueError):
                pass
            self.prompt_edit.setPlainText(str(s.value("prompt") or DEFAULT_PROMPT))
        finally:
            s.endGroup()
        self.use_installed(InstalledModels.for_settings(s))
        self.source._fill_installed()  # the model saved, listed before the scan is back
        self.installed.refresh()

    def save(self, s: QSettings) -> None:
        s.beginGroup("run")
        self.source.save(s)
        s.setValue("device", self.device_combo.currentText())
        s.setValue("dtype", self.dtype_combo.currentText())
        s.setValue("attention", self.attention_combo.currentData() or "")
        s.setValue("attn_impl", self.impl_combo.currentData() or "sdpa")
        s.setValue("cache", self.cache_combo.currentData() or "dynamic")
        s.setValue("max_context", self.max_context_spin.value())
        s.setValue("max_new_tokens", self.max_tokens_spin.value())
        s.setValue("prompt", self.prompt_edit.toPlainText())
        s.endGroup()

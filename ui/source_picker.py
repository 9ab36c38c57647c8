"""The Source list of the controls: which model a run loads, and from where (the embedded model, an installed one,
a folder, a hub id, a GGUF for llama.cpp, MLX's embedded model), with the installed-model list that follows the
shared scan (``kvscope.workers.installed_models``).

It answers ``chosen()``: the model source and the Source entry of a runtime of its own (``llamacpp``, ``mlx``) that
runs it, if any; the controls build the request. Which runtime a request names is the registry's answer
(``kvscope.core.runtimes.source_entry``).
"""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QHBoxLayout, QLineEdit, QPushButton, QStackedWidget, QToolButton,
                               QWidget)

from kvscope.core import runtimes
from kvscope.core.base.safe_text import safe_text
from kvscope.core.model.gguf import is_gguf_source
from kvscope.core.model.request import RunRequest
from kvscope.core.model.spec import SpecError
from kvscope.core.runtimes.llamacpp.switches import llamacpp_missing
from kvscope.core.runtimes.mlx.switches import mlx_missing
from kvscope.workers.installed_models import FollowsInstalled, InstalledModels

SOURCES = ("embedded", "installed", "folder", "hub", "llamacpp", "mlx")
#: The installed-model list's tooltip (the entries the scan skipped follow it, one line each).
INSTALLED_TIP = "The models found on this machine: name \u00b7 where \u00b7 size"


def disable_item(combo: QComboBox, key: str, reason: str) -> None:
    """Grey out ``combo``'s entry ``key``, with ``reason`` as its tooltip."""
    item = combo.model().item(combo.findData(key))
    if item is not None:
        item.setEnabled(False)
        item.setToolTip(reason)


def _with_browse(edit: QLineEdit, tooltip: str, browse) -> QWidget:
    """A path field and its "…" button (which calls ``browse``), in one row."""
    button = QPushButton("\u2026")
    button.setToolTip(tooltip)
    button.clicked.connect(browse)
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(edit, 1)
    layout.addWidget(button)
    return row


class SourcePicker(FollowsInstalled, QObject):
    """The Source combo (``combo``) and, under it, the field of the entry chosen (``stack``); the panel places both.
    ``parent_widget``: the dialogs' parent."""

    #: Another model is chosen: the controls put its own attention, kernel and cache back (it runs as built).
    model_changed = Signal()

    def __init__(self, parent_widget: QWidget) -> None:
        super().__init__(parent_widget)
        self.parent_widget = parent_widget
        self.installed: InstalledModels | None = None  # bound to the window's settings in restore()
        self.combo = QComboBox()
        self.combo.addItem("Embedded demo model", "embedded")
        self.combo.addItem("Installed model", "installed")
        self.combo.addItem("Local folder", "folder")
        self.combo.addItem("Hugging Face hub id", "hub")
        self.combo.addItem("llama.cpp (GGUF)", "llamacpp")
        self.combo.addItem("MLX (mlx-lm)", "mlx")  # the embedded model in MLX; installed MLX folders too
        self.combo.setToolTip("Embedded: a tiny Llama-shaped model built offline, always available.\n"
                                     "Installed model: one already on this machine (the Hugging Face cache, Ollama, "
                                     "LM Studio, folders you add).\nLocal folder: a saved transformers model, or a "
                                     ".gguf file.\nHub id: org/name, downloaded (or from the local Hugging Face cache).\n"
                                     "llama.cpp: the embedded model as a GGUF, or a .gguf file, in the real llama.cpp "
                                     "(its KV cache is reserved whole at load).")
        self._installed_wanted = ""  # the installed model to show once the scan has listed it
        self.installed_combo = QComboBox()
        self.installed_combo.setToolTip(INSTALLED_TIP)
        self.installed_combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.installed_combo.setMinimumContentsLength(8)
        self.installed_combo.activated.connect(self._installed_chosen)
        # A narrow button: the panel is 300 px at 720p and the model's name needs the room.
        self.add_folder_button = QToolButton()
        self.add_folder_button.setText("+")
        self.add_folder_button.setToolTip("Add folder\u2026: look for models (GGUF files, transformers model folders) "
                                          "in a folder of yours too (remembered)")
        self.add_folder_button.clicked.connect(self._ask_folder)
        installed_row = QWidget()
        ir = QHBoxLayout(installed_row)
        ir.setContentsMargins(0, 0, 0, 0)
        ir.addWidget(self.installed_combo, 1)
        ir.addWidget(self.add_folder_button)
        self.folder_edit = QLineEdit()
        self.folder_edit.setPlaceholderText("/path/to/model folder")
        folder_row = _with_browse(self.folder_edit, "Choose a model folder", self._browse_folder)
        self.hub_edit = QLineEdit()
        self.hub_edit.setPlaceholderText("org/name, e.g. HuggingFaceTB/SmolLM2-135M")
        self.gguf_edit = QLineEdit()
        self.gguf_edit.setPlaceholderText("embedded model \u00b7 or /path/to/model.gguf")
        gguf_row = _with_browse(self.gguf_edit, "Choose a .gguf file", self._browse_gguf)
        self.stack = QStackedWidget()
        self.stack.addWidget(QWidget())
        self.stack.addWidget(installed_row)
        self.stack.addWidget(folder_row)
        self.stack.addWidget(self.hub_edit)
        self.stack.addWidget(gguf_row)
        self.stack.addWidget(QWidget())  # MLX: the embedded model (an installed MLX folder: "Installed model")
        #: The Source entries with a file field of their own: a request of their runtime shows its model there.
        self._entry_files = {"llamacpp": self.gguf_edit}
        #: Why the llama.cpp source cannot be chosen (llama-cpp-python missing), or None.
        self.llamacpp_missing = llamacpp_missing()
        if self.llamacpp_missing:
            disable_item(self.combo, "llamacpp", self.llamacpp_missing)
        #: Why the MLX source cannot be chosen (mlx / mlx-lm missing), or None.
        self.mlx_missing = mlx_missing()
        if self.mlx_missing:
            disable_item(self.combo, "mlx", self.mlx_missing)
        self._last_model: tuple[str, str] = self._model_key()
        self.combo.currentIndexChanged.connect(self._note_choice)
        for edit in (self.folder_edit, self.hub_edit, self.gguf_edit):
            edit.textChanged.connect(self._note_choice)
        self.combo.currentIndexChanged.connect(self.stack.setCurrentIndex)
        self.combo.currentIndexChanged.connect(lambda i: self.stack.setVisible(i != 0))
        self.stack.setFixedHeight(self.hub_edit.sizeHint().height())

        self._fill_installed()

    def _model_key(self) -> tuple[str, str]:
        kind = self.kind()
        field = {"installed": lambda: self.installed_combo.currentData() or self._installed_wanted,
                 "folder": self.folder_edit.text, "hub": self.hub_edit.text, "llamacpp": self.gguf_edit.text}.get(kind)
        return kind, str(field() or "") if field is not None else ""

    def _note_choice(self, *_: object) -> None:
        """Say ``model_changed`` when the model chosen is another one (by the user, a restore or the command line)."""
        key = self._model_key()
        if key != self._last_model:
            self._last_model = key
            self.model_changed.emit()

    def label(self) -> str | None:
        """What the user calls the model chosen, where its source's own name says less: an installed model's label
        (the repo id of a Hugging Face cache snapshot, named by its hash; the Ollama tag of a blob, named by its
        digest). None for the other entries (their folder or file name is the user's own)."""
        if self.kind() != "installed":
            return None
        model = self._installed_model(self.installed_combo.currentData() or "")
        return model.label if model is not None else None

    def kind(self) -> str:
        """The Source entry chosen (one of ``SOURCES``)."""
        return self.combo.currentData() or "embedded"

    def chosen(self) -> tuple[str, str | None, int | None]:
        """(the model source, the Source entry of the runtime that runs it where it is not the default one, the
        context its store sets: Ollama's num_ctx). Raises SpecError with what is missing."""
        kind = self.kind()
        if kind == "llamacpp":
            return self.gguf_edit.text().strip() or "embedded", kind, None
        if kind in ("mlx", "embedded"):
            return "embedded", (kind if kind != "embedded" else None), None
        if kind == "installed":
            source = self.installed_combo.currentData() or ""
            if not source:
                raise SpecError("pick an installed model (or add a folder that holds models)")
            model = self._installed_model(source)
            found = model.kind if model is not None else ("gguf" if is_gguf_source(source) else "hf")  # before the scan
            # A GGUF (Ollama's, LM Studio's...) runs where it was made to run: llama.cpp, with the context Ollama's
            # Modelfile sets (num_ctx) unless Max context says otherwise; an MLX conversion runs in MLX.
            entry = {"gguf": "llamacpp", "mlx": "mlx"}.get(found)
            return source, entry, (model.num_ctx if model is not None and entry else None)
        if kind == "folder":
            source = self.folder_edit.text().strip()
            if not source:
                raise SpecError("choose a model folder (or pick the embedded demo model)")
            return source, None, None
        source = self.hub_edit.text().strip()
        if source.count("/") != 1:
            raise SpecError("a hub id looks like org/name")
        return source, None, None

    def _installed_model(self, source: str):
        """The scan's InstalledModel for ``source`` (None when the scan has not listed it)."""
        models = self.installed.models if self.installed is not None else []
        return next((m for m in models if m.source == source), None)

    def _runtime_entry(self, request: RunRequest) -> str | None:
        """The Source list entry of the request's runtime where it has one of its own (the registry's
        ``source_entry``) and that entry can show the request: one with a file field takes any model; one without
        (MLX's) only the embedded model, and only where the runtime is installed."""
        entry = runtimes.source_entry(request.runtime)
        if entry not in SOURCES:
            return None
        if entry in self._entry_files:
            return entry
        item = self.combo.model().item(SOURCES.index(entry))
        return entry if request.source == "embedded" and item is not None and item.isEnabled() else None

    def show(self, request: RunRequest) -> None:
        """Show where a RunRequest's model comes from (from the command line)."""
        entry = self._runtime_entry(request)
        if entry is not None:
            self.combo.setCurrentIndex(SOURCES.index(entry))
            if entry in self._entry_files:
                self._entry_files[entry].setText("" if request.source == "embedded" else request.source)
        elif request.source == "embedded":
            self.combo.setCurrentIndex(SOURCES.index("embedded"))
        elif self.installed_combo.findData(request.source) >= 0:
            self.combo.setCurrentIndex(SOURCES.index("installed"))
            self.installed_combo.setCurrentIndex(self.installed_combo.findData(request.source))
            self._installed_wanted = request.source
        elif Path(request.source).expanduser().exists():
            self.combo.setCurrentIndex(SOURCES.index("folder"))
            self.folder_edit.setText(request.source)
        else:
            self.combo.setCurrentIndex(SOURCES.index("hub"))
            self.hub_edit.setText(request.source)

    def set_enabled(self, on: bool) -> None:
        self.combo.setEnabled(on)
        self.stack.setEnabled(on)

    # ---- installed models (use_installed: FollowsInstalled)

    def _installed_chosen(self, _index: int) -> None:
        self._installed_wanted = self.installed_combo.currentData() or ""
        self._note_choice()

    def _fill_installed(self) -> None:
        """Refill the installed-model combo from the scan, keeping the model chosen (if it is still there)."""
        combo = self.installed_combo
        wanted = self._installed_wanted or combo.currentData() or ""
        models = self.installed.models if self.installed is not None else []
        combo.blockSignals(True)
        try:
            combo.clear()
            for m in models:
                combo.addItem(m.describe(), m.source)
                kind = {"gguf": "GGUF file", "mlx": "MLX model folder"}.get(m.kind, "transformers model folder")
                combo.setItemData(combo.count() - 1, f"{m.describe()}\n{kind}: {safe_text(m.source)}",
                                  Qt.ItemDataRole.ToolTipRole)
            if wanted and combo.findData(wanted) < 0 and Path(wanted).exists():
                combo.addItem(Path(wanted).name, wanted)  # chosen before; the scan has not (yet) listed it
                combo.setItemData(combo.count() - 1, wanted, Qt.ItemDataRole.ToolTipRole)
            if combo.count() == 0:
                busy = self.installed is None or not self.installed.scanned
                combo.addItem("Looking for models\u2026" if busy else "None found: add a folder", None)
                combo.model().item(0).setEnabled(False)
            i = combo.findData(wanted) if wanted else -1
            combo.setCurrentIndex(max(i, 0))
            notes = self.installed.notes if self.installed is not None else []
            skipped = (f"\n\nSkipped ({len(notes)}):\n" + "\n".join(notes[:12]) + ("\n\u2026" if len(notes) > 12 else "")
                       if notes else "")
            combo.setToolTip(INSTALLED_TIP + skipped)
        finally:
            combo.blockSignals(False)

    def _ask_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self.parent_widget, "A folder with models", str(Path.home()))
        if folder:
            self.add_model_folder(folder)

    def add_model_folder(self, folder: str) -> None:
        """Look for models in ``folder`` too (remembered); its first model is chosen once found."""
        if self.installed is None:
            self.use_installed(InstalledModels(parent=self.parent_widget))
        self._after_scan_choose = str(folder)
        self.installed.changed.connect(self._choose_in_added_folder, Qt.ConnectionType.UniqueConnection)
        self.installed.add_folder(folder)

    def _choose_in_added_folder(self) -> None:
        if self.installed is None or not self.installed.scanned or self.installed.busy:
            return
        self.installed.changed.disconnect(self._choose_in_added_folder)
        root = os.path.realpath(self._after_scan_choose)
        for i in range(self.installed_combo.count()):
            source = self.installed_combo.itemData(i)
            real = os.path.realpath(source) if source else ""
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                self.installed_combo.setCurrentIndex(i)
                self._installed_wanted = source
                self._note_choice()
                break

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.parent_widget, "GGUF model", self.gguf_edit.text() or str(Path.home()),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.gguf_edit.setText(path)

    def _browse_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self.parent_widget, "Model folder", self.folder_edit.text() or str(Path.home()))
        if folder:
            self.folder_edit.setText(folder)

    # ---- settings (in the QSettings group "run", which the panel has begun)

    def restore(self, s) -> None:
        kind = str(s.value("source_kind", "embedded"))
        kind = "embedded" if kind == "llamacpp" and self.llamacpp_missing else kind
        self.combo.setCurrentIndex(SOURCES.index(kind) if kind in SOURCES else 0)
        self.stack.setVisible(self.combo.currentIndex() != 0)
        self.folder_edit.setText(str(s.value("folder", "") or ""))
        self.hub_edit.setText(str(s.value("hub_id", "") or ""))
        self.gguf_edit.setText(str(s.value("gguf", "") or ""))
        self._installed_wanted = str(s.value("installed", "") or "")

    def save(self, s) -> None:
        s.setValue("source_kind", self.combo.currentData())
        s.setValue("folder", self.folder_edit.text())
        s.setValue("hub_id", self.hub_edit.text())
        s.setValue("gguf", self.gguf_edit.text())
        s.setValue("installed", self.installed_combo.currentData() or self._installed_wanted or "")

"""The Source list of the controls: which model a run loads, and from where (the embedded model, an installed one,
a folder, a hub id, and each runtime's own entries), with the installed-model list that follows the shared scan
(``kvscope.workers.installed_models``).

The window's own entries are ``BASE_SOURCES``; a runtime brings its own through the registry
(``kvscope.core.runtimes.source_entries``: a ``SourceEntry`` each, with a file field where it takes a file of its own),
greyed with the reason where the runtime is not installed. It answers ``chosen()``: the model source and the Source
entry of a runtime of its own that runs it, if any; the controls build the request (``runtimes.form_request``).
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
from kvscope.workers.installed_models import FollowsInstalled, InstalledModels

#: The window's own Source entries (the default runtime runs them).
BASE_SOURCES = ("embedded", "installed", "folder", "hub")
#: Every entry at import: the window's own, then the runtimes' (``SourcePicker.sources``: those of its own time).
SOURCES = BASE_SOURCES + tuple(entry.key for _, entry in runtimes.source_entries())
_BASE_TIP = ("Embedded: a tiny Llama-shaped model built offline, always available.\nInstalled model: one already on this "
             "machine (the Hugging Face cache, Ollama, LM Studio, folders you add).\nLocal folder: a saved transformers "
             "model, or a .gguf file.\nHub id: org/name, downloaded (or from the local Hugging Face cache).")
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
        #: The runtimes' own entries, by key: (runtime, SourceEntry).
        self.entries = {entry.key: (name, entry) for name, entry in runtimes.source_entries()}
        self.sources = BASE_SOURCES + tuple(self.entries)
        for label, key in (("Embedded demo model", "embedded"), ("Installed model", "installed"),
                           ("Local folder", "folder"), ("Hugging Face hub id", "hub")):
            self.combo.addItem(label, key)
        for key, (_, entry) in self.entries.items():
            self.combo.addItem(entry.label, key)
        self.combo.setToolTip("\n".join([_BASE_TIP] + [e.tooltip for _, e in self.entries.values() if e.tooltip]))
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
        self.stack = QStackedWidget()
        self.stack.addWidget(QWidget())
        self.stack.addWidget(installed_row)
        self.stack.addWidget(folder_row)
        self.stack.addWidget(self.hub_edit)
        #: The Source entries with a file field of their own: a request of their runtime shows its model there.
        self._entry_files: dict[str, QLineEdit] = {}
        #: Why each runtime entry cannot be chosen (its runtime not installed), or None.
        self.missing: dict[str, str | None] = {}
        for key, (name, entry) in self.entries.items():
            self.stack.addWidget(self._entry_field(key, entry))
            self.missing[key] = runtimes.missing(name)
            if self.missing[key]:
                disable_item(self.combo, key, self.missing[key])
        self._last_model: tuple[str, str] = self._model_key()
        self.combo.currentIndexChanged.connect(self._note_choice)
        for edit in (self.folder_edit, self.hub_edit, *self._entry_files.values()):
            edit.textChanged.connect(self._note_choice)
        self.combo.currentIndexChanged.connect(self.stack.setCurrentIndex)
        self.combo.currentIndexChanged.connect(lambda i: self.stack.setVisible(i != 0))
        self.stack.setFixedHeight(self.hub_edit.sizeHint().height())

        self._fill_installed()

    def _entry_field(self, key: str, entry) -> QWidget:
        """The field under a runtime's entry: a path and its browse button where it takes a file, else nothing."""
        if not entry.file_field:
            return QWidget()
        edit = QLineEdit()
        edit.setPlaceholderText(entry.placeholder)
        self._entry_files[key] = edit

        def browse() -> None:
            path, _ = QFileDialog.getOpenFileName(self.parent_widget, entry.label, edit.text() or str(Path.home()),
                                                  entry.file_filter)
            if path:
                edit.setText(path)
        return _with_browse(edit, f"Choose a file ({entry.label})", browse)

    def _saved_as(self, key: str) -> str:
        """The settings key of the runtime entry ``key``'s file field."""
        return self.entries[key][1].saved_as or f"file_{key}"

    def file_edit(self, key: str) -> QLineEdit | None:
        """The file field of the runtime entry ``key`` (None: it has none)."""
        return self._entry_files.get(key)

    def _model_key(self) -> tuple[str, str]:
        kind = self.kind()
        edit = self._entry_files.get(kind)
        field = {"installed": lambda: self.installed_combo.currentData() or self._installed_wanted,
                 "folder": self.folder_edit.text, "hub": self.hub_edit.text,
                 **({kind: edit.text} if edit is not None else {})}.get(kind)
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
        """The Source entry chosen (one of ``sources``)."""
        return self.combo.currentData() or "embedded"

    def chosen(self) -> tuple[str, str | None, int | None]:
        """(the model source, the Source entry of the runtime that runs it where it is not the default one, the
        context its store sets: Ollama's num_ctx). Raises SpecError with what is missing."""
        kind = self.kind()
        if kind in self.entries:  # a runtime's own entry: its file, else the embedded model
            edit = self._entry_files.get(kind)
            return (edit.text().strip() if edit is not None else "") or "embedded", kind, None
        if kind == "embedded":
            return "embedded", None, None
        if kind == "installed":
            source = self.installed_combo.currentData() or ""
            if not source:
                raise SpecError("pick an installed model (or add a folder that holds models)")
            model = self._installed_model(source)
            found = model.kind if model is not None else ("gguf" if is_gguf_source(source) else "hf")  # before the scan
            # A model runs where it was made to run (a GGUF of Ollama's or LM Studio's: the runtime whose entry runs
            # that kind), with the context its store sets (Ollama's num_ctx) unless Max context says otherwise.
            own = runtimes.runs_kind(found)
            entry = own.key if own is not None else None
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
        ``source_entries``) and that entry can show the request: one with a file field takes any model; one without
        only the embedded model, and only where the runtime is installed."""
        for key, (name, entry) in self.entries.items():
            if name != request.runtime:
                continue
            if entry.file_field:
                return key
            if request.source == "embedded" and not self.missing.get(key):
                return key
        return None

    def show(self, request: RunRequest) -> None:
        """Show where a RunRequest's model comes from (from the command line)."""
        entry = self._runtime_entry(request)
        if entry is not None:
            self.combo.setCurrentIndex(self.sources.index(entry))
            if entry in self._entry_files:
                self._entry_files[entry].setText("" if request.source == "embedded" else request.source)
        elif request.source == "embedded":
            self.combo.setCurrentIndex(self.sources.index("embedded"))
        elif self.installed_combo.findData(request.source) >= 0:
            self.combo.setCurrentIndex(self.sources.index("installed"))
            self.installed_combo.setCurrentIndex(self.installed_combo.findData(request.source))
            self._installed_wanted = request.source
        elif Path(request.source).expanduser().exists():
            self.combo.setCurrentIndex(self.sources.index("folder"))
            self.folder_edit.setText(request.source)
        else:
            self.combo.setCurrentIndex(self.sources.index("hub"))
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
        kinds = {kind: word for _, entry in self.entries.values() for kind, word in entry.kind_labels}
        combo.blockSignals(True)
        try:
            combo.clear()
            for m in models:
                combo.addItem(m.describe(), m.source)
                kind = kinds.get(m.kind, "transformers model folder")
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

    def _browse_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self.parent_widget, "Model folder", self.folder_edit.text() or str(Path.home()))
        if folder:
            self.folder_edit.setText(folder)

    # ---- settings (in the QSettings group "run", which the panel has begun)

    def restore(self, s) -> None:
        kind = str(s.value("source_kind", "embedded"))
        kind = "embedded" if self.missing.get(kind) else kind  # its runtime is not installed (any more)
        self.combo.setCurrentIndex(self.sources.index(kind) if kind in self.sources else 0)
        self.stack.setVisible(self.combo.currentIndex() != 0)
        self.folder_edit.setText(str(s.value("folder", "") or ""))
        self.hub_edit.setText(str(s.value("hub_id", "") or ""))
        for key, edit in self._entry_files.items():
            edit.setText(str(s.value(self._saved_as(key), "") or ""))
        self._installed_wanted = str(s.value("installed", "") or "")

    def save(self, s) -> None:
        s.setValue("source_kind", self.combo.currentData())
        s.setValue("folder", self.folder_edit.text())
        s.setValue("hub_id", self.hub_edit.text())
        for key, edit in self._entry_files.items():
            s.setValue(self._saved_as(key), edit.text())
        s.setValue("installed", self.installed_combo.currentData() or self._installed_wanted or "")

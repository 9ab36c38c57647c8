"""The models already on this machine, looked for off the GUI thread: ``InstalledModels`` (one per settings
file, shared by the window's Source list and the calculator's picker) and the scan's daemon thread.

``kvscope.core.model.installed.scan_installed`` does the looking; this module only runs it away from the GUI thread, cancels a
look that a newer one replaces, and delivers ``changed`` on the GUI thread. ``IMPORT_LOCK`` (``kvscope.workers.imports``)
keeps its huggingface_hub import apart from the calculator's transformers import.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from PySide6.QtCore import QObject, QSettings, Signal

from kvscope.core.model.installed import ORIGINS, InstalledModel, scan_installed
from kvscope.workers.imports import IMPORT_LOCK

log = logging.getLogger(__name__)

#: The QSettings key (top level: the calculator reads it too) of the folders the user added to look for models in.
FOLDERS_KEY = "model_folders"


def saved_folders(s: QSettings) -> list[str]:
    """The model folders the user added (QSettings ``model_folders``), whatever form the file holds them in."""
    value = s.value(FOLDERS_KEY, [])
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, (list, tuple)):
        return []
    return list(dict.fromkeys(str(v) for v in value if v))


class _ScanJob:
    """``scan_installed`` off the GUI thread: the stores that need no import first, then all of them.

    It runs on a daemon thread of its own, not a QThreadPool's: a pool waits for its threads when it is
    destroyed, and the window must never wait on a store (the scan is bounded and cancellable anyway)."""

    def __init__(self, serial: int, home: Path, folders: tuple[str, ...], found) -> None:
        self.serial, self.home, self.folders, self.found = serial, home, folders, found
        self.cancel = threading.Event()

    def run(self) -> None:
        scan = None
        try:
            quick = [o for o in ORIGINS if o != "hf-cache"]
            self._emit(scan_installed(self.home, self.folders, origins=quick, cancelled=self.cancel.is_set), False)
            # huggingface_hub's constants say where its cache is: imported by one pool thread at a time.
            while not IMPORT_LOCK.acquire(timeout=0.1):
                if self.cancel.is_set():
                    return
            try:
                import huggingface_hub.constants  # noqa: F401
            finally:
                IMPORT_LOCK.release()
            scan = scan_installed(self.home, self.folders, cancelled=self.cancel.is_set)
        except Exception:  # scan_installed never raises; a dead scan must still say it ended
            log.exception("looking for installed models")
        if not self.cancel.is_set():
            self._emit(scan, True)

    def _emit(self, scan, complete: bool) -> None:
        try:
            self.found.emit(self.serial, scan, complete)
        except RuntimeError:  # its window has closed meanwhile
            pass


class InstalledModels(QObject):
    """The models already on this machine (``kvscope.core.model.installed.scan_installed``), looked for off the GUI thread.

    ``for_settings(s)`` gives the one of a settings file: the window's Source list and the calculator's
    picker share it, so a folder added in one is listed in both. ``changed``: ``models`` (and ``notes``, one
    line per entry the scan skipped) is new."""

    changed = Signal()
    _found = Signal(int, object, bool)  # scan serial, InstalledScan (None: failed), whether complete

    NAME = "kvscope-installed-models"

    def __init__(self, settings: QSettings | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent if parent is not None else settings)
        self.setObjectName(self.NAME)
        self.settings = settings
        self.folders: tuple[str, ...] = tuple(saved_folders(settings)) if settings is not None else ()
        self.models: list[InstalledModel] = []
        self.notes: list[str] = []
        self.scanned = False  # a complete scan has come back
        self._serial = 0
        self._done = 0
        self._key: tuple | None = None
        self._job: _ScanJob | None = None
        self._thread: threading.Thread | None = None
        self._found.connect(self._on_found)

    @classmethod
    def for_settings(cls, s: QSettings) -> "InstalledModels":
        found = s.findChild(QObject, cls.NAME)
        return found if isinstance(found, cls) else cls(s)

    @property
    def busy(self) -> bool:
        """A scan is under way."""
        return self._done != self._serial

    def refresh(self) -> None:
        """Look again (off the GUI thread); the same look already under way is not started twice."""
        home = Path.home()
        key = (self.folders, str(home), os.environ.get("OLLAMA_MODELS"), os.environ.get("HF_HUB_CACHE"),
               os.environ.get("HF_HOME"))
        if self.busy and key == self._key:
            return
        if self._job is not None:
            self._job.cancel.set()  # a newer look replaces it
        self._serial += 1
        self._key = key
        self._job = _ScanJob(self._serial, home, self.folders, self._found)
        self._thread = threading.Thread(target=self._job.run, name="kvscope-installed-models", daemon=True)
        self._thread.start()

    def add_folder(self, folder: str) -> None:
        """Look in ``folder`` too, from now on (saved in the settings) and at once."""
        folder = str(folder)
        if folder not in self.folders:
            self.folders = (*self.folders, folder)
            if self.settings is not None:
                self.settings.setValue(FOLDERS_KEY, list(self.folders))
        self.refresh()

    def wait(self, timeout_ms: int = 3000) -> bool:
        """Stop a scan in flight, for the window's shutdown: it ends at its next entry (milliseconds); its
        daemon thread is waited for ``timeout_ms`` at most, and never holds the process after that."""
        if self._job is not None:
            self._job.cancel.set()
        if self._thread is not None:
            self._thread.join(max(timeout_ms, 0) / 1000)
            return not self._thread.is_alive()
        return True

    def _on_found(self, serial: int, scan, complete: bool) -> None:
        if serial != self._serial:
            return  # a newer look was asked for meanwhile
        if scan is not None:
            self.models = list(scan.models)
            self.notes = list(scan.notes)
        if complete:
            self._done = serial
            self.scanned = True
        self.changed.emit()


class FollowsInstalled:
    """A widget listing the installed models (the Source list, the calculator's picker): ``use_installed`` makes it
    follow one shared ``InstalledModels`` scan; the widget has ``installed`` and refills in ``_fill_installed``."""

    installed: InstalledModels | None = None

    def use_installed(self, installed: InstalledModels) -> None:
        """List ``installed``'s models (and follow it as it finds more)."""
        if self.installed is installed:
            return
        if self.installed is not None:
            self.installed.changed.disconnect(self._fill_installed)
        self.installed = installed
        installed.changed.connect(self._fill_installed)
        self._fill_installed()

    def _fill_installed(self) -> None:
        raise NotImplementedError

"""Model descriptions (``kvscope.core.model.sources.load_spec``) loaded off the GUI thread, for the Calculator tab.

A spec load can take seconds (transformers' first import, a hub config fetch); one pool thread does them in
order, the first being the warm-up that imports transformers under ``kvscope.workers.imports.IMPORT_LOCK`` (the window
starts a thread-mode run only after it). Only the newest request's answer is delivered; specs are memoised
by source.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

from kvscope.core.base.longlived import freeze_long_lived
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import ModelSpec, SpecError
from kvscope.workers.imports import IMPORT_LOCK

log = logging.getLogger(__name__)


class _Signals(QObject):
    done = Signal(int, object, str)  # request id, ModelSpec or None, error message
    warmed = Signal()


class _WarmJob(QRunnable):
    """Imports transformers once, before anything else may import it from another thread."""

    def __init__(self, signals: _Signals) -> None:
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

    def __init__(self, request_id: int, source: str, signals: _Signals) -> None:
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


class SpecLoader(QObject):
    """``load(source)`` in the background: ``loaded(source, spec)`` or ``failed(message)``, for the newest request
    only. ``warm_up()`` imports transformers first; ``warmed`` says it is done (``warm`` stays True after)."""

    loaded = Signal(str, object)  # source, ModelSpec
    failed = Signal(str)  # the user's one line
    warmed = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(1)
        self._signals = _Signals()
        self._signals.done.connect(self._done)
        self._signals.warmed.connect(self._on_warmed)
        self.warm = False
        self._warming = False
        self._request_id = 0
        self._pending = ""
        self.specs: dict[str, ModelSpec] = {}  # memoised by source

    def warm_up(self) -> None:
        """Import transformers in the pool thread (first job; spec loads queue behind it)."""
        if not self.warm and not self._warming:
            self._warming = True
            self.pool.start(_WarmJob(self._signals))

    def load(self, source: str) -> None:
        """Load ``source``'s spec (memoised: a known one is delivered at once)."""
        if source in self.specs:
            self._request_id += 1  # an answer still on its way is older: dropped
            self.loaded.emit(source, self.specs[source])
            return
        self.warm_up()
        self._request_id += 1
        self._pending = source
        self.pool.start(_SpecJob(self._request_id, source, self._signals))

    def wait(self, timeout_ms: int = 3000) -> bool:
        """Wait for a load in flight (no pool thread may outlive the window)."""
        return self.pool.waitForDone(timeout_ms)

    def _done(self, request_id: int, spec: ModelSpec | None, error: str) -> None:
        if request_id != self._request_id:
            return  # a newer model was asked for meanwhile
        if spec is None:
            self.failed.emit(error)
            return
        self.specs[self._pending] = spec
        self.loaded.emit(self._pending, spec)

    def _on_warmed(self) -> None:
        self.warm = True
        self.warmed.emit()

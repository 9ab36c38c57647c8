"""The generation worker: drives core.generate on a QThread; commands in, Sample batches out.

Shape from superqt's ``_qthreading``: a parentless QObject moved to a named QThread;
``thread.started -> worker.work``; the worker's ``done`` quits the thread; ``deleteLater`` on
both. Commands (switch, pause, resume, stop) go through a thread-safe queue and take effect
between two tokens; stopping is cooperative (an abort flag checked between tokens) and prompt.
An exception becomes ``errored`` with a one-line message, never a silently dead thread.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback

from PySide6.QtCore import QObject, Signal, Slot

from core.generate import ModelInfo, RunHooks, RunRequest, limit_cpu_threads, run_generation
from core.sample import Sample
from workers.threaded import ThreadedController

#: Samples leave in batches of at most this many, or at least every FLUSH_S seconds.
BATCH_MAX = 16
FLUSH_S = 0.05


class _Worker(QObject):
    samples = Signal(list)
    loaded = Signal(object)
    progress = Signal(str)
    errored = Signal(str)
    paused_changed = Signal(bool)
    done = Signal()

    def __init__(self, request: RunRequest) -> None:
        super().__init__()
        self.request = request
        self.commands: "queue.Queue[tuple[str, ...]]" = queue.Queue()
        self.abort = threading.Event()
        self.paused = False
        self._batch: list[Sample] = []
        self._last_flush = time.monotonic()

    # --- hooks called on the worker thread by core.generate
    def _emit(self, sample: Sample) -> None:
        self._batch.append(sample)
        now = time.monotonic()
        if sample.is_event or len(self._batch) >= BATCH_MAX or now - self._last_flush >= FLUSH_S:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.samples.emit(batch)
        self._last_flush = time.monotonic()

    def _poll(self) -> list[tuple[str, str]]:
        """Drain commands; while paused, wait here (between tokens) until resumed or stopped."""
        switches: list[tuple[str, str]] = []
        while True:
            timeout = 0.05 if self.paused else None
            try:
                command = self.commands.get(timeout=timeout) if self.paused else self.commands.get_nowait()
            except queue.Empty:
                if self.paused and not self.abort.is_set():
                    continue
                break
            kind = command[0]
            if kind == "switch":
                switches.append((command[1], command[2]))
            elif kind == "pause" and not self.paused:
                self.paused = True
                self._flush()
                self.paused_changed.emit(True)
            elif kind == "resume" and self.paused:
                self.paused = False
                self.paused_changed.emit(False)
            elif kind == "stop":
                self.abort.set()
                break
            if not self.paused and self.commands.empty():
                break
        return switches

    @Slot()
    def work(self) -> None:
        try:
            run_generation(self.request, RunHooks(
                emit=self._emit, loaded=self.loaded.emit, progress=self.progress.emit,
                poll=self._poll, should_stop=self.abort.is_set))
        except Exception as exc:  # noqa: BLE001 - every failure reaches the window as a message
            self._flush()
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            known = type(exc).__name__ in ("LoadError", "SettingsError", "SpecError", "GenerationError",
                                           "BudgetExceeded", "RecordingError")
            if not known:
                traceback.print_exc()
                message = f"{type(exc).__name__}: {message}"
            self.errored.emit(message)
        finally:
            self._flush()
            self.done.emit()


class GenerationController(ThreadedController):
    """Owns one run at a time: its thread and worker. Lives on the GUI thread."""

    samples = Signal(list)  # list[Sample], small batches
    loaded = Signal(object)  # ModelInfo
    progress = Signal(str)
    errored = Signal(str)
    finished = Signal()
    paused_changed = Signal(bool)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.info: ModelInfo | None = None
        # Size torch's CPU pool here, on the GUI thread: done later on the worker thread, its pool
        # threads would be named after (and outlive) the worker thread.
        limit_cpu_threads("cpu")

    def start(self, request: RunRequest) -> None:
        """Start a run; a run already going is stopped first."""
        self._launch(_Worker(request), "kvscope-generation", {
            "samples": self.samples, "loaded": self._on_loaded, "progress": self.progress,
            "errored": self.errored, "paused_changed": self.paused_changed})

    def _on_loaded(self, info: ModelInfo) -> None:
        self.info = info
        self.loaded.emit(info)

    def _send(self, *command: str) -> None:
        if self._worker is not None:
            self._worker.commands.put(command)

    def switch(self, key: str, value: str) -> None:
        """Queue a switch (``attention``/``attn-impl``/``cache``, value as on the CLI) for between tokens."""
        self._send("switch", key, value)

    def pause(self) -> None:
        self._send("pause")

    def resume(self) -> None:
        self._send("resume")

    def _request_stop(self, worker: _Worker) -> None:
        worker.abort.set()
        worker.commands.put(("stop",))

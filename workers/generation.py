"""The generation worker in the window's own process (thread mode): kvscope.core.live.engine_process.RunDriver on a QThread.

The window normally runs generation in the engine host process (``kvscope.workers.engine_link``); this is the
same driver on a thread of the window's process, for ``KVSCOPE_ENGINE=thread`` and for tests that
patch the model in this process. Shape from superqt's ``_qthreading``: a parentless QObject moved
to a named QThread; ``thread.started -> worker.work``; the worker's ``done`` quits the thread.
Commands (switch, pause, resume, stop) take effect between two tokens; stopping is cooperative and
prompt. An exception becomes ``errored`` with a one-line message, never a silently dead thread.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal, Slot

from kvscope.core.live.engine_process import RunDriver
from kvscope.core.model.request import ModelInfo, RunRequest
from kvscope.core.runtimes.transformers.kernels import start_profiler_threads
from kvscope.core.runtimes.transformers.runtime import limit_cpu_threads
from kvscope.workers.threaded import RUN_MESSAGES, RunSignals, WorkerThread, relay


class _Worker(QObject):
    """kvscope.core.live.engine_process.RunDriver on a QThread: its messages become these signals."""

    samples = Signal(list)
    loaded = Signal(object)
    progress = Signal(str)
    errored = Signal(str)
    paused_changed = Signal(bool)
    done = Signal()

    def __init__(self, request: RunRequest) -> None:
        super().__init__()
        self.driver = RunDriver(request, lambda kind, payload: relay(self, RUN_MESSAGES, kind, payload))

    @Slot()
    def work(self) -> None:
        try:
            self.driver.run()
        finally:
            self.done.emit()


class GenerationController(RunSignals):
    """Owns one run at a time: its thread and worker. Lives on the GUI thread."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.info: ModelInfo | None = None
        self._runner = WorkerThread("kvscope-generation", lambda worker: worker.driver.stop())
        # Size torch's CPU pool and start the profiler's threads here, on the GUI thread: done later on
        # the worker thread, those threads would be named after (and outlive) the worker thread.
        limit_cpu_threads("cpu")
        start_profiler_threads()

    def start(self, request: RunRequest) -> None:
        """Start a run; a run already going is stopped first."""
        self._runner.launch(_Worker(request), {
            "samples": self.samples, "loaded": self._on_loaded, "progress": self.progress,
            "errored": self.errored, "paused_changed": self.paused_changed}, done=self.finished)

    def _on_loaded(self, info: ModelInfo) -> None:
        self.info = info
        self.loaded.emit(info)

    def _send(self, *command: str) -> None:
        if self._runner.is_running():
            self._runner.worker.driver.command(*command)

    def switch(self, key: str, value: str) -> None:
        """Queue a switch (``attention``/``attn-impl``/``cache``, value as on the CLI) for between tokens."""
        self._send("switch", key, value)

    def pause(self) -> None:
        self._send("pause")

    def resume(self) -> None:
        self._send("resume")

    def is_running(self) -> bool:
        return self._runner.is_running()

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stop after the current token and wait up to ``timeout_s``; True when the run has ended."""
        return self._runner.stop(timeout_s)

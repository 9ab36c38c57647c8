"""What the generation and replay controllers share: one worker on one named QThread at a time.

superqt's shape: a parentless worker QObject moved to a QThread; ``thread.started -> worker.work``;
the worker's ``done`` quits the thread (directly: ``quit()`` is thread-safe and ``stop()`` may be
blocking the GUI thread in ``wait()``).

Lifetime: both objects are owned by Python and kept referenced here until their thread has
finished; they are freed when dropped after that. No ``deleteLater``: a C++ object deleted behind a
live Python wrapper (the controller still holds it to answer ``is_running``/``stop``) crashed a test
run, and a QThread dropped while still running aborts the process, so a thread that did not stop in
time is parked until it finishes rather than dropped.
"""

from __future__ import annotations

from PySide6.QtCore import QCoreApplication, QObject, Qt, QThread, Signal


class RunSignals(QObject):
    """What the window connects to on any run controller (generation in a thread or in the engine
    process, replay): the same six signals, declared once."""

    samples = Signal(list)  # list[Sample], small batches
    loaded = Signal(object)  # ModelInfo
    progress = Signal(str)
    errored = Signal(str)
    finished = Signal()
    paused_changed = Signal(bool)


class ThreadedController(RunSignals):
    """Base of controllers that run one worker at a time on a QThread, relaying its signals to ours."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread: QThread | None = None
        self._worker: QObject | None = None
        self._parked: list[tuple[QThread, QObject]] = []  # stopped late: kept alive until they finish

    def _launch(self, worker: QObject, name: str, relays: dict[str, object]) -> None:
        """Move ``worker`` to a new thread named ``name``, connect ``worker.<signal>`` to each relay, start."""
        if self.is_running() and not self.stop() and self._thread is not None:
            self._parked.append((self._thread, self._worker))
        self._parked = [(t, w) for t, w in self._parked if not t.isFinished()]
        thread = QThread()
        thread.setObjectName(name)
        worker.moveToThread(thread)
        thread.started.connect(worker.work)
        for signal, target in relays.items():
            getattr(worker, signal).connect(target)
        worker.done.connect(thread.quit, Qt.ConnectionType.DirectConnection)
        worker.done.connect(self.finished)
        self._thread, self._worker = thread, worker
        thread.start()

    def _request_stop(self, worker: QObject) -> None:
        """Tell the worker to stop between two units of work (subclasses set their abort flags)."""
        raise NotImplementedError

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.isRunning()

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Ask the worker to stop and wait for its thread. True when it ended in time. Never terminate()."""
        worker, thread = self._worker, self._thread
        if worker is None or thread is None:
            return True
        self._request_stop(worker)
        ended = thread.wait(int(timeout_s * 1000)) if thread.isRunning() else True
        if ended:
            self._thread = self._worker = None
        return bool(ended)


def return_to_main_thread(worker: QObject) -> None:
    """Call last on a worker's own thread: hand it back to the main thread so Python can delete it
    there once its owner drops it (Qt only lets an object be pushed from its own thread)."""
    app = QCoreApplication.instance()
    if app is not None:
        worker.moveToThread(app.thread())

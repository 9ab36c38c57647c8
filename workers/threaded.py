"""One worker lifecycle for every background thread of the window: generation (thread mode), replay,
the memory sampler and the GPU-process poller.

superqt's shape: a parentless worker QObject moved to a named QThread; ``thread.started ->
worker.work``; the worker's ``done`` quits the thread (directly: ``quit()`` is thread-safe and
``stop()`` may be blocking the GUI thread in ``wait()``). Each owner says once, in a table, which
worker signal becomes which of its own signals (``relays``), and how its worker is asked to stop.

Lifetime: the worker and its thread are owned by Python and kept referenced here until the next
launch (a sender must outlive the signals it queued just before it ended: the window may still be
delivering them); they are freed when dropped after that. No ``deleteLater``: a C++ object deleted
behind a live Python wrapper crashed a test run, and a QThread dropped while still running aborts
the process, so a thread that did not stop in time is parked until it finishes rather than dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QCoreApplication, QObject, Qt, QThread, Signal

#: The engine's messages (``kvscope.core.live.engine_process``: kind, payload) and the signal each one becomes, for
#: every run controller and worker (their signals have these names): one table, not one per relay.
RUN_MESSAGES = {"samples": "samples", "loaded": "loaded", "progress": "progress", "errored": "errored",
                "paused": "paused_changed"}
#: Likewise for the memory sampler's messages (``kvscope.core.live.engine_process.sample_memory``).
SAMPLER_MESSAGES = {"readings": "readings", "rate": "rate_measured", "note": "note", "sampler_errored": "errored"}


def relay(obj: QObject, table: dict[str, str], kind: str, payload: object) -> bool:
    """Emit ``payload`` on the signal of ``obj`` that ``table`` names for ``kind``; False if none does."""
    name = table.get(kind)
    if name is None:
        return False
    getattr(obj, name).emit(payload)
    return True


class RunSignals(QObject):
    """What the window connects to on any run controller (generation in a thread or in the engine
    process, replay): the same six signals, declared once."""

    samples = Signal(list)  # list[Sample], small batches
    loaded = Signal(object)  # ModelInfo
    progress = Signal(str)
    errored = Signal(str)
    finished = Signal()
    paused_changed = Signal(bool)


class WorkerThread:
    """One worker at a time on its own named QThread: launch, is_running, stop. Owned by a controller.

    A worker is a QObject with a ``work`` slot (the loop: it checks its owner's stop request between
    units of work) and a ``done`` signal emitted last, on its own thread, whatever happened.
    """

    def __init__(self, name: str, request_stop: Callable[[QObject], None]) -> None:
        self.name = name  # the OS thread name too: visible in py-spy, gdb, top -H
        self._request_stop = request_stop
        self.thread: QThread | None = None
        self.worker: QObject | None = None
        self._parked: list[tuple[QThread, QObject]] = []  # stopped late: kept alive until they finish

    def launch(self, worker: QObject, relays: dict[str, object], done: object | None = None) -> None:
        """Stop the current worker (parked if it will not stop in time), then move ``worker`` to a new
        thread, connect ``worker.<signal>`` to each relay, ``worker.done`` to ``done``, and start."""
        if self.is_running() and not self.stop() and self.thread is not None:
            self._parked.append((self.thread, self.worker))
        self._parked = [(t, w) for t, w in self._parked if not t.isFinished()]
        thread = QThread()
        thread.setObjectName(self.name)
        worker.moveToThread(thread)
        thread.started.connect(worker.work)
        for signal, target in relays.items():
            getattr(worker, signal).connect(target)
        # On the worker's thread, before anything else hears of the end: hand the worker back to the
        # main thread (Qt lets an object be pushed only from its own thread), then end the thread.
        worker.done.connect(lambda w=worker: _to_main_thread(w), Qt.ConnectionType.DirectConnection)
        worker.done.connect(thread.quit, Qt.ConnectionType.DirectConnection)
        if done is not None:
            worker.done.connect(done)
        self.thread, self.worker = thread, worker
        thread.start()

    def is_running(self) -> bool:
        return self.thread is not None and self.thread.isRunning()

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Ask the worker to stop and wait for its thread. True when it ended in time. Never terminate()."""
        worker, thread = self.worker, self.thread
        if worker is None or thread is None or not thread.isRunning():
            return True
        self._request_stop(worker)
        return bool(thread.wait(max(int(timeout_s * 1000), 1)))


def _to_main_thread(worker: QObject) -> None:
    app = QCoreApplication.instance()
    if app is not None and worker.thread() is not app.thread():
        worker.moveToThread(app.thread())

"""The GPU processes list, polled from NVML once a second on its own thread.

An NVML call can block for a long time on a busy driver, so the window never makes one: this poller
does, on the window's one worker lifecycle (``kvscope.workers.threaded.WorkerThread``), and delivers
``updated(rows, note)`` on the GUI thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal, Slot

from kvscope.core.runtimes.probes import MemoryProbe
from kvscope.workers.threaded import WorkerThread


class _PollLoop(QObject):
    updated = Signal(list, str)
    done = Signal()

    def __init__(self, make_probe: Callable, interval_s: float) -> None:
        super().__init__()
        self._make_probe = make_probe
        self._interval_s = interval_s
        self.abort = threading.Event()
        self.app_pids: frozenset[int] = frozenset()  # other processes of this app (set from the GUI thread)

    @Slot()
    def work(self) -> None:
        probe = None
        try:
            probe = self._make_probe()
            while not self.abort.is_set():
                rows = probe.gpu_processes(app_pids=self.app_pids)
                self.updated.emit(rows, "; ".join(probe.last_notes))
                self.abort.wait(self._interval_s)
        except Exception as exc:  # noqa: BLE001 - shown in the panel, never a silently dead thread
            self.updated.emit([], f"GPU process list stopped: {type(exc).__name__}: {exc}")
        finally:
            if probe is not None:
                probe.close()
            self.done.emit()


class GpuProcessPoller(QObject):
    """``MemoryProbe.gpu_processes()`` once a second on a named thread; ``updated(list, note)`` out."""

    updated = Signal(list, str)

    def __init__(self, interval_s: float = 1.0, probe_factory: Callable | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.interval_s = interval_s
        self._probe_factory = probe_factory or _default_probe
        self._runner = WorkerThread("kvscope-gpu-processes", lambda loop: loop.abort.set())
        self.app_pids: frozenset[int] = frozenset()

    def start(self) -> None:
        if self.is_running():
            return
        loop = _PollLoop(self._probe_factory, self.interval_s)
        loop.app_pids = self.app_pids
        self._runner.launch(loop, {"updated": self.updated})

    def is_running(self) -> bool:
        return self._runner.is_running()

    def set_app_pids(self, pids: set[int]) -> None:
        """Mark these processes (the engine process) as this app's in the table, from the next poll."""
        self.app_pids = frozenset(pids)
        if self._runner.worker is not None:
            self._runner.worker.app_pids = self.app_pids  # one assignment: safe to read from the poll thread

    def stop(self, timeout_s: float = 2.0) -> bool:
        return self._runner.stop(timeout_s)


def _default_probe():
    return MemoryProbe("cpu")

"""MemorySampler: reads a MemoryProbe at a fixed rate on its own thread, independent of tokens.

GPU monitors sample once a second and know nothing of tokens; the generation loop samples once
per token and sees nothing between them. This sampler fills the gap: 20 readings a second by
default, on a named QThread, delivered to the GUI thread in small batches.

Threading follows superqt's worker pattern and Qt's mandelbrot example: a parentless QObject
worker is moved to a QThread, ``thread.started -> worker.run``; the loop checks an abort flag
between readings and sleeps on a ``threading.Event`` so that ``stop()`` wakes it at once; ``stop()``
then ``wait()``s with a timeout. An exception in the loop becomes ``errored``, never a silent
dead thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from core.engine_process import sample_memory
from core.probes import MemoryProbe
from workers.threaded import return_to_main_thread

THREAD_NAME = "kvscope-memory-sampler"
DEFAULT_RATE_HZ = 20.0
MAX_RATE_HZ = 1000.0


class _SamplerLoop(QObject):
    """Lives on the sampler thread; everything here runs there except ``abort``."""

    readings = Signal(list)
    rate_measured = Signal(float)
    note = Signal(str)
    errored = Signal(str)
    finished = Signal()

    def __init__(self, make_probe: Callable[[], MemoryProbe], rate_hz: float, batch_s: float,
                 rate_window_s: float) -> None:
        super().__init__()
        self._make_probe = make_probe
        self._period = 1.0 / rate_hz
        self._batch_s = batch_s
        self._rate_window_s = rate_window_s
        self._abort = threading.Event()

    def abort(self) -> None:
        """Thread-safe: ask the loop to finish; wakes it if it is sleeping."""
        self._abort.set()

    def set_rate(self, rate_hz: float) -> None:
        """Thread-safe: a float assignment is atomic; the loop picks it up at its next tick."""
        self._period = 1.0 / rate_hz

    @Slot()
    def run(self) -> None:
        signals = {"readings": self.readings, "rate": self.rate_measured, "note": self.note,
                   "sampler_errored": self.errored}
        try:
            sample_memory(self._make_probe, lambda: self._period, lambda kind, payload: signals[kind].emit(payload),
                          self._abort, self._batch_s, self._rate_window_s)
        finally:
            return_to_main_thread(self)
            self.finished.emit()


class MemorySampler(QObject):
    """Fixed-rate memory sampling on its own thread. Create, connect, ``start()``, ``stop()``.

    Signals (delivered in the thread that owns the sampler, normally the GUI thread):
    ``readings(list[MemoryReading])`` every ``batch_s`` seconds; ``rate_measured(float)`` the achieved
    readings per second, every ``rate_window_s``; ``note(str)`` each distinct explanation of what is
    not available, once; ``errored(str)`` if the loop fails; ``finished()`` when the thread is done.

    ``probe_factory`` builds the probe on the sampler thread (default ``MemoryProbe(device)``); the
    sampler closes it when it stops.
    """

    readings = Signal(list)
    rate_measured = Signal(float)
    note = Signal(str)
    errored = Signal(str)
    finished = Signal()

    def __init__(self, device: str = "cpu", rate_hz: float = DEFAULT_RATE_HZ, *,
                 probe_factory: Callable[[], MemoryProbe] | None = None, batch_s: float = 0.1,
                 rate_window_s: float = 1.0, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._check_rate(rate_hz)
        if batch_s <= 0 or rate_window_s <= 0:
            raise ValueError("batch_s and rate_window_s must be positive seconds")
        self.device = device
        self._rate_hz = float(rate_hz)
        self._probe_factory = probe_factory or (lambda: MemoryProbe(device))
        self._batch_s = batch_s
        self._rate_window_s = rate_window_s
        self._thread: QThread | None = None
        self._loop: _SamplerLoop | None = None

    @staticmethod
    def _check_rate(rate_hz: float) -> None:
        if not (0 < rate_hz <= MAX_RATE_HZ):
            raise ValueError(f"sampling rate must be between 0 and {MAX_RATE_HZ:g} Hz, got {rate_hz!r}")

    @property
    def rate_hz(self) -> float:
        """The rate asked for (readings per second); ``rate_measured`` reports the rate achieved."""
        return self._rate_hz

    def set_rate(self, rate_hz: float) -> None:
        """Change the rate, live if running."""
        self._check_rate(rate_hz)
        self._rate_hz = float(rate_hz)
        if self._loop is not None:
            self._loop.set_rate(self._rate_hz)

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.isRunning()

    def start(self) -> None:
        """Start sampling. Does nothing if already running."""
        if self.is_running():
            return
        self._release()
        loop = _SamplerLoop(self._probe_factory, self._rate_hz, self._batch_s, self._rate_window_s)
        thread = QThread()
        thread.setObjectName(THREAD_NAME)  # the OS thread name too: visible in py-spy, gdb, top -H
        loop.moveToThread(thread)
        # Signal to signal: queued across the thread boundary, re-emitted in our own thread.
        loop.readings.connect(self.readings)
        loop.rate_measured.connect(self.rate_measured)
        loop.note.connect(self.note)
        loop.errored.connect(self.errored)
        loop.finished.connect(thread.quit)
        thread.started.connect(loop.run)
        thread.finished.connect(self.finished)
        self._loop, self._thread = loop, thread
        thread.start()

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stop and wait up to ``timeout_s`` for the thread to end. True when it has ended.

        Never terminates the thread: if it does not end in time (a probe call stuck in a driver),
        it is left to finish on its own and False is returned.
        """
        if self._loop is None or self._thread is None:
            return True
        self._loop.abort()
        self._thread.quit()
        return self._thread.wait(max(int(timeout_s * 1000), 1))

    def _release(self) -> None:
        """Forget a finished thread and worker before starting anew.

        Kept until then rather than dropped in ``stop()``: readings the loop queued just before it
        ended are still to be delivered from it, and a sender must outlive its queued signals.
        """
        if self._thread is not None and self._thread.isRunning():
            return
        self._loop, self._thread = None, None

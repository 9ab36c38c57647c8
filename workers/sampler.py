"""MemorySampler: reads a MemoryProbe at a fixed rate on its own thread, independent of tokens.

GPU monitors sample once a second and know nothing of tokens; the generation loop samples once
per token and sees nothing between them. This sampler fills the gap: 20 readings a second by
default, on a named QThread, delivered to the GUI thread in small batches.

Threading is the window's one worker lifecycle (``kvscope.workers.threaded.WorkerThread``): the loop checks
an abort flag between readings and sleeps on a ``threading.Event`` so that ``stop()`` wakes it at
once, then ``wait()``s with a timeout. An exception in the loop becomes ``errored``, never a silent
dead thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal, Slot

from kvscope.core.live.engine_process import sample_memory
from kvscope.core.runtimes.probes import MemoryProbe
from kvscope.workers.engine_link import HostedSampler
from kvscope.workers.sampling_rate import DEFAULT_RATE_HZ, check_rate
from kvscope.workers.threaded import SAMPLER_MESSAGES, WorkerThread, relay

THREAD_NAME = "kvscope-memory-sampler"


class _SamplerLoop(QObject):
    """Lives on the sampler thread; everything here runs there except ``abort``."""

    readings = Signal(list)
    rate_measured = Signal(float)
    note = Signal(str)
    errored = Signal(str)
    done = Signal()

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
    def work(self) -> None:
        try:
            sample_memory(self._make_probe, lambda: self._period,
                          lambda kind, payload: relay(self, SAMPLER_MESSAGES, kind, payload),
                          self._abort, self._batch_s, self._rate_window_s)
        finally:
            self.done.emit()


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
        check_rate(rate_hz)
        if batch_s <= 0 or rate_window_s <= 0:
            raise ValueError("batch_s and rate_window_s must be positive seconds")
        self.device = device
        self._rate_hz = float(rate_hz)
        self._probe_factory = probe_factory or (lambda: MemoryProbe(device))
        self._batch_s = batch_s
        self._rate_window_s = rate_window_s
        self._runner = WorkerThread(THREAD_NAME, lambda loop: loop.abort())

    @property
    def rate_hz(self) -> float:
        """The rate asked for (readings per second); ``rate_measured`` reports the rate achieved."""
        return self._rate_hz

    def set_rate(self, rate_hz: float) -> None:
        """Change the rate, live if running."""
        check_rate(rate_hz)
        self._rate_hz = float(rate_hz)
        if self._runner.is_running():
            self._runner.worker.set_rate(self._rate_hz)

    def is_running(self) -> bool:
        return self._runner.is_running()

    def start(self) -> None:
        """Start sampling. Does nothing if already running."""
        if self.is_running():
            return
        loop = _SamplerLoop(self._probe_factory, self._rate_hz, self._batch_s, self._rate_window_s)
        self._runner.launch(loop, {"readings": self.readings, "rate_measured": self.rate_measured,
                                   "note": self.note, "errored": self.errored}, done=self.finished)

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stop and wait up to ``timeout_s`` for the thread to end. True when it has ended.

        Never terminates the thread: if it does not end in time (a probe call stuck in a driver),
        it is left to finish on its own and False is returned.
        """
        return self._runner.stop(timeout_s)


class SamplerControl(QObject):
    """The window's memory sampler, whichever kind: started, restarted for another device, re-rated,
    stopped, with what it has said so far (achieved rate, notes) for the window to show.

    With an engine process (``host``) the readings come from inside it (the model's process);
    otherwise a ``MemorySampler`` thread here reads this process.
    """

    readings = Signal(list)
    status_changed = Signal()

    def __init__(self, host: object | None = None, rate_hz: float = DEFAULT_RATE_HZ,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host = host
        self.sampler: QObject | None = None
        self.device = "cpu"
        self.rate_hz = float(rate_hz)
        self.achieved_hz: float | None = None
        self.notes: list[str] = []

    def start(self, device: str) -> None:
        """(Re)start sampling ``device`` at the chosen rate."""
        if self.sampler is not None:
            self.sampler.stop(timeout_s=1.0)
        self.device = device
        self.notes = []
        self.achieved_hz = None
        if self.host is not None:
            sampler = HostedSampler(device, self.rate_hz, parent=self, host=self.host)
        else:
            sampler = MemorySampler(device, self.rate_hz, parent=self)
        sampler.readings.connect(self.readings)
        sampler.rate_measured.connect(self._on_rate)
        sampler.note.connect(self._on_note)
        sampler.errored.connect(self._on_note)
        self.sampler = sampler
        sampler.start()
        self.status_changed.emit()

    def set_rate(self, hz: float) -> None:
        self.rate_hz = float(hz)
        if self.sampler is not None:
            self.sampler.set_rate(self.rate_hz)
        self.achieved_hz = None
        self.status_changed.emit()

    def device_resolved(self, device: str) -> None:
        """The engine said what 'auto' is: a sampler started for 'auto' reads that device."""
        if self.device == "auto":
            self.device = device
            self.status_changed.emit()

    def _on_rate(self, hz: float) -> None:
        self.achieved_hz = hz
        self.status_changed.emit()

    def _on_note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)
        self.status_changed.emit()

    def rate_text(self) -> str:
        return ("off" if self.sampler is None else "measuring\u2026" if self.achieved_hz is None
                else f"{self.achieved_hz:.1f} Hz")

    def stop(self, timeout_s: float = 2.0) -> bool:
        return self.sampler is None or self.sampler.stop(timeout_s=timeout_s)

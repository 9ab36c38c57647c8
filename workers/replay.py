"""Replay: a recording played back through the same signals as a live run, with no model and no GPU.

``ReplayController`` has the same signals as ``GenerationController`` (samples, loaded, errored,
finished, paused_changed), so the window consumes either. Samples are paced by their recorded
``time_s`` divided by ``speed``; the file is streamed, never loaded whole.

Every sample costs the window a bounded amount, whatever the file holds: the reader checks each
field (``kvscope.core.records.recording``) and cuts each text to ``MAX_TEXT_CHARS``; a gap between two samples is
waited at most ``MAX_GAP_S`` recorded seconds (a time that jumps by hours, or back, does not stall
the replay); ``speed=math.inf`` plays without waiting (a ``--screenshot`` shows the end); and at
most ``MAX_IN_FLIGHT`` batches wait for the window, so a fast reader never queues a whole file's
samples in memory.
"""

from __future__ import annotations

import math
import threading
import time

from PySide6.QtCore import QObject, Signal, Slot

from kvscope.core.model.request import ModelInfo
from kvscope.core.records.recording import MAX_TEXT_CHARS, RecordingError, RecordingReader, spec_from_header
from kvscope.workers.threaded import RunSignals, WorkerThread

BATCH_MAX = 32
FLUSH_S = 0.05
#: The longest wait between two samples (recorded seconds, before ``speed``): longer gaps (a run
#: left paused, a damaged or hand-edited time) are shortened to it.
MAX_GAP_S = 2.0
#: Batches emitted and not yet taken by the window before the worker waits.
MAX_IN_FLIGHT = 4


def _positive_int(value: object) -> int | None:
    """``value`` if it is a positive int (not a bool), else None: header fields are untrusted."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def info_from_header(header: dict, path: str) -> ModelInfo:
    """ModelInfo for the window from a recording header (untrusted: validated)."""
    spec = spec_from_header(header)
    device = header.get("device") if isinstance(header.get("device"), dict) else {}
    total = device.get("total_memory")
    settings = header.get("settings") if isinstance(header.get("settings"), dict) else {}
    context = settings.get("max_context")
    return ModelInfo(
        label=str(header["model"].get("label") or spec.label) + " — replay",
        source=path,
        device=str(device.get("name", "?")),
        device_name=str(device.get("device_name", device.get("name", "?"))) + " (recorded)",
        dtype=str(spec.dtype),
        spec=spec,
        total_memory=_positive_int(total),
        attention_choices=(), cache_choices=(), attn_impl_choices=(),
        # The recorded run's context limit ("KV at max context" is about that run, not the model).
        max_context=_positive_int(context),
    )


class _ReplayWorker(QObject):
    samples = Signal(list)
    loaded = Signal(object)
    errored = Signal(str)
    paused_changed = Signal(bool)
    done = Signal()

    def __init__(self, path: str, speed: float) -> None:
        super().__init__()
        self.path = path
        self.speed = speed
        self.abort = threading.Event()
        self.resume_event = threading.Event()
        self.resume_event.set()
        self.credits = threading.Semaphore(MAX_IN_FLIGHT)  # released as the window takes batches

    def _emit(self, batch: list) -> None:
        """Hand a batch to the window once it has taken enough of the earlier ones (or on abort)."""
        while not self.credits.acquire(timeout=0.05):
            if self.abort.is_set():
                return
        self.samples.emit(batch)

    @Slot()
    def work(self) -> None:
        try:
            with RecordingReader(self.path, max_text=MAX_TEXT_CHARS) as reader:
                self.loaded.emit(info_from_header(reader.header, self.path))
                batch: list = []
                last_flush = time.monotonic()
                due = time.monotonic()  # when the current sample is due on the wall clock
                last_t: float | None = None
                paced = math.isfinite(self.speed)
                for sample in reader:
                    if self.abort.is_set():
                        break
                    if not self.resume_event.is_set():
                        paused_at = time.monotonic()
                        while not self.resume_event.wait(0.05):
                            if self.abort.is_set():
                                break
                        due += time.monotonic() - paused_at
                    if paced and last_t is not None:
                        due += min(max(sample.time_s - last_t, 0.0), MAX_GAP_S) / self.speed
                    last_t = sample.time_s
                    delay = due - time.monotonic()
                    if paced and delay > 0:
                        if batch:
                            self._emit(batch)
                            batch, last_flush = [], time.monotonic()
                        while delay > 0 and not self.abort.wait(min(delay, 0.25)):
                            delay = due - time.monotonic()
                    batch.append(sample)
                    if (len(batch) >= BATCH_MAX or (paced and sample.is_event)
                            or time.monotonic() - last_flush >= FLUSH_S):
                        self._emit(batch)
                        batch, last_flush = [], time.monotonic()
                if batch and not self.abort.is_set():
                    self._emit(batch)
                problem = reader.problem()
                if problem:
                    self.errored.emit(problem)
        except (RecordingError, OSError) as exc:
            self.errored.emit(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - a bug must end the replay with a message, not a traceback
            self.errored.emit(f"replay failed: internal error: {type(exc).__name__}: {exc}".splitlines()[0])
        finally:
            self.done.emit()


class ReplayController(RunSignals):
    """Plays one recording at a time; same signals as the generation controller."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._runner = WorkerThread("kvscope-replay", _stop_worker)

    def start(self, path: str, speed: float = 1.0) -> None:
        """Play ``path`` at ``speed`` x its recorded pace (``math.inf``: as fast as the window takes it)."""
        self._runner.launch(_ReplayWorker(path, speed), {
            "samples": self._take, "loaded": self.loaded, "errored": self.errored,
            "paused_changed": self.paused_changed}, done=self.finished)

    @Slot(list)
    def _take(self, batch: list) -> None:
        """A batch reached the GUI thread: give it to the window, then let the worker send another."""
        try:
            self.samples.emit(batch)
        finally:
            worker = self.sender()  # the worker that sent it (an earlier replay's may still be ending)
            if isinstance(worker, _ReplayWorker):
                worker.credits.release()

    def switch(self, key: str, value: str) -> None:  # a recording cannot be changed
        self.progress.emit("a replay shows what was recorded; switches apply to live runs")

    def pause(self) -> None:
        if self._runner.is_running():
            self._runner.worker.resume_event.clear()
            self.paused_changed.emit(True)

    def resume(self) -> None:
        if self._runner.is_running():
            self._runner.worker.resume_event.set()
            self.paused_changed.emit(False)

    def is_running(self) -> bool:
        return self._runner.is_running()

    def stop(self, timeout_s: float = 1.0) -> bool:
        """End the replay and wait up to ``timeout_s``; True when it has ended."""
        return self._runner.stop(timeout_s)


def _stop_worker(worker: _ReplayWorker) -> None:
    worker.abort.set()
    worker.resume_event.set()

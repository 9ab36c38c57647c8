"""Replay: a recording played back through the same signals as a live run, with no model and no GPU.

``ReplayController`` has the same signals as ``GenerationController`` (samples, loaded, errored,
finished, paused_changed), so the window consumes either. Samples are paced by their recorded
``time_s`` divided by ``speed``; the file is streamed, never loaded whole.
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, Signal, Slot

from core.generate import ModelInfo
from core.recording import RecordingError, RecordingReader, spec_from_header
from workers.threaded import ThreadedController

BATCH_MAX = 32
FLUSH_S = 0.05


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

    @Slot()
    def work(self) -> None:
        try:
            with RecordingReader(self.path) as reader:
                self.loaded.emit(info_from_header(reader.header, self.path))
                batch: list = []
                last_flush = time.monotonic()
                start = time.monotonic()
                first_t: float | None = None
                for sample in reader:
                    if self.abort.is_set():
                        break
                    if not self.resume_event.is_set():
                        paused_at = time.monotonic()
                        while not self.resume_event.wait(0.05):
                            if self.abort.is_set():
                                break
                        start += time.monotonic() - paused_at
                    first_t = sample.time_s if first_t is None else first_t
                    due = start + (sample.time_s - first_t) / self.speed
                    delay = due - time.monotonic()
                    if delay > 0:
                        if batch:
                            self.samples.emit(batch)
                            batch, last_flush = [], time.monotonic()
                        self.abort.wait(min(delay, 1.0))
                    batch.append(sample)
                    if len(batch) >= BATCH_MAX or sample.is_event or time.monotonic() - last_flush >= FLUSH_S:
                        self.samples.emit(batch)
                        batch, last_flush = [], time.monotonic()
                if batch:
                    self.samples.emit(batch)
                problem = reader.problem()
                if problem:
                    self.errored.emit(problem)
        except (RecordingError, OSError) as exc:
            self.errored.emit(str(exc))
        finally:
            self.done.emit()


class ReplayController(ThreadedController):
    """Plays one recording at a time; same signals as the generation controller."""

    def start(self, path: str, speed: float = 1.0) -> None:
        self._launch(_ReplayWorker(path, speed), "kvscope-replay", {
            "samples": self.samples, "loaded": self.loaded, "errored": self.errored,
            "paused_changed": self.paused_changed})

    def switch(self, key: str, value: str) -> None:  # a recording cannot be changed
        self.progress.emit("a replay shows what was recorded; switches apply to live runs")

    def pause(self) -> None:
        if self._worker is not None:
            self._worker.resume_event.clear()
            self.paused_changed.emit(True)

    def resume(self) -> None:
        if self._worker is not None:
            self._worker.resume_event.set()
            self.paused_changed.emit(False)

    def _request_stop(self, worker: _ReplayWorker) -> None:
        worker.abort.set()
        worker.resume_event.set()

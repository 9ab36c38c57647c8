"""How long the UI thread is kept from running its event loop: a 10 ms timer that measures lateness."""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, Qt, QTimer


class StallMeter(QObject):
    """Fires every ``interval_ms``; any extra delay between two firings is time the UI thread was blocked."""

    def __init__(self, interval_ms: int = 10, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.interval_ms = interval_ms
        self.timer = QTimer(self)
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self._last: float | None = None
        self.worst_ms = 0.0
        self.ticks = 0
        self.late_over_50ms = 0

    def start(self) -> None:
        self._last = time.perf_counter()
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def reset(self) -> None:
        self.worst_ms, self.ticks, self.late_over_50ms = 0.0, 0, 0
        self._last = time.perf_counter()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            late = (now - self._last) * 1000.0 - self.interval_ms
            self.worst_ms = max(self.worst_ms, late)
            if late > 50.0:
                self.late_over_50ms += 1
        self._last = now
        self.ticks += 1

"""The Servers tab's scraper: inference servers' /metrics every few seconds, on its own thread.

A scrape can take up to its timeout (a slow or silent server), so the window never makes one: this
poller does, on the window's one worker lifecycle (``kvscope.workers.threaded.WorkerThread``), and delivers
``readings(list[kvscope.core.records.scrape.ServerReading])`` on the GUI thread after each round.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from PySide6.QtCore import QObject, Signal, Slot

from kvscope.workers.threaded import WorkerThread


class _WatchLoop(QObject):
    readings = Signal(list)
    failed = Signal(str)
    done = Signal()

    def __init__(self, urls: list[str], spec, interval_s: float, timeout_s: float) -> None:
        super().__init__()
        self.urls, self.spec = list(urls), spec
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.abort = threading.Event()

    @Slot()
    def work(self) -> None:
        from kvscope.core.records.scrape import Watcher  # ~90 ms at the window's start-up (ssl)

        try:
            watchers = [Watcher(u, spec=self.spec, timeout=self.timeout_s) for u in self.urls]
            with ThreadPoolExecutor(max_workers=min(16, len(watchers)), thread_name_prefix="kvscope-servers") as pool:
                while not self.abort.is_set():
                    self.readings.emit(list(pool.map(lambda w: w.scrape(), watchers)))
                    self.abort.wait(self.interval_s)
        except Exception as exc:  # noqa: BLE001 - said in the tab, never a silently dead thread
            self.failed.emit(f"watching stopped: {type(exc).__name__}: {exc}")
        finally:
            self.done.emit()


class ServerWatchPoller(QObject):
    """Scrapes ``urls`` every ``interval_s`` seconds (each server within ``timeout_s``); ``readings`` out."""

    readings = Signal(list)
    failed = Signal(str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._runner = WorkerThread("kvscope-server-watch", lambda loop: loop.abort.set())

    def start(self, urls: list[str], spec=None, interval_s: float = 2.0, timeout_s: float = 2.0) -> None:
        self._runner.launch(_WatchLoop(urls, spec, interval_s, timeout_s),
                            {"readings": self.readings, "failed": self.failed})

    def is_running(self) -> bool:
        return self._runner.is_running()

    def stop(self, timeout_s: float = 3.0) -> bool:
        return self._runner.stop(timeout_s)

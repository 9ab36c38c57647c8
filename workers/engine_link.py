"""The window's side of the engine host process (``kvscope.core.live.engine_process.serve``): one child, shared, talked to over a pipe.

``EngineHost`` spawns the child (the ``spawn`` start method everywhere: forking a process that runs
Qt and torch threads is unsafe) and reads its messages on a named QThread that only waits on the
pipe, so unpickling a batch is all it ever asks of the GIL. Messages are re-emitted as the Qt
signal ``message(kind, payload, run)``, delivered on the GUI thread.

``HostedGenerationController`` and ``HostedSampler`` have the signals and methods of
``kvscope.workers.generation.GenerationController`` and ``kvscope.workers.sampler.MemorySampler``: the window
uses either pair the same way. A child that dies (killed, a crash in a kernel) ends the run with a
one-line error; the next command starts a new child.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
from typing import Any

from PySide6.QtCore import QCoreApplication, QObject, Signal, Slot

from kvscope.core.live.engine_process import serve, take_early
from kvscope.workers.sampling_rate import DEFAULT_RATE_HZ, check_rate
from kvscope.workers.threaded import RUN_MESSAGES, SAMPLER_MESSAGES, RunSignals, WorkerThread, relay

log = logging.getLogger(__name__)

#: ``KVSCOPE_ENGINE=thread`` runs generation and sampling on threads of the window's own process.
ENGINE_ENV = "KVSCOPE_ENGINE"


def engine_mode() -> str:
    """'process' (default: the engine host) or 'thread' (``KVSCOPE_ENGINE=thread``)."""
    mode = os.environ.get(ENGINE_ENV, "process").strip().lower() or "process"
    if mode not in ("process", "thread"):
        log.warning("%s=%r: expected 'process' or 'thread'; using 'process'", ENGINE_ENV, mode)
        return "process"
    return mode


def controller_class() -> type:
    """The generation controller the window (and the self-test) uses: the engine process by default,
    a thread of this process with KVSCOPE_ENGINE=thread."""
    if engine_mode() == "process":
        return HostedGenerationController
    from kvscope.workers.generation import GenerationController  # torch: KVSCOPE_ENGINE=thread only

    return GenerationController


class _Reader(QObject):
    """Waits on the pipe; every message becomes ``message``; EOF (the child is gone) becomes ``done``.

    Runs on the window's one worker lifecycle (``kvscope.workers.threaded.WorkerThread``); it is stopped by
    closing its end of the pipe (``EngineHost._forget``), which ends ``recv`` with an error."""

    message = Signal(str, object, object)
    done = Signal()

    def __init__(self, conn: Any, run_done: threading.Event) -> None:
        super().__init__()
        self.conn = conn
        self.run_done = run_done

    @Slot()
    def work(self) -> None:
        try:
            self._read()
        finally:
            self.run_done.set()
            self.done.emit()

    def _read(self) -> None:
        while True:
            try:
                kind, payload, run = self.conn.recv()
            except (EOFError, OSError, ValueError):
                break
            except Exception:  # noqa: BLE001 - a message that cannot be unpickled: say so, keep reading
                log.exception("a message from the engine process could not be read")
                continue
            if kind == "done":
                self.run_done.set()  # before the signal: stop() may be waiting on the GUI thread
            self.message.emit(kind, payload, run)


class EngineHost(QObject):
    """The engine process and its pipe. ``send`` starts the process when it is not running."""

    message = Signal(str, object, object)  # (kind, payload, run id or None) from kvscope.core.live.engine_process
    exited = Signal(int)  # the process ended; its exit code (negative: killed by that signal)

    def __init__(self, parent: QObject | None = None, target: Any = serve) -> None:
        super().__init__(parent)
        self._target = target  # the child's main (kvscope.core.live.engine_process.serve; a test gives one that fails)
        self._process: Any = None
        self._conn: Any = None
        # The pipe's reader thread; a new engine's reader parks the old one until it has finished.
        self._reader = WorkerThread("kvscope-engine-reader", lambda reader: None)
        self._lock = threading.Lock()
        self.run_done = threading.Event()
        self.pid: int | None = None  # the engine's pid, once it said it is ready
        self.starts = 0  # engine processes started so far (a new one needs its sampler command again)
        self.last_was_ready = False  # whether the engine that ended last had said it was ready

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self) -> None:
        """Spawn the engine process (imports torch and transformers there, seconds) unless it runs."""
        if self.is_alive():
            return
        self._forget()
        early = take_early() if self._target is serve else None  # started by main.py before the window's imports
        if early is not None:
            process, ours = early
        else:
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = ctx.Pipe(duplex=True)
            process = ctx.Process(target=self._target, args=(theirs,), name="kvscope-engine", daemon=True)
            process.start()
            theirs.close()  # the child holds its end; ours sees EOF when the child is gone
        self._process, self._conn = process, ours
        self.starts += 1
        self.run_done.set()
        self._reader.launch(_Reader(ours, self.run_done), {"message": self._on_message}, done=self._on_exited)

    def send(self, *command: Any) -> None:
        """Send a command (see kvscope.core.live.engine_process); starts the engine first when it is not running."""
        if not self.is_alive():
            self.start()
        if command[0] == "run":
            self.run_done.clear()
        with self._lock:
            try:
                self._conn.send(command)
            except (OSError, ValueError) as exc:  # the child died between the check and the send
                log.warning("engine process unreachable: %s", exc)
                self.run_done.set()

    def wait_run_done(self, timeout_s: float) -> bool:
        return self.run_done.wait(max(timeout_s, 0.0))

    def _on_message(self, kind: str, payload: object, run: object) -> None:
        if kind == "ready":
            self.pid = int(payload)
        self.message.emit(kind, payload, run)

    def _on_exited(self) -> None:
        process = self._process
        if process is None or self.sender() is not self._reader.worker:
            return  # an old child's reader, after a restart
        process.join(1.0)
        code = process.exitcode if process.exitcode is not None else -1
        self.last_was_ready = self.pid is not None  # it had started (not an engine that cannot start)
        self.pid = None
        self.exited.emit(code)

    def kill(self) -> None:
        """End the engine process now (its memory, GPU memory included, goes with it)."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Ask the engine to quit, wait ``timeout_s``, then kill it; wait for the reader to finish."""
        process = self._process
        if process is not None and process.is_alive():
            with self._lock:
                try:
                    self._conn.send(("quit",))
                except (OSError, ValueError):
                    pass
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self._forget()
        self._reader.stop(timeout_s=2.0)  # its end of the pipe is closed: it ends

    def _forget(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the reader's recv ends with an error: it finishes
        self._process = self._conn = None
        self.pid = None


_shared: EngineHost | None = None


def shared_host() -> EngineHost:
    """The application's engine host (one per process), shut down when the application quits or
    the interpreter exits (a QThread still running at exit would abort the process)."""
    global _shared
    if _shared is None:
        app = QCoreApplication.instance()
        _shared = EngineHost(app)
        if app is not None:
            app.aboutToQuit.connect(_shared.shutdown)
        atexit.register(_shutdown_shared)
    return _shared


def _shutdown_shared() -> None:
    if _shared is not None:
        _shared.shutdown()


class HostedGenerationController(RunSignals):
    """GenerationController's interface, with the run in the engine process."""

    def __init__(self, parent: QObject | None = None, host: EngineHost | None = None, warm: bool = True) -> None:
        super().__init__(parent)
        self.host = host or shared_host()
        self.info = None
        self._running = False
        self._killed = False
        self._run_id = 0
        self.host.message.connect(self._on_message)
        self.host.exited.connect(self._on_exited)
        if warm:  # torch is imported there while the window starts; else at the first run
            self.host.start()

    def start(self, request: Any) -> None:
        """Start a run; a run already going is stopped first."""
        if self._running and not self.stop():
            self.kill()
        self._running, self._killed = True, False
        self._run_id += 1  # what arrives from an earlier run (still queued here) is dropped
        self.host.send("run", request, self._run_id)

    def switch(self, key: str, value: str) -> None:
        if self._running:
            self.host.send("switch", key, value)

    def pause(self) -> None:
        if self._running:
            self.host.send("pause")

    def resume(self) -> None:
        if self._running:
            self.host.send("resume")

    def is_running(self) -> bool:
        return self._running

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stop after the current token; True when the run ended within ``timeout_s``.

        When it did not, ``finished`` follows when it does (or, for a run that will not stop, after
        ``kill``). The window's close kills a run that did not stop in time.
        """
        if not self._running:
            return True
        self.host.send("stop")
        if self.host.wait_run_done(timeout_s):
            self._running = False
            return True
        return False

    def kill(self) -> None:
        """End a run that does not stop: the engine process goes (``finished`` follows, no error) and a
        new one starts for the next run."""
        self._killed = True
        self.host.kill()

    def _on_message(self, kind: str, payload: object, run: object) -> None:
        if run is None or run != self._run_id:
            return  # the sampler's, or from a run that has already ended here
        if kind == "loaded":
            self.info = payload
        if kind == "done":  # (also after a stop() that saw the end: as a thread's finished does)
            self._running = False
            self.finished.emit()
        else:
            relay(self, RUN_MESSAGES, kind, payload)

    def _on_exited(self, code: int) -> None:
        if self._running:
            self._running = False
            if not self._killed:
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                self.errored.emit(f"the engine process ended during the run ({how}); the next run starts a new one")
            self.finished.emit()
        self._killed = False
        if self.host.last_was_ready:
            self.host.start()  # warm again for the next run (an engine that cannot start waits for one)


class HostedSampler(QObject):
    """MemorySampler's interface, reading the engine process's memory from inside it."""

    readings = Signal(list)
    rate_measured = Signal(float)
    note = Signal(str)
    errored = Signal(str)
    finished = Signal()

    def __init__(self, device: str = "cpu", rate_hz: float = DEFAULT_RATE_HZ, parent: QObject | None = None,
                 host: EngineHost | None = None) -> None:
        super().__init__(parent)
        check_rate(rate_hz)
        self.device = device
        self._rate_hz = float(rate_hz)
        self._running = False
        self.host = host or shared_host()
        self.host.message.connect(self._on_message)

    @property
    def rate_hz(self) -> float:
        return self._rate_hz

    def set_rate(self, rate_hz: float) -> None:
        check_rate(rate_hz)
        self._rate_hz = float(rate_hz)
        if self._running:
            self.host.send("sampler_rate", self._rate_hz)

    def is_running(self) -> bool:
        return self._running

    def start(self) -> None:
        self._running = True
        self.host.send("sampler", self.device, self._rate_hz)
        self._sent_to = self.host.starts

    def stop(self, timeout_s: float = 1.0) -> bool:
        if self._running and self.host.is_alive():
            self.host.send("sampler_stop")
        was = self._running
        self._running = False
        if was:
            self.finished.emit()
        return True

    def _on_message(self, kind: str, payload: object, run: object) -> None:
        if not self._running:
            return
        if relay(self, SAMPLER_MESSAGES, kind, payload):
            return
        if kind == "ready" and self.host.starts != getattr(self, "_sent_to", None):
            # a new engine process (the last one ended): sample in this one too
            self.host.send("sampler", self.device, self._rate_hz)
            self._sent_to = self.host.starts

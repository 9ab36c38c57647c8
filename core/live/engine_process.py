"""The engine host: generation and memory sampling in a child process, so the window never waits on them.

Why a process: in one process the model's Python (transformers' forward, the cache classes, the
probes) and the window's event loop take turns on one GIL, and a garbage collection in either stops
both; the window missed its 10 ms timer by 160-300 ms during runs. In a child process the model
cannot block the window at all, a crash or an out-of-memory kill in a kernel ends the child, not
the window, and a run that will not stop can always be ended.

This module is Qt-free. The same two loops run either in the host (``serve``) or on threads of the
window's own process (``workers``' thread mode):

* ``RunDriver`` drives ``kvscope.core.live.run.run_generation`` (every runtime's one loop): samples leave in batches (at most ``BATCH_MAX`` or
  every ``FLUSH_S`` seconds), commands (switch, pause, resume, stop) take effect between tokens,
  and every failure becomes one ``errored`` message, never a silently dead run.
* ``sample_memory`` reads a ``MemoryProbe`` at a fixed rate, independent of tokens.

Both report through ``send(kind, payload)``. Messages (child -> window), as ``(kind, payload, run)``,
where ``run`` is the id the window gave the run (None for the sampler's and ``ready``):
``ready`` (pid), ``device`` (str: what ``auto`` means in this process, found with torch so that
the window need not import it), ``samples`` (list[Sample]), ``loaded`` (ModelInfo), ``progress`` (str), ``errored``
(str), ``paused`` (bool), ``done`` (None: the run ended), ``readings`` (list[MemoryReading]),
``rate`` (float Hz), ``note`` (str), ``sampler_errored`` (str). Commands (window -> child), as
tuples: ``("run", RunRequest, run_id)``, ``("switch", key, value)``, ``("pause",)``, ``("resume",)``,
``("stop",)``, ``("sampler", device, rate_hz)`` (device may be ``auto``), ``("sampler_rate", rate_hz)``,
``("sampler_stop",)``, ``("quit",)``.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import kvscope.core.live.run  # every runtime's one loop (the runtime's module loads with the run); called as kvscope.core.live.run.run_generation
from kvscope.core import runtimes
from kvscope.core.base.errors import is_user_error, one_line  # noqa: F401 - one_line: also this module's name for it
from kvscope.core.model.request import RunHooks
from kvscope.core.runtimes.probes import MemoryProbe

#: Samples leave in batches of at most this many, or at least every FLUSH_S seconds.
BATCH_MAX = 16
FLUSH_S = 0.05

Send = Callable[[str, Any], None]


class RunDriver:
    """One run of ``kvscope.core.live.run.run_generation``, reporting through ``send``.

    ``command``/``stop`` are thread-safe; ``run`` blocks until the run ends and never raises.
    """

    def __init__(self, request: Any, send: Send) -> None:
        self.request = request
        self.send = send
        self.commands: "queue.Queue[tuple[Any, ...]]" = queue.Queue()
        self.abort = threading.Event()
        self.paused = False
        self._batch: list[Any] = []
        self._last_flush = time.monotonic()
        # Switches waiting for what they need (the runtime's ``prepare_switch``: a quantized cache's backend) to be
        # prepared off the token path.
        self._deferred: dict[str, tuple[str, str]] = {}
        self._said_preparing = 0.0

    def command(self, *command: Any) -> None:
        """Queue ``("switch", key, value)``, ``("pause",)`` or ``("resume",)`` for between two tokens."""
        self.commands.put(command)

    def stop(self) -> None:
        """End the run after the current token (or at once while paused)."""
        self.abort.set()
        self.commands.put(("stop",))

    def _emit(self, sample: Any) -> None:
        self._batch.append(sample)
        now = time.monotonic()
        if sample.is_event or len(self._batch) >= BATCH_MAX or now - self._last_flush >= FLUSH_S:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.send("samples", batch)
        self._last_flush = time.monotonic()

    def _poll(self) -> list[tuple[str, str]]:
        """Drain commands; while paused, wait here (between tokens) until resumed or stopped.

        Switches coalesce: per axis only the last press counts (a mash of 30 keys during a re-run is one
        switch per axis, not 30 re-runs), in the order of the last presses."""
        switches: dict[str, tuple[str, str]] = {}
        while True:
            try:
                command = self.commands.get(timeout=0.05) if self.paused else self.commands.get_nowait()
            except queue.Empty:
                if self.paused and not self.abort.is_set():
                    continue
                break
            kind = command[0]
            if kind == "switch":
                axis = str(command[1]).strip().lower().replace("_", "-")
                switches.pop(axis, None)
                switches[axis] = (command[1], command[2])
            elif kind == "pause" and not self.paused:
                self.paused = True
                self._flush()
                self.send("paused", True)
            elif kind == "resume" and self.paused:
                self.paused = False
                self.send("paused", False)
            elif kind == "stop":
                self.abort.set()
                break
            if not self.paused and self.commands.empty():
                break
        return self._ready(switches)

    def _ready(self, switches: dict[str, tuple[str, str]]) -> list[tuple[str, str]]:
        """The switches that can apply at this token. One its runtime is still preparing for (its
        ``prepare_switch`` hook: transformers builds a quantized cache's backend on a thread of its own) waits: the
        run goes on under the current settings, the window is told every second, and it applies at the first
        token after. A runtime without the hook applies every switch at once."""
        for axis, switch in switches.items():
            self._deferred.pop(axis, None)  # a newer press on the axis replaces one still waiting
            self._deferred[axis] = switch
        out: list[tuple[str, str]] = []
        runtime = getattr(self.request, "runtime", None)
        for axis, (key, value) in list(self._deferred.items()):
            waiting = runtimes.prepare_switch(runtime, key, value)
            if waiting is None:
                out.append(self._deferred.pop(axis))
                continue
            now = time.monotonic()
            if now - self._said_preparing >= 1.0:
                self._said_preparing = now
                self.send("progress", waiting)
        return out

    def run(self) -> None:
        try:
            kvscope.core.live.run.run_generation(self.request, RunHooks(
                emit=self._emit, loaded=lambda info: self.send("loaded", info),
                progress=lambda text: self.send("progress", text), poll=self._poll,
                should_stop=self.abort.is_set))
        except Exception as exc:  # noqa: BLE001 - every failure reaches the window as a message
            self._flush()
            if not is_user_error(exc):  # a bug of ours: its traceback, as the command line shows it
                traceback.print_exc()
            self.send("errored", one_line(exc))
        finally:
            self._flush()


def sample_memory(make_probe: Callable[[], Any], period_s: Callable[[], float], send: Send,
                  abort: threading.Event, batch_s: float = 0.1, rate_window_s: float = 1.0) -> None:
    """Read a probe every ``period_s()`` seconds until ``abort`` is set; never raises.

    Sends ``readings`` every ``batch_s``, ``rate`` (readings per second achieved) every
    ``rate_window_s``, each distinct ``note`` once, and ``sampler_errored`` if a read fails.
    """
    probe = None
    try:
        probe = make_probe()
        batch: list[Any] = []
        seen_notes: set[str] = set()
        last_emit = time.monotonic()
        rate_start: float | None = None  # intervals since then / time since then = achieved rate
        rate_count = 0
        next_tick = last_emit
        while not abort.is_set():
            reading = probe.read()
            batch.append(reading)
            for line in reading.notes:
                if line not in seen_notes:  # each explanation once, not 20 times a second
                    seen_notes.add(line)
                    send("note", line)
            now = time.monotonic()
            if now - last_emit >= batch_s:
                send("readings", batch)
                batch, last_emit = [], now
            if rate_start is None:
                rate_start = reading.time_s
            else:
                rate_count += 1
                elapsed = reading.time_s - rate_start
                if elapsed >= rate_window_s:
                    send("rate", rate_count / elapsed)
                    rate_start, rate_count = reading.time_s, 0
            # A fixed schedule, not sleep(period): the read time does not slow the rate. After a
            # stall (a busy CPU), start afresh rather than firing a burst of catch-up readings.
            next_tick += period_s()
            if next_tick < now:
                next_tick = now + period_s()
            abort.wait(next_tick - now)
        if batch:
            send("readings", batch)
    except Exception as exc:  # noqa: BLE001 - must reach the window, not die silently
        send("sampler_errored", f"memory sampler stopped: {type(exc).__name__}: {exc}")
    finally:
        if probe is not None:
            probe.close()


class _Sampler:
    """The host's memory sampler thread (one at a time)."""

    def __init__(self, device: str, rate_hz: float, send: Send) -> None:
        device = _auto_device() if device == "auto" else device
        self.period = 1.0 / rate_hz
        self.abort = threading.Event()
        self.thread = threading.Thread(
            target=sample_memory, name="kvscope-memory-sampler", daemon=True,
            args=(lambda: MemoryProbe(device), lambda: self.period, send, self.abort))
        self.thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self.abort.set()
        self.thread.join(timeout_s)


def _auto_device() -> str:
    """The device a run with ``--device auto`` gets here (cuda, mps or cpu), by the default runtime."""
    return runtimes.auto_device()


def _yield_cpu_to_the_window() -> None:
    """Run below the window's CPU priority: where the model and the window compete for cores (a CPU
    run on a laptop), the scheduler lets the window paint first; a GPU run barely uses the CPU.

    Called once the first token is out, not at start-up: the imports and the first model load then have the
    CPU at the window's priority (the first plotted token came 10.5 s after launch at load 3-4, niced from
    the start). On Linux a nice value belongs to a thread, so every thread of the process is lowered (the
    sampler's, torch's); threads started later inherit it from their parent."""
    try:
        import psutil

        process = psutil.Process()
        if hasattr(psutil, "BELOW_NORMAL_PRIORITY_CLASS"):  # Windows: a priority class, per process
            process.nice(psutil.BELOW_NORMAL_PRIORITY_CLASS)
            return
        target = min(process.nice() + 10, 19)
        if sys.platform.startswith("linux"):
            for thread in process.threads():
                try:
                    os.setpriority(os.PRIO_PROCESS, thread.id, max(target, os.getpriority(os.PRIO_PROCESS, thread.id)))
                except OSError:  # a thread that ended meanwhile
                    pass
        else:  # macOS and the BSDs: per process
            process.nice(target)
    except Exception:  # noqa: BLE001 - a priority we cannot lower is no reason not to run
        pass


_early: tuple[Any, Any] | None = None  # (process, the window's end of its pipe), from spawn_early


def spawn_early(preload: Any = None) -> None:
    """Start the engine process now, before the window's own imports (Qt and pyqtgraph: seconds on a small
    machine): torch and transformers import there meanwhile, and with ``preload`` (the request of the run the
    window starts with) its model loads too. ``kvscope.workers.engine_link.EngineHost`` adopts it (``take_early``)."""
    global _early
    import multiprocessing

    if _early is not None:
        return
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    process = ctx.Process(target=serve, args=(theirs, preload), name="kvscope-engine", daemon=True)
    process.start()
    theirs.close()  # the child holds its end; ours sees EOF when the child is gone
    _early = (process, ours)


def take_early() -> tuple[Any, Any] | None:
    """The engine process ``spawn_early`` started, still running, and its pipe (once; None if there is none)."""
    global _early
    early, _early = _early, None
    if early is not None and not early[0].is_alive():
        early[1].close()
        return None
    return early


def discard_early() -> None:
    """End an engine process started early that no window will use (no display: the terminal view runs)."""
    early = take_early()
    if early is not None:
        early[0].kill()
        early[0].join(5.0)
        early[1].close()


def serve(conn: Any, preload: Any = None) -> None:
    """The host process's main: answer commands from ``conn`` until ``quit`` or the window is gone.
    ``preload``: a RunRequest whose model loads before the first command is read (``spawn_early``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lock = threading.Lock()
    gone = threading.Event()
    started = threading.Event()  # the first run's first tokens are out (or it ended): start-up is over

    def send(kind: str, payload: Any = None, run: Any = None) -> None:
        if gone.is_set():
            return
        with lock:
            try:
                conn.send((kind, payload, run))
            except (OSError, EOFError, ValueError):  # the window has gone: nothing to tell
                gone.set()
        if kind in ("samples", "done", "errored") and not started.is_set():
            started.set()
            _yield_cpu_to_the_window()

    runtimes.host_start()  # on this main thread, before any run: the runtimes' slow imports, their threads' share
    send("ready", os.getpid())
    send("device", _auto_device())
    if preload is not None:
        # The run the window is about to ask for (its runtime's ``preload``): its "run" command waits in the pipe.
        runtimes.preload(preload)
    driver: RunDriver | None = None
    runner: threading.Thread | None = None
    sampler: _Sampler | None = None

    def run(d: RunDriver, run_id: Any) -> None:
        d.run()
        send("done", None, run_id)

    try:
        while not gone.is_set():
            try:
                command = conn.recv()
            except (EOFError, OSError):
                break  # the window has gone
            kind = command[0]
            if kind == "run":
                if runner is not None and runner.is_alive():
                    driver.stop()
                    runner.join()
                run_id = command[2] if len(command) > 2 else None
                driver = RunDriver(command[1], lambda kind, payload, r=run_id: send(kind, payload, r))
                runner = threading.Thread(target=run, args=(driver, run_id), name="kvscope-generation", daemon=True)
                runner.start()
            elif kind in ("switch", "pause", "resume"):
                if driver is not None:
                    driver.command(*command)
            elif kind == "stop":
                if driver is not None:
                    driver.stop()
            elif kind == "sampler":
                if sampler is not None:
                    sampler.stop()
                sampler = _Sampler(command[1], float(command[2]), send)
            elif kind == "sampler_rate":
                if sampler is not None:
                    sampler.period = 1.0 / float(command[1])
            elif kind == "sampler_stop":
                if sampler is not None:
                    sampler.stop()
                    sampler = None
            elif kind == "quit":
                break
    finally:
        if driver is not None:
            driver.stop()
        if runner is not None:
            runner.join(5.0)
        if sampler is not None:
            sampler.stop()

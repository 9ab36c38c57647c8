"""The run's machinery, as a part of the window: the generation controller (the engine process, or a thread), the
replay controller and the memory sampler; starting, pausing, stopping and switching a run, live or replayed.

It owns what a run needs and says what happened through signals (``samples``, ``loaded``, ``finished``,
``starting``, ``status``, ``error``); the window renders them. The run's state itself is the session's
(``kvscope.core.live.session.Session``), which this part drives and the window watches.
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QFileDialog, QWidget

from kvscope.core.live.session import canonical_switch
from kvscope.core.model.spec import SpecError
from kvscope.workers.sampler import SamplerControl

log = logging.getLogger(__name__)

DEFAULT_SAMPLER_HZ = 20.0
#: Keys 1-5, as the status line names them when the model has no such mode.
KEY_NAMES = {1: "MHA", 2: "GQA", 3: "MQA", 4: "MLA", 5: "a sliding window"}


def _make_controller(parent: QObject, warm: bool):
    """The generation controller: the engine host process by default (started now when ``warm``, else at the first
    run), a thread of this process with KVSCOPE_ENGINE=thread (imports torch: done once, when the window is built)."""
    from kvscope.workers.engine_link import HostedGenerationController, controller_class

    cls = controller_class()
    return cls(parent, warm=warm) if cls is HostedGenerationController else cls(parent)


class RunControl(QObject):
    """Runs, live and replayed. ``window``: the dialogs' parent; ``session``: the run's state; ``controls``: what
    a run is asked to be and the switches' choices; ``calculator``: its thread imports transformers first (thread
    mode waits for it); ``plots``: the previous run held under the next; ``files``: record and snapshot paths."""

    samples = Signal(list)  # a batch of Samples, live or replayed
    loaded = Signal(object)  # ModelInfo: a model loaded, or a recording opened
    finished = Signal()  # the run ended and the session has taken it
    starting = Signal()  # a run or a replay begins: clear the view
    sampler_changed = Signal()  # the sampler's rate, device or notes
    engine_ready = Signal(int)  # the engine process's pid
    status = Signal(str, int)
    error = Signal(str)

    def __init__(self, window: QWidget, session, controls, calculator, plots, files, controller=None,
                 start_engine: bool = True) -> None:
        super().__init__(window)
        self.window, self.session, self.controls = window, session, controls
        self.calculator, self.plots, self.files = calculator, plots, files
        self.engine_device = "auto"  # what 'auto' is in the engine process, once it has said
        self._cuda: bool | None = None
        self._replay_args: tuple[str, float] | None = None
        self.controller = controller
        if self.controller is None:
            try:
                self.controller = _make_controller(window, warm=start_engine)
            except ImportError as exc:  # a UI-only build (replay) still opens
                log.warning("generation worker not available: %s", exc)
        self.replay = None
        try:
            from kvscope.workers.replay import ReplayController

            self.replay = ReplayController(window)
        except ImportError as exc:
            log.warning("replay not available: %s", exc)
        for c in (self.controller, self.replay):
            if c is not None:
                c.samples.connect(self.samples)
                c.loaded.connect(self.loaded)
                c.progress.connect(session.progress)
                c.errored.connect(self._on_error)
                c.finished.connect(self._on_finished)
                c.paused_changed.connect(lambda paused: session.set_state("paused" if paused else "running"))
        self.host = getattr(self.controller, "host", None)
        self.sampling = SamplerControl(self.host, DEFAULT_SAMPLER_HZ, parent=self)
        self.sampling.readings.connect(session.take_readings)
        self.sampling.status_changed.connect(self.sampler_changed)
        if self.host is not None:
            self.host.message.connect(self._on_engine_message)

    def start_sampling(self) -> None:
        """The memory sampler on the device runs will use (a window opened for a replay starts it at its first run)."""
        self.sampling.start(self.auto_device())

    # ---- live runs

    def start_run(self, request=None) -> bool:
        """Start generating (``request`` or the controls' settings). False with a message if it cannot."""
        if self.controller is None:
            self.error.emit("the generation worker is not available in this build")
            return False
        if self.session.busy:
            return False
        try:
            request = request or self.controls.build_request()
        except SpecError as exc:
            self.error.emit(str(exc))
            return False
        request = self.files.apply_to(request)  # File > Record and the snapshot button apply to this run
        self._hold_previous_run(request)  # before this request replaces the last one
        self.session.mode = "live"
        self.session.request = request
        if not self.calculator.warm and self.host is None:
            # Thread mode: transformers may still be importing in the calculator's thread, and importing it from the
            # generation thread at the same time breaks it. Start when that is done (no UI wait). The engine process
            # imports it in its own process: nothing to wait for.
            self._start_after_warm_up()
            self.status.emit("preparing transformers\u2026", 0)
            return True
        self._start_now(request)
        return True

    def _start_after_warm_up(self) -> None:
        """Start what was asked (a run or a replay) once the calculator's thread has imported transformers; the
        window does not wait meanwhile."""
        self.calculator.warm_up()
        self.session.set_state("loading")
        self.calculator.warmed.connect(self._start_when_warm, Qt.ConnectionType.SingleShotConnection)

    def _start_when_warm(self) -> None:
        if self.session.state == "loading" and self.session.mode == "replay" and self._replay_args is not None:
            self._start_replay_now(*self._replay_args)
        elif self.session.state == "loading" and self.session.request is not None:
            self._start_now(self.session.request)

    def _start_now(self, request) -> None:
        self.sampler_changed.emit()
        self.starting.emit()
        self.controls.error_label.setText("")
        if self.sampling.sampler is None:  # a window opened for a replay: the first live run starts it
            self.start_sampling()
        self.session.begin_live(request, self.sampling.device)
        self.status.emit(f"loading {request.source}\u2026", 0)
        self.files.run_started(request)
        self.controller.start(request)

    def _hold_previous_run(self, request) -> None:
        """The live run shown (if it was one) stays on the KV plot, dotted, under the next live run of the same
        model: run it in one runtime, then in another (or with two settings), and both curves are there.
        A replay, or another model, drops it (like with like)."""
        previous = self.session.request
        same = (self.session.mode == "live" and previous is not None and self.session.decode_tokens > 0
                and previous.source == request.source)
        if same:
            runtime = getattr(previous, "runtime", "")
            cache = self.plots.tokens_cache or ""
            self.plots.hold_previous(f"before: {runtime}{'' if cache in ('', 'dynamic') else ' ' + cache}")
        else:
            self.plots.drop_previous()

    def follow_device(self, info) -> None:
        """A live model loaded on another device than the sampler reads: the probe moves to it (NVML and the
        allocator of that GPU)."""
        if self.session.mode == "live" and str(info.device) != self.sampling.device:
            self.sampling.start(str(info.device))

    # ---- replays

    def open_recording(self, path: str | None = None, speed: float = 1.0, ask: bool = False) -> bool:
        """Play a recording through the window (plots, markers, text, stats) at ``speed`` x its pace."""
        if ask:
            chosen, _ = QFileDialog.getOpenFileName(self.window, "Open recording", str(Path.home()),
                                                    "KV Scope recordings (*.jsonl);;All files (*)")
            if not chosen:
                return False
            path = chosen
        if self.replay is None:
            self.error.emit("replay is not available in this build")
            return False
        if self.session.state != "idle":
            self.error.emit("stop the current run first (a recording replays into the same plots)")
            return False
        if not path:
            return False
        self.session.mode = "replay"
        self._replay_args = (str(path), float(speed))
        self.files.last_recording = str(path)
        if not self.calculator.warm:
            # Same reason as start_run: the stats use the predictor, which must not import transformers while the
            # calculator's thread does.
            self._start_after_warm_up()
            return True
        self._start_replay_now(str(path), float(speed))
        return True

    def _start_replay_now(self, path: str, speed: float) -> None:
        self.plots.drop_previous()  # a recording is not compared with the live run before it
        self.starting.emit()
        self.controls.error_label.setText("")
        self.session.begin_replay()
        self.sampler_changed.emit()
        self.status.emit(f"replaying {Path(path).name}" + (
            "" if speed == 1 else f" at {speed:g}x" if speed < float("inf") else " unpaced"), 0)
        self.replay.start(path, speed)

    # ---- pause, stop, the end

    def _active(self):
        return self.replay if self.session.mode == "replay" else self.controller

    def stop_run(self) -> None:
        controller = self._active()
        if controller is None or self.session.state == "idle":
            return
        self.session.set_state("stopping")
        # Cooperative: the loop ends after the current token. Short wait, then the finished signal finishes the
        # job, so a slow token never freezes the window.
        if controller.stop(timeout_s=0.2):
            self._on_finished()

    def toggle_pause(self) -> None:
        controller = self._active()
        if controller is None:
            return
        if self.session.state == "running":
            controller.pause()
        elif self.session.state == "paused":
            controller.resume()

    def _on_error(self, message: str) -> None:
        self.session.error(message)
        self.error.emit(message)

    def _on_finished(self) -> None:
        if self.session.finished():
            self.finished.emit()

    # ---- live switches

    def request_switch(self, key: str, value: str) -> None:
        """Switch ``key`` (attention / attn-impl / cache) to ``value`` now, or set it for the next run."""
        self.controls.select(self.controls.combo(key), value)
        self.controls.grey_what_cannot_run()  # what each key offers next follows the settings asked
        if key == "attn-impl" and value != "flash":
            self.controls.last_non_flash = value
        live = self.controller is not None and self.session.mode == "live"
        if live and self.session.state in ("running", "paused", "loading"):
            if not self.session.switch_sent(key, value):
                # The same switch already on its way, or what runs: said, not silence (issue 37: pressing the
                # current mode's key said nothing, which reads as a dead key on stage).
                axis, canonical = canonical_switch(key, value)
                on_way = self.session.pending.get(axis) == canonical
                self.status.emit(f"{key}: {value} is already on its way" if on_way else
                                 f"{key}: already {value}", 3000)
                return
            self.controller.switch(key, value)  # the engine keeps only the last pending press per axis
            self.controller.switch(key, value)  # the engine keeps only the last pending press per axis
            pending = self.session.switches_pending
            if not pending:
                self.status.emit(f"{key}: staying with {value}", 3000)
                return
            queued = f" ({pending} queued)" if pending > 1 else ""
            self.status.emit(f"switching {key} to {value} after this token\u2026{queued}", 0)
        else:  # no run: the badges keep the last run's settings, the combos show the next run's (issue 37)
            self.status.emit(f"{key} {value} for the next run (no run now)", 4000)

    def attention_key(self, n: int) -> None:
        """Keys 1-5: mha, the middle GQA choice, mqa, mla, the smallest window (its plateau shows soonest)."""
        wanted = self.controls.attention_for_key(n)
        if wanted is None:
            self.status.emit(f"{KEY_NAMES[n]} is not available: {self.controls.last_problem}", 6000)
            return
        self.request_switch("attention", wanted)

    def toggle_flash(self) -> None:
        kernel = self.controls.flash_toggled()
        if kernel is None:
            self.status.emit(f"flash attention is not available here: {self.controls.last_problem}", 6000)
        else:
            self.request_switch("attn-impl", kernel)

    def next_cache(self) -> None:
        cache = self.controls.next_cache()
        if cache is None:
            self.status.emit(self.controls.last_problem, 6000)
        else:
            self.request_switch("cache", cache)

    # ---- the engine's device

    def cuda_available(self) -> bool:
        if self._cuda is None:
            device = self.auto_device()
            if device == "auto":
                return False  # the engine has not said yet
            self._cuda = device.startswith("cuda")
        return self._cuda

    def auto_device(self) -> str:
        """'cuda' where torch sees a GPU, else 'mps' or 'cpu'. With the engine process, the engine says which
        ('auto' until it has: this process never imports torch); in thread mode kvscope.core.runtimes.transformers.loading decides here."""
        if self.host is not None:
            return self.engine_device
        try:
            from kvscope.core.runtimes.transformers.loading import resolve_device

            return resolve_device("auto")
        except Exception:  # noqa: BLE001 - a UI-only build: host memory is what there is
            return "cpu"

    def _on_engine_message(self, kind: str, payload: object, run: object) -> None:
        if kind == "ready":
            self.engine_ready.emit(int(payload))
        elif kind == "device":
            self.engine_device = str(payload)
            self._cuda = self.engine_device.startswith("cuda")
            self.sampling.device_resolved(self.engine_device)  # the engine's sampler read 'auto' as this

    def shutdown(self) -> None:
        """Stop the run, a replay and the sampler (idempotent)."""
        if self.controller is not None and self.controller.is_running():
            if not self.controller.stop(timeout_s=5.0):
                if hasattr(self.controller, "kill"):  # the engine process: end it, memory and all
                    self.controller.kill()
                else:
                    log.warning("the generation thread did not stop within 5 s")
        if self.replay is not None and self.replay.is_running():
            self.replay.stop(timeout_s=2.0)
        if not self.sampling.stop(timeout_s=2.0):
            log.warning("the memory sampler thread did not stop within 2 s")

"""The llama.cpp runtime: ``kvscope.core.runtimes.llamacpp.engine.LlamaCppEngine`` behind the ``Runtime`` seam, in a child process.

llama.cpp is C++: a GGUF it cannot run often ends in ``GGML_ASSERT`` -> ``abort()`` (SIGABRT), which no
Python ``try`` catches (per-layer KV heads [2, 64], a flipped byte in the vocabulary). So the engine lives
in a child process of its own in every mode (the terminal's ``run``, the window's engine process, thread
mode), and this side talks to it over a pipe: one request per call (prefill, step, apply, event), one
reply. If the child dies, the call raises ``RuntimeCrashed`` with the signal and llama.cpp's last words
(its stderr, kept in a file), and the run loop makes it an ``error`` event (recorded) and one line; the
process that asked (the terminal, the engine process, the window) stays up.

This side reads the GGUF and makes the plan (pure Python, bounded: ``kvscope.core.model.gguf``), so a run llama.cpp
would refuse is refused before any child starts, and an abort still has a model and settings to record.
Imports neither torch nor llama_cpp; the child imports llama_cpp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
from typing import Any, Callable

from kvscope.core.base.errors import RuntimeCrashed
from kvscope.core.base.process_state import is_stopped
from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.model.attention import SettingsError, native_attention
from kvscope.core.model.gguf import read_gguf
from kvscope.core.model.request import ModelInfo, RunRequest
from kvscope.core.model.spec import human_bytes
from kvscope.core.prediction.llamacpp import CACHE_TYPES, LlamaCppOptions, plan
from kvscope.core.runtimes.llamacpp.engine import OFFERED_CACHE_TYPES, RUNTIME as NAME, LlamaCppEngine, resolve_model

#: How often a waiting call checks that the child is still alive (seconds).
POLL_S = 0.05
#: How long the child may take to load before the call gives up (seconds): a huge GGUF on a slow disk.
LOAD_TIMEOUT_S = 3600.0
#: How long the child may stay stopped (SIGSTOP: it never answers) before the run ends it (seconds).
STOPPED_S = 5.0


# ---------------------------------------------------------------------------------------------------- the child


def _state(engine: LlamaCppEngine) -> dict[str, Any]:
    return {"generated": engine.generated, "tokens": len(engine.tokens), "cells": engine.cells, "full": engine.full(),
            "preparing": engine.preparing()}


def model_info(engine: LlamaCppEngine) -> ModelInfo:
    """What the window shows and can switch for a loaded llama.cpp context (made in the child)."""
    total = None
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - unknown is None
        pass

    cache_choices = tuple((t, None) for t in OFFERED_CACHE_TYPES if t in CACHE_TYPES)
    if engine.cache_key not in OFFERED_CACHE_TYPES:
        cache_choices = ((engine.cache_key, None),) + cache_choices
    return ModelInfo(label=f"{engine.spec.label} (llama.cpp)", source=str(engine.path), device=engine.device,
                     device_name="llama.cpp on the CPU" if engine.device == "cpu" else "llama.cpp on the GPU",
                     dtype=engine.dtype, spec=engine.spec, total_memory=total,
                     attention_choices=(engine.attention,), cache_choices=cache_choices,
                     # -fa: a switch reloads the context with the other setting (the compute buffer moves)
                     attn_impl_choices=("fa-off", "fa-on"), max_context=engine.cells, runtime=NAME)


def _settings(engine: LlamaCppEngine) -> dict[str, Any]:
    o = engine.options
    return {"attention": engine.attention, "attn_impl": engine.attn_impl, "cache": engine.cache_key, "batch": 1,
            "max_context": engine.cells, "dtype": engine.dtype,
            "llama_cpp": {"n_ctx": o.n_ctx, "n_seq_max": o.n_seq_max, "kv_unified": o.kv_unified,
                          "type_k": o.type_k, "type_v": o.type_v, "flash_attn": o.flash_attn, "swa_full": o.swa_full,
                          "n_batch": o.n_batch, "n_ubatch": o.n_ubatch, "n_gpu_layers": o.n_gpu_layers,
                          "offload_kqv": o.offload_kqv, "file": engine.path.name}}


def _start_events(engine: LlamaCppEngine) -> list[Sample]:
    return [engine.event("load", f"loaded {engine.path.name} into llama.cpp ({engine.gguf.arch}, "
                                 f"{human_bytes(engine.weights)} of weights) on the {engine.device.upper()}"),
            engine.event("note", f"llama.cpp reserved the KV cache at load: {engine.describe_allocation()}, before "
                                 "the first token (the prepayment); 'held' is the cells that hold tokens")]


def _call(engine: LlamaCppEngine, method: str, args: tuple) -> Any:
    if method == "prefill":
        return [engine.prefill(args[0])]
    if method == "step":
        return engine.step()
    if method == "apply":
        return engine.apply(*args)
    if method == "apply_live":
        return engine.apply_live(*args)
    if method == "advance":
        return engine.advance()
    if method == "event":
        kind, text, fields = args
        return engine.event(kind, text, **fields)
    if method == "start":
        return model_info(engine), _settings(engine), _start_events(engine)
    raise ValueError(f"unknown call {method!r}")


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` itself when it pickles (a SettingsError keeps its type), else a RuntimeError that says it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception must reach the parent as something
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve(conn: Any, path: str, options: LlamaCppOptions, seed: int, stderr_path: str | None) -> None:
    """The child's main: load, then answer ``(method, args)`` until ``close`` or the parent is gone."""
    # ggml answers an abort with a backtrace through gdb (seconds, pages of it): the assertion's line is enough.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    if stderr_path:  # llama.cpp's GGML_ASSERT / abort() text goes to fd 2: keep it for the parent to quote
        fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        engine = LlamaCppEngine(path, options, seed=seed)
    except BaseException as exc:  # noqa: BLE001 - said to the parent, which raises it
        conn.send(("err", _sendable(exc), None))
        return
    conn.send(("ok", None, _state(engine)))
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                break
            if method == "close":
                break
            try:
                conn.send(("ok", _call(engine, method, args), _state(engine)))
            except Exception as exc:  # noqa: BLE001 - the parent raises it in the run loop
                conn.send(("err", _sendable(exc), _state(engine)))
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------- this side


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "no exit status"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


def _last_words(path: str | None) -> str:
    """llama.cpp's last line worth quoting from the child's stderr (its GGML_ASSERT), or ''."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for words in (("GGML_ASSERT", "GGML_ABORT"), ("error", "failed")):  # its assertion first, else an error line
        for line in reversed(lines):
            if any(word in line for word in words) and not line.startswith("#"):
                # "/tmp/.../src/llama-vocab.cpp:2544: GGML_ASSERT(...) failed" -> from the file's own name on
                line = line[line.rfind("/", 0, line.find(": ")) + 1:] if ": " in line else line
                return " ".join(line.split())[:200]
    return ""


@contextlib.contextmanager
def _children_allowed():
    """Let a daemonic process (the window's engine process is one) start this child: multiprocessing refuses
    so that no child outlives a parent killed at exit. This child cannot: it ends when its pipe closes (EOF in
    ``serve``), which the OS does when the parent dies, and ``close()`` joins or kills it."""
    me = multiprocessing.current_process()
    daemon = me._config.get("daemon")  # noqa: SLF001 - the one flag Process.start checks
    me._config["daemon"] = False  # noqa: SLF001
    try:
        yield
    finally:
        if daemon is not None:
            me._config["daemon"] = daemon  # noqa: SLF001
        else:
            me._config.pop("daemon", None)  # noqa: SLF001


class LlamaCppRuntime:
    """A GGUF in llama.cpp, running in a child process; a ``kvscope.core.runtimes.base.Runtime``."""

    name = NAME

    def __init__(self, request: RunRequest, progress: Callable[[str], None]) -> None:
        self.request = request
        self.progress = progress
        self.options: LlamaCppOptions = request.options_for(NAME) or LlamaCppOptions()
        self.path = resolve_model(request.source, progress)
        self.gguf = read_gguf(self.path)
        self.spec = self.gguf.spec()
        self.kv_plan = plan(self.gguf, self.options)  # SettingsError: llama.cpp would refuse it too
        self.attention = native_attention(self.spec).key
        self.generated = 0
        self._state: dict[str, Any] = {}
        self._last: Sample | None = None
        self._info: ModelInfo | None = None
        self._settings: dict[str, Any] = {}
        self._start: list[Sample] = []
        self._process: Any = None
        self._conn: Any = None
        self._stderr: str | None = None
        self._crashed: RuntimeCrashed | None = None
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------------------------ the child

    def load(self) -> None:
        self.progress(f"loading {self.path.name} into llama.cpp")
        fd, self._stderr = tempfile.mkstemp(prefix="kvscope-llamacpp-", suffix=".log")
        os.close(fd)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads (Qt, the sampler)
        self._conn, child = ctx.Pipe()
        process = ctx.Process(target=serve, name="kvscope-llamacpp", daemon=True,
                              args=(child, str(self.path), self.options, self.request.seed, self._stderr))
        with _children_allowed():
            process.start()
        self._process = process
        child.close()
        self._reply(LOAD_TIMEOUT_S, "loading")
        self._info, settings, self._start = self._ask("start")
        self._settings = settings

    def _reply(self, timeout_s: float | None, doing: str) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stopped_since = None
        while not self._conn.poll(POLL_S):
            if not self._process.is_alive() and not self._conn.poll(0):
                raise self._crash(doing)
            if not is_stopped(self._process.pid):  # a stopped child (issue 38) hung the run forever
                stopped_since = None
            elif (stopped_since := stopped_since or time.monotonic()) < time.monotonic() - STOPPED_S:
                self._process.kill()
                raise self._crash(doing, f"its process stopped (SIGSTOP) for {STOPPED_S:.0f} s, so KV Scope ended it,")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise self._crash(doing, f"no answer within {timeout_s:.0f} s")
        try:
            status, result, state = self._conn.recv()
        except (EOFError, OSError):
            raise self._crash(doing) from None
        if state:
            self._state = state
            self.generated = state["generated"]
        if status == "err":
            raise result
        return result

    def _ask(self, method: str, *args: Any) -> Any:
        if self._crashed is not None:
            raise self._crashed
        try:
            self._conn.send((method, args))
        except (OSError, ValueError):
            raise self._crash(method) from None
        result = self._reply(None, method)
        if isinstance(result, Sample):
            self._last = result
        elif isinstance(result, list) and result and isinstance(result[0], Sample):
            self._last = result[-1]
        return result

    def _crash(self, doing: str, why: str = "") -> RuntimeCrashed:
        self._process.join(5.0)
        how = why or _signal_name(self._process.exitcode)
        said = _last_words(self._stderr)
        where = "while loading" if doing == "loading" else f"at token {self.generated}"
        self._crashed = RuntimeCrashed(
            f"llama.cpp ended with {how} {where} {self.path.name}" + (f": {said}" if said else "")
            + " (in a process of its own: nothing else stopped)")
        return self._crashed

    # ------------------------------------------------------------------------------------ the seam

    def model_info(self) -> ModelInfo:
        return self._info

    def settings(self, request: RunRequest) -> dict[str, Any]:
        return {"runtime": NAME, **self._settings, "max_new_tokens": request.max_new_tokens, "source": request.source,
                "switches": [list(s) for s in request.switches], "memory_budget": None}

    def start_events(self, request: RunRequest) -> list[Sample]:
        if request.label and self._start and self._start[0].event == "load":  # as the user names it (an Ollama tag)
            load = self._start[0]
            text = load.text.replace("loaded ", f"loaded {request.label} (", 1).replace(" into llama.cpp", ") into llama.cpp", 1)
            return [load.replace(text=text), *self._start[1:]]
        return list(self._start)

    def prefill(self, request: RunRequest) -> list[Sample]:
        return self._ask("prefill", request.prompt)

    def step(self) -> Sample:
        return self._ask("step")

    def apply(self, key: str, value: str) -> Sample:
        return self._ask("apply", key, value)

    def apply_live(self, key: str, value: str) -> list[Sample]:
        """A press during the run: a reload (F, C) is prepared in the child on a second context while the first
        keeps generating, and applies at a later token (``advance``)."""
        return self._ask("apply_live", key, value)

    def advance(self) -> list[Sample]:
        out = self._ask("advance")
        preparing = self._state.get("preparing")
        now = time.perf_counter()
        if preparing and not out and now - getattr(self, "_said_preparing", 0.0) >= 0.5:
            self._said_preparing = now
            self.progress(preparing)  # the status line, while the run goes on
        return out

    def event(self, kind: str, text: str, **fields: Any) -> Sample:
        if self._crashed is None and self._process is not None and self._process.is_alive():
            return self._ask("event", kind, text, fields)
        return self._event_here(kind, text, **fields)

    def _event_here(self, kind: str, text: str, **fields: Any) -> Sample:
        """An event made on this side (the child is gone or never started): the last Sample's measurements,
        or the plan's where there was none."""
        now = time.perf_counter() - self.t0
        if self._last is not None:
            return dataclasses.replace(self._last, phase=PHASE_EVENT, event=kind, text=text, tokens_per_s=None,
                                       time_s=max(now, self._last.time_s), **fields)
        o = self.options
        cache = o.type_k if o.type_k == o.type_v else f"{o.type_k}/{o.type_v}"
        return Sample(token=0, phase=PHASE_EVENT, time_s=now, text=text, attention=self.attention,
                      attn_impl=f"fa-{o.flash_attn}", cache=cache, kernel="llama.cpp", device="n/a",
                      dtype=(self.gguf.file_type or "gguf").lower(), kv_bytes_held=None, kv_bytes_reserved=None,
                      kv_bytes_storage=None, weights_bytes=None, kv_bytes_predicted=self.kv_plan.kv_bytes,
                      weights_predicted=self.kv_plan.weights, event=kind, runtime=NAME, **fields)

    def room(self) -> str | None:
        if not self._state.get("full"):
            return None
        return (f"the context is full at {self._state['tokens']:,} tokens ({self._state['cells']:,} cells: "
                "llama.cpp's -c); the run ends here")

    def plan(self, tokens: int) -> int | None:  # noqa: ARG002 - reserved at load, whatever the tokens
        return self._last.kv_bytes_predicted if self._last is not None else self.kv_plan.kv_bytes

    def budget_need(self, ahead: int) -> int | None:  # noqa: ARG002
        return None  # no --memory-budget: the registry's entry does not list it

    def out_of_memory(self, exc: BaseException, where: str) -> str | None:  # noqa: ARG002
        return None  # llama.cpp reserves at load: running out shows as a load that fails

    def error_context(self) -> str:
        cache = self._last.cache if self._last is not None else self.options.type_k
        return f"(at token {self.generated}; llama.cpp, cache {cache})"

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            try:
                if process.is_alive():
                    self._conn.send(("close", ()))
                process.join(5.0)
            except (OSError, ValueError):
                pass
            if process.is_alive():
                process.kill()
                process.join(2.0)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._stderr:
            try:
                os.unlink(self._stderr)
            except OSError:
                pass
            self._stderr = None


def open_runtime(request: RunRequest, progress: Callable[[str], None]) -> LlamaCppRuntime:
    """Checks (the file a GGUF, the plan one llama.cpp accepts), then a runtime to ``load()``. Whether
    llama-cpp-python is installed the registry asked already (``kvscope.core.runtimes.llamacpp.switches.llamacpp_missing``, without
    importing it); a broken build is said by the child, which imports it."""
    return LlamaCppRuntime(request, progress)

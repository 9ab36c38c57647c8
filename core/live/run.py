"""The run: one loop that drives any runtime for a ``RunRequest``.

``run_generation`` is what the terminal view (``kvscope.core.live.terminal``) and the engine process
(``kvscope.core.live.engine_process``) call, whatever the runtime: it opens the runtime the registry names
(``kvscope.core.runtimes``), and owns everything runtimes share: the output checks, the recording, the events
(load, notes, switch/refused/note, stop, forecast, budget, oom, error), scripted switches (``--switch``) and
live ones, pause and stop between tokens, the memory budget, and the end of the run. A runtime only answers
(``kvscope.core.runtimes.base.Runtime``). Errors come back as ``KVScopeError``s (``kvscope.core.base.errors``) and as ``error``,
``oom`` or ``budget`` events, in the recording too.

Imports no torch: a runtime's module is imported when a run opens it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

from kvscope.core import __version__, runtimes
from kvscope.core.base.errors import GenerationError, RuntimeCrashed, is_user_error
from kvscope.core.base.host_memory import HostFigures
from kvscope.core.base.sample import Sample
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.request import ModelInfo, RunHooks, RunRequest  # noqa: F401 - RunHooks: its old home
from kvscope.core.model.spec import human_bytes
from kvscope.core.records.outputs import OutputError, check_output_path
from kvscope.core.records.recording import RecordingError, RecordingWriter, header_for


class BudgetExceeded(GenerationError):
    """The memory budget would be exceeded by the next token."""


#: The CLI's spelling of each request option a runtime may not take (``kvscope.core.runtimes.OPTIONS``).
_OPTION_FLAGS = {"memory_budget": "--memory-budget", "snapshot": "--snapshot", "quality_probe": "--quality-probe",
                 "max_context": "--max-context"}


def _asked_options(request: RunRequest) -> list[str]:
    asked = {"memory_budget": request.memory_budget is not None, "snapshot": bool(request.snapshot_path),
             "quality_probe": bool(request.quality_probe),
             "max_context": getattr(request.settings, "max_context", None) is not None}
    return [name for name in runtimes.OPTIONS if asked.get(name)]


def check_request(request: RunRequest) -> runtimes.RuntimeInfo:
    """What every run checks before anything loads: the runtime exists and takes the options asked, and the
    recording's path can be created (``kvscope.core.records.outputs``' rule). Returns the runtime's entry."""
    info = runtimes.get(request.runtime)
    refused = [_OPTION_FLAGS[name] for name in _asked_options(request) if name not in info.supports]
    if refused:
        raise SettingsError(f"{', '.join(refused)}: not for a {info.name} run (the {info.name} runtime does not "
                            f"take {'it' if len(refused) == 1 else 'them'})")
    if request.record_path:
        try:
            check_output_path(request.record_path, force=request.overwrite, allow_stdout=False)
        except OutputError as exc:
            raise RecordingError(f"cannot create recording: {exc}") from None
    return info


def run_generation(request: RunRequest, hooks: RunHooks) -> list[Sample]:
    """Open ``request.runtime``, load, prefill, generate ``max_new_tokens`` tokens with scripted and live switches.

    Every Sample goes to ``hooks.emit`` and, with ``request.record_path``, to the recording (written and
    flushed sample by sample). Returns the prefill and the last decode Sample. Raises ``KVScopeError``s with
    user-facing messages; the recording stays complete up to then, with the failure as its last event.
    """
    check_request(request)
    runtime = runtimes.open_runtime(request, hooks.progress)
    writer = None
    try:
        try:
            runtime.load()
        except RuntimeCrashed as exc:
            # The runtime's own process died while loading (llama.cpp aborting): the recording still says so.
            if request.record_path and runtime.spec is not None:
                writer = _open_writer(request, runtime, None)
                with contextlib.suppress(Exception):
                    writer.write(runtime.event("error", str(exc)))
            raise
        info = runtime.model_info()
        if request.label:  # as the user names it (an installed model's repo id or tag), not its snapshot hash
            info = dataclasses.replace(info, label=request.label)
        hooks.loaded(info)
        if request.record_path:
            writer = _open_writer(request, runtime, info)

        # This process's resident set split further (Sample.runtime_baseline, host_retained) where the runtime runs here
        host = HostFigures() if getattr(runtime, "runs_in_this_process", False) else None

        def emit(sample: Sample) -> None:
            if host is not None:
                sample = host.attach(sample)
            if writer is not None:
                writer.write(sample)
            hooks.emit(sample)

        for sample in runtime.start_events(request):
            emit(sample)
        try:
            kept = _loop(request, runtime, hooks, emit)
        except Exception as exc:
            if not getattr(exc, "kvscope_reported", False):
                # Errors are data: the recording and the events table get the failure and the settings at
                # that moment before the error reaches the caller (which still fails the run).
                with contextlib.suppress(Exception):
                    emit(runtime.event("error", error_text(exc, runtime)))
            raise
        if writer is not None:
            # Deleted or replaced while the run wrote to it: writes to an unlinked file succeed, so only
            # its path can tell. Said instead of "recorded to ..." (the terminal and the window alike).
            writer.check_still_there()
        return kept
    finally:
        if writer is not None:
            writer.close()
        runtime.close()


def _open_writer(request: RunRequest, runtime: Any, info: ModelInfo | None) -> Any:
    if info is not None:
        device: dict[str, Any] = {"name": info.device, "device_name": info.device_name,
                                  "total_memory": info.total_memory}
    else:
        device = {"name": "n/a", "device_name": f"{runtime.name} (did not load)", "total_memory": None}
    try:
        settings = runtime.settings(request)
    except Exception:  # noqa: BLE001 - a runtime that died before saying: the request's own
        settings = {"runtime": runtime.name, "source": request.source, "max_new_tokens": request.max_new_tokens}
    return RecordingWriter(request.record_path, header_for(runtime.spec, device, settings, __version__),
                           overwrite=request.overwrite)


def _loop(request: RunRequest, runtime: Any, hooks: RunHooks, emit: Callable[[Sample], None]) -> list[Sample]:
    # By token, then in the order given: two switches at one token apply as the command line lists them.
    scripted = sorted(request.switches, key=lambda switch: switch[0])
    try:
        started = runtime.prefill(request)
    except Exception as exc:
        _out_of_memory(runtime, emit, exc, "prefill")
        raise
    first = started[0]
    for sample in started:
        emit(sample)
    kept = [first]
    budget = request.memory_budget
    forecast = None
    if budget is not None:
        forecast = budget_forecast(runtime, budget, request.max_new_tokens)
        if forecast is not None:
            emit(runtime.event("forecast", f"memory budget {human_bytes(budget)} forecast to be reached at token "
                                           f"{forecast}"))
    while runtime.generated < request.max_new_tokens:
        if hooks.should_stop():
            emit(runtime.event("stop", f"stopped by the user at token {runtime.generated}"))
            break
        pending = [(k, v) for at, k, v in scripted if at == runtime.generated]
        scripted = [s for s in scripted if s[0] != runtime.generated]
        for key, value in pending:
            emit(runtime.apply(key, value))  # switch, refused or note: one kind of answer for every runtime
        live = getattr(runtime, "apply_live", None)  # a runtime that prepares slow switches off the token path
        for key, value in hooks.poll():
            for sample in (live(key, value) if live is not None else [runtime.apply(key, value)]):
                emit(sample)
        for sample in (runtime.advance() if live is not None else ()):
            emit(sample)  # a prepared switch applies here, at the first token after it is ready
        if hooks.should_stop():
            continue
        full = runtime.room()
        if full is not None:
            emit(runtime.event("note", full))
            break
        if budget is not None:
            _check_budget(runtime, budget, forecast, emit)
        try:
            sample = runtime.step()
        except Exception as exc:
            _out_of_memory(runtime, emit, exc, f"decode at token {runtime.generated + 1}")
            raise
        emit(sample)
        kept = [first, sample]
    return kept


def error_text(exc: BaseException, runtime: Any) -> str:
    """One line for an error event: what failed, where, and under which settings."""
    first = (str(exc).strip().splitlines() or [""])[0][:240]
    what = first if is_user_error(exc) else f"{type(exc).__name__}: {first}"
    try:
        where = runtime.error_context()
    except Exception:  # noqa: BLE001 - a runtime that cannot say where: the failure itself is enough
        return what
    return f"{what} {where}"


# ---------------------------------------------------------------------------------------------------- memory


def budget_forecast(runtime: Any, budget: int, max_tokens: int) -> int | None:
    """The first token, counted like ``Sample.token`` (1 = the first generated token), whose generation
    would need more than ``budget`` bytes (``Runtime.budget_need``, the one rule); None if none of the next
    ``max_tokens`` would. It is the token ``_check_budget`` refuses: the same function of the same numbers."""
    for extra in range(1, max_tokens + 1):
        need = runtime.budget_need(extra)
        if need is None:
            return None
        if need > budget:
            return runtime.generated + extra
    return None


def _check_budget(runtime: Any, budget: int, forecast: int | None, emit: Callable[[Sample], None]) -> None:
    """Before each token: the bytes the next token needs (``Runtime.budget_need``) against the budget."""
    need = runtime.budget_need(1)
    if need is None or need <= budget:
        return
    # Token numbers count like Sample.token: the refused token is the next one, generated + 1;
    # the forecast names the same token (budget_forecast).
    made = runtime.generated
    said = f"the forecast said token {forecast}" if forecast is not None else "the forecast did not expect it"
    text = (f"memory budget {human_bytes(budget)} reached at token {made + 1}, which would need "
            f"{human_bytes(need)}; stopped after {made} generated token{'' if made == 1 else 's'}; {said}")
    emit(runtime.event("budget", text))
    exc = BudgetExceeded(text)
    exc.kvscope_reported = True
    raise exc


def _out_of_memory(runtime: Any, emit: Callable[[Sample], None], exc: BaseException, where: str) -> None:
    """An out-of-memory ``exc`` (the runtime tells): emit the ``oom`` event and raise the run's error."""
    text = runtime.out_of_memory(exc, where)
    if text is None:
        return
    emit(runtime.event("oom", text))
    error = GenerationError(text)
    error.kvscope_reported = True
    raise error from exc

"""The run: an Engine driven for a ``RunRequest`` (scripted and live switches, recording, memory
budget, stop/pause polling), and the checks made before the weights load.

``run_generation`` is what the terminal view (``core.terminal``) and the engine process
(``core.engine_process``) call; errors come back as user-facing exceptions and as ``error``,
``oom`` or ``budget`` events.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from core.attention import SettingsError, Window
from core.engine import Engine, GenerationError, is_oom
from core.measure import cache_bytes
from core.predict import activation_bytes
from core.request import ModelInfo, RunHooks, RunRequest  # noqa: F401 - RunHooks: its old home
from core.sample import Sample
from core.settings import ATTN_IMPLS, attention_choices, cache_choices
from core.spec import ModelSpec, SpecError, human_bytes


class BudgetExceeded(GenerationError):
    """The memory budget would be exceeded by the next token."""


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device == "mps":
        return "Apple GPU (MPS)"
    return "CPU (no GPU: host memory)"


def limit_cpu_threads(device: str) -> int | None:
    """On the CPU leave one core to the window (and the sampler): torch's intra-op threads otherwise
    spin against the GUI thread, and on 2 cores a tiny model runs ~8x slower than on one thread.
    Respects an explicit OMP_NUM_THREADS. Returns the thread count set, or None when left alone."""
    import os

    if device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, (os.cpu_count() or 2) - 1)
    # Only ever lower it, and once: re-sizing the pool from a worker thread would leave pool threads
    # named after that thread behind it. The window calls this on the GUI thread at start-up.
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
    return threads


def model_info(loaded: Any, engine: Engine, probe: Any = None) -> ModelInfo:
    """What can be shown and switched for this loaded model."""
    spec = loaded.spec
    total = None
    if loaded.device.startswith("cuda"):
        total = int(torch.cuda.get_device_properties(torch.device(loaded.device)).total_memory)
    else:
        import psutil

        total = int(psutil.virtual_memory().total)
    return ModelInfo(label=loaded.label, source=loaded.source, device=loaded.device,
                     device_name=_device_name(loaded.device), dtype=loaded.dtype, spec=spec, total_memory=total,
                     attention_choices=attention_choices(spec), cache_choices=cache_choices(loaded.device, spec),
                     attn_impl_choices=ATTN_IMPLS,
                     max_context=engine.max_context())


def run_generation(request: RunRequest, hooks: RunHooks) -> list[Sample]:
    """Load the model, prefill, generate ``max_new_tokens`` tokens with scripted and live switches.

    Every Sample goes to ``hooks.emit`` and, with ``request.record_path``, to the recording
    (written and flushed sample by sample). Returns the prefill and the last decode Sample.
    Raises GenerationError/BudgetExceeded/LoadError/SettingsError with user-facing messages; the
    recording stays complete up to then.
    """
    from core.hf import ensure_transformers
    from core.loading import load_model
    from core.probes import MemoryProbe

    ensure_transformers()
    _check_settings_before_loading(request)
    loaded = load_model(request.source, device=request.device, dtype=request.dtype,
                        trust_remote_code=request.trust_remote_code, allow_pickle=request.allow_pickle,
                        progress=hooks.progress)
    limit_cpu_threads(loaded.device)
    probe = MemoryProbe(device=loaded.device)
    writer = None
    try:
        engine = Engine(loaded, request.settings, probe=probe, seed=request.seed, quality_probe=request.quality_probe)
        engine.progress = hooks.progress
        info = model_info(loaded, engine, probe)
        hooks.loaded(info)
        if request.record_path:
            from core import __version__
            from core.recording import RecordingWriter, header_for

            device = {"name": loaded.device, "device_name": info.device_name, "total_memory": info.total_memory}
            writer = RecordingWriter(request.record_path, header_for(
                loaded.spec, device, _settings_dict(request, engine), __version__), overwrite=request.overwrite)

        def emit(sample: Sample) -> None:
            if writer is not None:
                writer.write(sample)
            hooks.emit(sample)

        emit(engine.event("load", f"loaded {loaded.label} on {info.device_name} ({loaded.dtype})"))
        if request.quality_probe:
            engine.notes.append("quality probe on: every token also runs through a full-cache twin of the model "
                                "(a second forward pass, and a second cache in memory); top-1 agreement and KL per token")
        for note in engine.notes:
            emit(engine.event("note", note))
        snapshot = _start_snapshot(request, loaded.device)
        try:
            kept = _loop(request, engine, hooks, emit, snapshot)
        except Exception as exc:
            if not getattr(exc, "kvscope_reported", False):
                # Errors are data: the recording and the events table get the failure and the settings at
                # that moment before the error reaches the caller (which still fails the run).
                with contextlib.suppress(Exception):
                    emit(engine.event("error", error_text(exc, engine)))
            raise
        if writer is not None:
            # Deleted or replaced while the run wrote to it: writes to an unlinked file succeed, so only
            # its path can tell. Said instead of "recorded to ..." (the terminal and the window alike).
            writer.check_still_there()
        return kept
    finally:
        if writer is not None:
            writer.close()
        probe.close()


def encode_prompt(tokenizer: Any, prompt: str) -> torch.Tensor:
    """The prompt's token ids [1, n], as the run feeds them (with the tokenizer's special tokens)."""
    return tokenizer(prompt, return_tensors="pt", add_special_tokens=True)["input_ids"]


def check_prompt_fits(n_tokens: int, spec: ModelSpec) -> None:
    """Refuse a prompt longer than the model's trained positions (transformers only warns, and runs it).
    Only where the config names its maximum: the 2,048 a spec assumes otherwise is no reason to refuse."""
    from core.spec import declared_max_positions

    limit = declared_max_positions(spec)
    if limit is not None and n_tokens > limit:
        raise GenerationError(f"the prompt is {n_tokens:,} tokens, more than {spec.label}'s maximum of {limit:,} "
                              "(max_position_embeddings); shorten it or use a model with a longer context")


def _check_prompt_before_loading(request: RunRequest, spec: ModelSpec) -> None:
    """The prompt against the model's maximum, before the weights load, where the config is at hand.

    Counting needs the tokenizer (fast to load); it is loaded only when the prompt could be too long:
    a token covers at least one UTF-8 byte, so a prompt of fewer bytes (plus the few special tokens)
    than the maximum always fits. The run checks the count again once loaded (``_loop``)."""
    from pathlib import Path

    if len(request.prompt.encode("utf-8", "surrogatepass")) + 16 <= spec.max_position_embeddings:
        return
    if request.source == "embedded":
        from core.embedded import embedded_model_dir

        folder = embedded_model_dir()
    else:
        folder = Path(request.source).expanduser()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=request.trust_remote_code)
        n_tokens = int(encode_prompt(tokenizer, request.prompt).shape[1])
    except Exception:  # no tokenizer, or one that cannot load: load_model says what is wrong
        return
    check_prompt_fits(n_tokens, spec)


def _check_settings_before_loading(request: RunRequest) -> None:
    """Refuse settings the model cannot take (gqa:3 on 8 heads) before seconds of weight loading.

    Output files first: a ``record_path`` or ``snapshot_path`` that exists (without
    ``request.overwrite``), is a device or a folder, or lies in a missing folder is refused here,
    not after the model has loaded (``core.outputs`` has the rule). Then the settings, only where
    the config is at hand (the embedded model, a local folder); a hub model's config comes with
    its weights, and the engine checks the same again once loaded.
    """
    from pathlib import Path

    from core.outputs import OutputError, check_output_path
    from core.recording import RecordingError
    from core.settings import effective_spec
    from core.spec import SpecError, load_spec, path_kind

    if request.record_path:
        try:
            check_output_path(request.record_path, force=request.overwrite, allow_stdout=False)
        except OutputError as exc:
            raise RecordingError(f"cannot create recording: {exc}") from None
    if request.snapshot_path:
        try:
            check_output_path(request.snapshot_path, force=request.overwrite, allow_stdout=False)
        except OutputError as exc:
            raise SettingsError(f"--snapshot: {exc}") from None
    source = request.source
    try:
        if source != "embedded" and path_kind(Path(source).expanduser(), source) != "dir":
            return
        spec = load_spec(source)
    except SpecError:
        return  # load_model says what is wrong with the source or the folder, with its own message
    effective_spec(spec, request.settings)  # SettingsError: the one-line refusal
    _check_prompt_before_loading(request, spec)


def _settings_dict(request: RunRequest, engine: Engine) -> dict[str, Any]:
    return {
        "attention": engine.mode.key, "attn_impl": engine.settings.attn_impl, "cache": engine.settings.cache.key,
        "batch": engine.settings.batch, "max_new_tokens": request.max_new_tokens,
        "max_context": engine.max_context(), "dtype": engine.loaded.dtype, "source": request.source,
        "switches": [list(s) for s in request.switches], "memory_budget": request.memory_budget,
    }


def _start_snapshot(request: RunRequest, device: str):
    if not request.snapshot_path:
        return None
    if not device.startswith("cuda"):
        raise SettingsError("--snapshot records the CUDA allocator's history; this run is on " + device)
    from core.probes import allocator_snapshot_start

    allocator_snapshot_start()
    return request.snapshot_path


def _loop(request: RunRequest, engine: Engine, hooks: RunHooks, emit: Callable[[Sample], None],
          snapshot: str | None) -> list[Sample]:
    encoded = encode_prompt(engine.loaded.tokenizer, request.prompt)
    if encoded.shape[1] == 0:
        raise GenerationError("the prompt is empty: give at least one token of text")
    check_prompt_fits(int(encoded.shape[1]), engine.spec)  # a hub model's: its spec came with its weights
    # By token, then in the order given: two switches at one token apply as the command line lists them.
    scripted = sorted(request.switches, key=lambda switch: switch[0])
    kept: list[Sample] = []
    try:
        # The batch's copies are the run's first allocation: a batch too large for the device fails here,
        # and takes the out-of-memory path like the prefill ("DefaultCPUAllocator: can't allocate memory").
        ids = encoded.repeat(engine.settings.batch, 1)
        first = engine.prefill(ids, request.prompt)
    except Exception as exc:
        if is_oom(exc):
            return _out_of_memory(engine, emit, exc, "prefill")
        raise
    emit(first)
    kept.append(first)
    run_tokens = engine.seq_len + request.max_new_tokens
    if isinstance(engine.mode, Window) and engine.mode.window - 1 >= run_tokens:
        # Allowed (nothing breaks), but the window never slides: say why the bytes equal full attention's.
        emit(engine.event("note", f"{engine.mode.key} is larger than this run's context ({run_tokens:,} tokens): "
                                  "the cache keeps every token, the same bytes as full attention"))
    budget = request.memory_budget
    if budget is not None:
        forecast = engine.budget_forecast(budget, request.max_new_tokens)
        if forecast is not None:
            emit(engine.event("forecast", f"memory budget {human_bytes(budget)} forecast to be reached at token "
                                          f"{forecast}"))
        engine.budget_forecast_token = forecast
    try:
        while engine.generated < request.max_new_tokens:
            if hooks.should_stop():
                emit(engine.event("stop", f"stopped by the user at token {engine.generated}"))
                break
            pending = [(k, v) for at, k, v in scripted if at == engine.generated]
            scripted = [s for s in scripted if s[0] != engine.generated]
            for key, value in pending + list(hooks.poll()):
                try:
                    emit(engine.apply(key, value))
                except (SettingsError, SpecError) as exc:
                    emit(engine.event("refused", f"{key}={value} refused: {exc}", **engine.switch_fields(key, value)))
            if hooks.should_stop():
                continue
            if budget is not None:
                _check_budget(engine, budget, emit)
            try:
                sample = engine.step()
            except Exception as exc:
                if is_oom(exc):
                    return kept + _out_of_memory(engine, emit, exc, f"decode at token {engine.generated + 1}")
                raise
            emit(sample)
            kept = [first, sample]
    finally:
        if snapshot:
            from core.probes import allocator_snapshot_save

            allocator_snapshot_save(snapshot)
    return kept


def error_text(exc: BaseException, engine: Engine) -> str:
    """One line for an error event: what failed, where, and under which settings."""
    first = (str(exc).strip().splitlines() or [""])[0][:240]
    what = first if isinstance(exc, (GenerationError, SettingsError, SpecError)) else f"{type(exc).__name__}: {first}"
    return (f"{what} (at token {engine.generated}; attention {engine.mode.key}, attn-impl "
            f"{engine.settings.attn_impl}, cache {engine.settings.cache.key})")


def _check_budget(engine: Engine, budget: int, emit: Callable[[Sample], None]) -> None:
    """Before each token: weights + observed KV + next-token KV growth + predicted activations <= budget."""
    n_next = engine.seq_len + 1
    observed = cache_bytes(engine.cache).logical if engine.cache is not None else 0
    growth = engine.predicted_kv(n_next) - engine.predicted_kv()
    need = engine._weights_observed + observed + max(0, growth) + activation_bytes(engine.spec, engine.settings, 1, n_next)
    if need > budget:
        # Token numbers count like Sample.token: the refused token is the next one, generated + 1;
        # the forecast names the same token (Engine.budget_forecast).
        forecast = engine.budget_forecast_token
        made = engine.generated
        said = f"the forecast said token {forecast}" if forecast is not None else "the forecast did not expect it"
        text = (f"memory budget {human_bytes(budget)} reached at token {made + 1}, which would need "
                f"{human_bytes(need)}; stopped after {made} generated token{'' if made == 1 else 's'}; {said}")
        emit(engine.event("budget", text))
        exc = BudgetExceeded(text)
        exc.kvscope_reported = True
        raise exc


def _out_of_memory(engine: Engine, emit: Callable[[Sample], None], exc: BaseException, where: str) -> list[Sample]:
    predicted = engine.predicted_kv() if engine.cache is not None else None
    engine.free_cache()
    text = (f"out of memory in {where} ({str(exc).splitlines()[0][:160]}); cache freed. "
            f"The predictor had said KV {human_bytes(predicted)}")
    sample = engine.event("oom", text)
    emit(sample)
    exc = GenerationError(text)
    exc.kvscope_reported = True
    raise exc

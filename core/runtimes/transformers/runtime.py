"""The transformers runtime: ``kvscope.core.runtimes.transformers.engine.Engine`` (the model in torch) behind the ``Runtime`` seam.

Everything that is transformers' own lives here: the checks made before the weights load (output files,
settings against the config, the prompt against the trained positions), the model's info and the
recording's settings, the CUDA allocator snapshot, the memory budget's arithmetic (``kvscope.core.prediction.forecast``'s one
rule) and the out-of-memory path. The run loop is ``kvscope.core.live.run.run_generation``, shared with every runtime.

Imports torch: only the engine's side (the engine process, ``run`` in the terminal) opens it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

import kvscope.core.runtimes.transformers.loading  # called as kvscope.core.runtimes.transformers.loading.load_model: looked up when a run loads
from kvscope.core.base.errors import one_line as _one_line
from kvscope.core.base.sample import Sample
from kvscope.core.model.attention import SettingsError, Window
from kvscope.core.model.embedded import embedded_model_dir
from kvscope.core.model.hf import ensure_transformers
from kvscope.core.model.request import ModelInfo, RunRequest
from kvscope.core.model.settings import ATTN_IMPLS, attention_choices, cache_choices, effective_spec
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import ModelSpec, SpecError, declared_max_positions, human_bytes, path_kind
from kvscope.core.prediction.forecast import budget_used
from kvscope.core.prediction.predict import activation_bytes
from kvscope.core.records.outputs import OutputError, check_output_path
from kvscope.core.runtimes.probes import MemoryProbe, allocator_snapshot_save, allocator_snapshot_start
from kvscope.core.runtimes.transformers.engine import Engine, GenerationError
from kvscope.core.runtimes.transformers.measure import cache_bytes
from kvscope.core.runtimes.transformers.refusal import is_oom

NAME = "transformers"


def limit_cpu_threads(device: str) -> int | None:
    """On the CPU leave one core to the window (and the sampler): torch's intra-op threads otherwise
    spin against the GUI thread, and on 2 cores a tiny model runs ~8x slower than on one thread.
    Respects an explicit OMP_NUM_THREADS. Returns the thread count set, or None when left alone."""
    if device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, (os.cpu_count() or 2) - 1)
    # Only ever lower it, and once: re-sizing the pool from a worker thread would leave pool threads
    # named after that thread behind it. The window calls this on the GUI thread at start-up.
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
    return threads


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device == "mps":
        return "Apple GPU (MPS)"
    return "CPU (no GPU: host memory)"


def encode_prompt(tokenizer: Any, prompt: str) -> torch.Tensor:
    """The prompt's token ids [1, n], as the run feeds them (with the tokenizer's special tokens)."""
    return tokenizer(prompt, return_tensors="pt", add_special_tokens=True)["input_ids"]


def check_prompt_fits(n_tokens: int, spec: ModelSpec) -> None:
    """Refuse a prompt longer than the model's trained positions (transformers only warns, and runs it).
    Only where the config names its maximum: the 2,048 a spec assumes otherwise is no reason to refuse."""
    limit = declared_max_positions(spec)
    if limit is not None and n_tokens > limit:
        raise GenerationError(f"the prompt is {n_tokens:,} tokens, more than {spec.label}'s maximum of {limit:,} "
                              "(max_position_embeddings); shorten it or use a model with a longer context")


def _check_prompt_before_loading(request: RunRequest, spec: ModelSpec) -> None:
    """The prompt against the model's maximum, before the weights load, where the config is at hand.

    Counting needs the tokenizer (fast to load); it is loaded only when the prompt could be too long:
    a token covers at least one UTF-8 byte, so a prompt of fewer bytes (plus the few special tokens)
    than the maximum always fits. The run checks the count again once loaded (``prefill``)."""
    if len(request.prompt.encode("utf-8", "surrogatepass")) + 16 <= spec.max_position_embeddings:
        return
    if request.source == "embedded":
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

    Only where the config is at hand (the embedded model, a local folder); a hub model's config comes
    with its weights, and the engine checks the same again once loaded."""
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


#: Models loaded ahead of their run (``preload_model``), by what ``load_model`` is asked.
_preloaded: dict[tuple, Any] = {}


def _load_key(request: RunRequest) -> tuple:
    return (request.source, request.device, request.dtype, request.trust_remote_code, request.allow_pickle)


def preload_model(request: RunRequest) -> None:
    """Load the model of a run about to be asked for (the window's first run, while the window is still starting:
    ``kvscope.core.live.engine_process.spawn_early``); that run's ``load`` takes it. A model that fails to load here is left
    to the run, which says why."""
    from kvscope.core.runtimes.transformers.loading import load_model

    try:
        _check_settings_before_loading(request)
        _preloaded[_load_key(request)] = load_model(
            request.source, device=request.device, dtype=request.dtype, trust_remote_code=request.trust_remote_code,
            allow_pickle=request.allow_pickle)
    except Exception:  # noqa: BLE001 - the run loads it again and reports the error itself
        _preloaded.clear()


class TransformersRuntime:
    """``kvscope.core.runtimes.transformers.engine.Engine`` as a ``kvscope.core.runtimes.base.Runtime``."""

    name = NAME
    #: The model runs in the run loop's process: its resident set is this process's (kvscope.core.base.host_memory).
    runs_in_this_process = True

    def __init__(self, request: RunRequest, progress: Callable[[str], None]) -> None:
        self.request = request
        self.progress = progress
        self.spec: ModelSpec | None = None
        self.engine: Engine | None = None
        self.loaded: Any = None
        self.probe: Any = None
        self._snapshot: str | None = None
        self._kv_now: tuple[int, int, int] | None = None  # (seq_len, observed, predicted): the budget's "now"
        self._prepared: Any = None  # a live switch whose re-run runs off the token path (kvscope.core.runtimes.transformers.rerun.PreparedSwitch)
        self._held: dict[str, tuple[str, str]] = {}  # presses on other axes, waiting for it

    @classmethod
    def around(cls, engine: Engine, request: RunRequest) -> "TransformersRuntime":
        """A runtime around an Engine already made (a test's, a benchmark's), as if ``load()`` had made it."""
        runtime = cls(request, engine.progress)
        runtime.engine, runtime.loaded, runtime.spec, runtime.probe = engine, engine.loaded, engine.spec, engine.probe
        runtime._count_ahead()
        return runtime

    def _count_ahead(self) -> None:
        """Tell the engine how many tokens the run will still generate (a static cache switched to must hold them)."""
        engine, total = self.engine, self.request.max_new_tokens
        engine.tokens_ahead = lambda: max(total - engine.generated, 0)

    @property
    def generated(self) -> int:
        return self.engine.generated if self.engine is not None else 0

    # ------------------------------------------------------------------------------------ load

    def load(self) -> None:
        r = self.request
        self.loaded = _preloaded.pop(_load_key(r), None)  # loaded ahead (the window's first run), used once
        _preloaded.clear()
        if self.loaded is None:
            self.loaded = kvscope.core.runtimes.transformers.loading.load_model(
                r.source, device=r.device, dtype=r.dtype, trust_remote_code=r.trust_remote_code,
                allow_pickle=r.allow_pickle, progress=self.progress)
        self.spec = self.loaded.spec
        limit_cpu_threads(self.loaded.device)
        self.probe = MemoryProbe(device=self.loaded.device)
        self.engine = Engine(self.loaded, r.settings, probe=self.probe, seed=r.seed, quality_probe=r.quality_probe)
        self.engine.progress = self.progress
        self._count_ahead()
        if r.snapshot_path:
            if not self.loaded.device.startswith("cuda"):
                raise SettingsError("--snapshot records the CUDA allocator's history; this run is on "
                                    + self.loaded.device)

            allocator_snapshot_start()
            self._snapshot = r.snapshot_path

    def model_info(self) -> ModelInfo:
        loaded, spec = self.loaded, self.loaded.spec
        if loaded.device.startswith("cuda"):
            total = int(torch.cuda.get_device_properties(torch.device(loaded.device)).total_memory)
        else:
            import psutil

            try:
                total = int(psutil.virtual_memory().total)
            except (psutil.Error, OSError):  # no /proc (a chroot, issue 38): not available
                total = None
        return ModelInfo(label=loaded.label, source=loaded.source, device=loaded.device,
                         device_name=_device_name(loaded.device), dtype=loaded.dtype, spec=spec, total_memory=total,
                         attention_choices=attention_choices(spec), cache_choices=cache_choices(loaded.device, spec),
                         attn_impl_choices=ATTN_IMPLS, max_context=self.engine.max_context(), runtime=NAME)

    def settings(self, request: RunRequest) -> dict[str, Any]:
        e = self.engine
        return {
            "runtime": NAME, "attention": e.mode.key, "attn_impl": e.settings.attn_impl, "cache": e.settings.cache.key,
            "batch": e.settings.batch, "max_new_tokens": request.max_new_tokens, "max_context": e.max_context(),
            "dtype": e.loaded.dtype, "source": request.source, "switches": [list(s) for s in request.switches],
            "memory_budget": request.memory_budget,
        }

    def start_events(self, request: RunRequest) -> list[Sample]:
        e = self.engine
        name = request.label or self.loaded.label  # as the user names it (an installed model's repo id), else its own
        out = [e.event("load", f"loaded {name} on {_device_name(self.loaded.device)} ({self.loaded.dtype})")]
        if request.quality_probe:
            e.notes.append("quality probe on: every token is compared with the model as loaded (its own K/V "
                           "projections, attention and layer pattern, a full dynamic cache, its default kernel), "
                           "teacher-forced on the same tokens, whatever is switched: one more decode step per token "
                           "and a second cache, not counted in the KV figures; top-1 agreement and KL per token")
        out += [e.event("note", note) for note in e.notes]
        return out

    # ------------------------------------------------------------------------------------ tokens

    def prefill(self, request: RunRequest) -> list[Sample]:
        e = self.engine
        encoded = encode_prompt(e.loaded.tokenizer, request.prompt)
        if encoded.shape[1] == 0:
            raise GenerationError("the prompt is empty: give at least one token of text")
        check_prompt_fits(int(encoded.shape[1]), e.spec)  # a hub model's: its spec came with its weights
        # The batch's copies are the run's first allocation: a batch too large for the device fails here,
        # and takes the out-of-memory path like the prefill ("DefaultCPUAllocator: can't allocate memory").
        ids = encoded.repeat(e.settings.batch, 1)
        noted = len(e.notes)
        out = [e.prefill(ids, request.prompt)]
        out += [e.event("note", note) for note in e.notes[noted:]]  # the prefill's own (an aligned merge calibrated)
        run_tokens = e.seq_len + request.max_new_tokens
        if isinstance(e.mode, Window) and e.mode.window - 1 >= run_tokens:
            # Allowed (nothing breaks), but the window never slides: say why the bytes equal full attention's.
            out.append(e.event("note", f"{e.mode.key} is larger than this run's context ({run_tokens:,} tokens): "
                                       "the cache keeps every token, the same bytes as full attention"))
        return out

    def step(self) -> Sample:
        return self.engine.step()

    def apply(self, key: str, value: str) -> Sample:
        e = self.engine
        try:
            return e.apply(key, value)
        except (SettingsError, SpecError) as exc:  # the engine undid everything: one refused event, as every runtime
            return e.event("refused", f"{key}={value} refused: {exc}", **e.switch_fields(key, value))

    def apply_live(self, key: str, value: str) -> list[Sample]:
        """A switch pressed during the run: one that re-runs the tokens so far is prepared off the token path
        (``kvscope.core.runtimes.transformers.rerun``: the run goes on under the current settings, the status line shows the progress, and
        the switch applies at a later token, from ``advance``). While one is prepared, a press on its axis
        replaces it (back to the running setting: cancelled, a "no change" answer) and a press on another
        axis waits for it (the last per axis). Returns the event Samples to emit now."""
        prepared = self._prepared
        if prepared is not None:
            asked = self.engine.switch_fields(key, value)
            axis, wanted = asked["switch_key"], asked["switch_after"]
            if axis != prepared.axis:
                self._held.pop(axis, None)
                self._held[axis] = (key, value)
                return []
            if wanted == prepared.wanted:
                return []  # that very switch is under way
            prepared.cancel()
            self._prepared = None
            self.progress(f"{prepared.what}: replaced by a newer press before it applied")
        e = self.engine
        try:
            answer = e.begin_switch(key, value)
        except (SettingsError, SpecError) as exc:
            return [e.event("refused", f"{key}={value} refused: {exc}", **e.switch_fields(key, value))]
        except Exception as exc:  # noqa: BLE001 - a switch that fails is a refusal; the run goes on (issue 37)
            # begin_switch converts a shadow and leaves the running engine as it was (its cache fields put back),
            # so a failure it did not foresee still leaves a run that can go on under the settings in force.
            return [e.event("refused", f"{key}={value} refused: {_one_line(exc)}", **e.switch_fields(key, value))]
        if isinstance(answer, Sample):
            return [answer]
        self._prepared = answer
        return []

    def advance(self) -> list[Sample]:
        """Between two tokens: the prepared switch's answer once it applies (then the presses that waited for
        it), else nothing."""
        prepared = self._prepared
        if prepared is None:
            return []
        e = self.engine
        try:
            answer = e.advance_switch(prepared)
        except (SettingsError, SpecError) as exc:
            answer = e.event("refused", f"{prepared.key}={prepared.value} refused: {exc}", **prepared.fields)
        except Exception as exc:  # noqa: BLE001 - the shadow failed before it became the engine: the run goes on
            answer = e.event("refused", f"{prepared.key}={prepared.value} refused: {_one_line(exc)}", **prepared.fields)
        if answer is None:
            return []
        self._prepared = None
        out = [answer]
        held, self._held = self._held, {}
        for key, value in held.values():
            out += self.apply_live(key, value)
        return out

    def event(self, kind: str, text: str, **fields: Any) -> Sample:
        return self.engine.event(kind, text, **fields)

    def room(self) -> str | None:
        return None  # transformers' caches grow (or slide) as long as memory lasts: memory says when to stop

    # ------------------------------------------------------------------------------------ memory

    def plan(self, tokens: int) -> int | None:
        return self.engine.predicted_kv(tokens) if self.engine is not None else None

    def budget_need(self, ahead: int) -> int | None:
        """``kvscope.core.prediction.forecast.budget_used`` once ``ahead`` more tokens are in the context: the weights as measured,
        the KV cache as measured now plus the predictor's growth over those tokens, the decode's predicted
        activations at that length."""
        e = self.engine
        tokens = e.seq_len + ahead
        if self._kv_now is None or self._kv_now[0] != e.seq_len:
            observed = cache_bytes(e.cache).logical if e.cache is not None else 0
            self._kv_now = (e.seq_len, observed, e.predicted_kv())
        _, observed, predicted_now = self._kv_now
        growth = max(0, e.predicted_kv(tokens) - predicted_now)
        return budget_used(e._weights_observed, observed + growth, activation_bytes(e.spec, e.settings, 1, tokens))

    def out_of_memory(self, exc: BaseException, where: str) -> str | None:
        if not is_oom(exc) or self.engine is None:
            return None
        e = self.engine
        predicted = e.predicted_kv() if e.cache is not None else None
        e.free_cache()
        return (f"out of memory in {where} ({str(exc).splitlines()[0][:160]}); cache freed. "
                f"The predictor had said KV {human_bytes(predicted)}")

    def error_context(self) -> str:
        e = self.engine
        return (f"(at token {e.generated}; attention {e.mode.key}, attn-impl {e.settings.attn_impl}, "
                f"cache {e.settings.cache.key})")

    def close(self) -> None:
        if self._prepared is not None:  # the run ended before the prepared switch applied
            self._prepared.cancel()
            self._prepared = None
        if self._snapshot:
            snapshot, self._snapshot = self._snapshot, None
            allocator_snapshot_save(snapshot)
        if self.probe is not None:
            self.probe.close()
            self.probe = None


def open_runtime(request: RunRequest, progress: Callable[[str], None]) -> TransformersRuntime:
    """Checks before the weights load (settings against the config, the prompt, the snapshot's path), then a
    TransformersRuntime to ``load()``."""
    ensure_transformers()
    _check_settings_before_loading(request)
    return TransformersRuntime(request, progress)

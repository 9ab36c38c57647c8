"""The measuring engine: a real model generating token by token, every byte measured and predicted.

``Engine`` owns the model, the live cache and the token ids. ``prefill()`` and ``step()`` each
produce one ``Sample``; ``apply(key, value)`` switches attention mode, attention implementation
or cache strategy between two tokens and returns the event ``Sample`` that marks it.
``kvscope.core.live.run.run_generation`` drives an Engine for a ``RunRequest``.

The Engine keeps prefill, step and measurement. What a switch changes is one value, ``self.state``
(``state.EngineState``: the model, mode, settings, kernel and cache), which a re-run's shadow copies and hands
back; the switch's rules are the light half's (``switches.plan``, the window's too), its transaction
``switch.apply``, its conversions ``conversions.py`` (on top of ``convert.py``), the undo ``transaction.py``;
the run loop is core/live/run.py.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Callable

import torch

from kvscope.core.base.errors import (  # noqa: F401 - its old home: `from kvscope.core.runtimes.transformers.engine import GenerationError`
    GenerationError)
from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from kvscope.core.model.attention import SettingsError, native_attention
from kvscope.core.model.caches import Quantized, Static
from kvscope.core.model.settings import RunSettings, effective_spec
from kvscope.core.model.spec import ModelSpec, SpecError
from kvscope.core.prediction.predict import kv_bytes, kv_elem_bytes, predict
from kvscope.core.runtimes.transformers import caches, conversions, predicted, quality, switch, switches
from kvscope.core.runtimes.transformers.kernels import measure_kernel
from kvscope.core.runtimes.transformers.measure import cache_bytes, model_weight_bytes
from kvscope.core.runtimes.transformers.peak import measure_peak
from kvscope.core.runtimes.transformers.state import EngineState, StateField

TOP_K = 40


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))
    elif device == "mps":
        torch.mps.synchronize()


class Engine:
    """A loaded model, its live cache and the tokens so far. Not thread-safe: one thread drives it (a switch's
    re-run prepared by ``begin_switch`` runs on a shadow of it, with models of its own, on a thread of its own)."""

    #: A shadow engine (``begin_switch``) leaves the re-run's forward pass to its background thread.
    _defer_rerun = False
    _rerun_why: str | None = None
    #: What a switch changes: fields of ``self.state`` (``state.EngineState``).
    model, base_model, mode, settings = (StateField("model"), StateField("base_model"), StateField("mode"),
                                         StateField("settings"))
    kernel, cache, cache_base_tokens = StateField("kernel"), StateField("cache"), StateField("cache_base_tokens")
    _next_logits, _weights_observed = StateField("next_logits"), StateField("weights_observed")
    _tokens_rerun = StateField("tokens_rerun")

    def __init__(self, loaded: Any, settings: RunSettings, probe: Any = None, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter, quality_probe: bool = False) -> None:
        self.loaded = loaded
        self.spec: ModelSpec = loaded.spec
        self.device: str = loaded.device
        self.state = EngineState(model=loaded.model, base_model=loaded.model, mode=native_attention(self.spec),
                                 settings=settings.with_(weight_dtype=loaded.dtype, kv_dtype=None))
        self.probe = probe
        self.clock = clock
        #: One line before work that takes long between two tokens (re-running every token so far).
        self.progress: Callable[[str], None] = lambda text: None
        self.t0 = clock()
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        #: One line each about a setting the engine adjusted; run_generation emits them as "note" events.
        self.notes: list[str] = list(getattr(loaded, "notes", ()))  # the load's own (the embedded fallback)
        limit = self.spec.max_position_embeddings
        if settings.max_context is not None and settings.max_context > limit:
            # Clamped, not refused: the window remembers its max-context across models, and a
            # static cache beyond the trained positions would only hold memory no token can use.
            self.notes.append(f"max context {settings.max_context:,} is beyond {self.spec.label}'s maximum of "
                              f"{limit:,} tokens (max_position_embeddings): using {limit:,}")
            self.settings = self.settings.with_(max_context=limit)
        self.ids: torch.Tensor | None = None
        self.prompt_tokens = 0
        self.generated = 0
        #: The tokens the run will still generate (its host sets it: a static cache switched to must hold them).
        self.tokens_ahead: Callable[[], int] = lambda: 0
        self.tokens_per_s: float | None = None
        self._last_step_s: float | None = None
        self._weights_observed = model_weight_bytes(self.model)
        self._pending_ids: list[int] = []
        #: The quality probe (off by default: it costs a decode step of the loaded model per token and a second
        #: cache): the same tokens, teacher-forced, through the model as loaded (core/runtimes/transformers/reference.py),
        #: taken below before any conversion.
        self.quality_probe = quality_probe
        self._reference = None
        self._reference_problem: str | None = None
        # The embedded demo model is tiny (and, as a fallback, random): left alone it can sample lone UTF-8
        # continuation bytes and control characters, which print as U+FFFD or nothing; its text reads
        # better without them (real models: untouched).
        self._suppressed = self._broken_byte_tokens() if loaded.label.startswith("embedded demo model") else None
        from kvscope.core.runtimes.transformers import (
            convert)  # transformers, a 9 s import: not when serve() imports this module

        #: The model's own sliding/full layers, put back when a mode that changed them is left.
        self._native_pattern = convert.layer_pattern(self.base_model)
        #: The model's own K/V projections, the tensors as loaded (by reference): every head change starts from
        #: them, and going back to the model's own heads puts them back (None: heads that cannot be regrouped).
        #: Never changed after this (not in the state): a refused switch leaves them as they are.
        self._kv_origin = convert.keep_kv_projections(self.base_model)
        #: The aligned merge's calibration (``merge.Calibration`` per layer: Gram matrices of the model's own K/V,
        #: from the last cache that held them), for merges made when the cache holds merged heads.
        self._merge_calibration: dict[int, Any] = {}
        if quality_probe:  # the model as loaded, before the starting settings convert it
            quality.keep_reference(self)
        switch.start(self, settings)  # the starting settings, checked as a whole, applied before the prefill

    # ---------------------------------------------------------------------------------- settings

    @property
    def seq_len(self) -> int:
        return 0 if self.ids is None else int(self.ids.shape[1])

    def max_context(self) -> int:
        """What a static cache preallocates: the setting, else the model's maximum."""
        return int(self.settings.max_context or self.spec.max_position_embeddings)

    def _kernel_context(self):
        if self.kernel == "sdpa-flash":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        return contextlib.nullcontext()

    def _forward_context(self) -> contextlib.ExitStack:
        """What a forward pass of the current model on the live cache runs in: the kernel's context, and
        the cache strategy's (the h2o cache's attention hooks)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._kernel_context())
        if self.cache is not None:
            stack.enter_context(caches.forward_context(self.settings.cache, self.model, self.cache))
        return stack

    def _layer_pattern_model(self, eff: ModelSpec):
        """The base model with the sliding/full layers ``eff`` describes (``conversions.layer_pattern_model``)."""
        return conversions.layer_pattern_model(self, eff)

    def apply(self, key: str, value: Any) -> Sample:
        """Switch a setting between two tokens, all or nothing (``switch.apply``); returns the event Sample.

        The plan (attention x kernel x cache x architecture: ``switches.plan``) is checked first; then the model
        and the cache are converted together and tried on one forward pass (which is then undone). Any failure
        restores the previous state exactly and raises SettingsError with the reason, so the run goes on as
        before. A switch to the current setting changes nothing and returns a ``note`` event that says so."""
        return switch.apply(self, key, value)

    def begin_switch(self, key: str, value: Any) -> Any:
        """Start a live switch whose re-run, if it needs one, runs off the token path (``kvscope.core.runtimes.transformers.rerun.begin``):
        returns its event Sample when it applied at once, else a ``kvscope.core.runtimes.transformers.rerun.PreparedSwitch`` for
        ``advance_switch``. SettingsError: refused, nothing changed."""
        from kvscope.core.runtimes.transformers import rerun

        return rerun.begin(self, key, value)

    def advance_switch(self, prepared: Any) -> Sample | None:
        """Between two tokens: the prepared switch's event Sample once it applies, else None (``kvscope.core.runtimes.transformers.rerun.advance``)."""
        from kvscope.core.runtimes.transformers import rerun

        return rerun.advance(self, prepared)

    def _trial_step(self) -> None:
        """Run one forward pass on the converted model and cache, then undo what it added to the cache:
        a switch that transformers would refuse at the next token is refused now, with nothing changed.
        The pass is profiled: ``self.kernel`` becomes the attention kernel PyTorch really dispatched."""
        from kvscope.core.runtimes.transformers.transaction import (
            CacheSnapshot)  # transformers, a 9 s import: not when serve() imports this module

        if self.cache is None or self.ids is None or not self.seq_len:
            return

        with torch.inference_mode():  # the cache's tensors are inference tensors: undo in the same mode
            undo = CacheSnapshot(self.cache)
            try:
                with self._forward_context():
                    measured = measure_kernel(lambda: self.model(input_ids=self.ids[:, -1:], cache=self.cache,
                                                                 use_cache=True, logits_to_keep=1))
            finally:
                undo.restore()
        if measured is not None:
            self.kernel = measured

    # ---------------------------------------------------------------------------------- tokens

    def prefill(self, prompt_ids: torch.Tensor, text: str) -> Sample:
        """Run the prompt (ids [batch, n]) through the model; the cache is built here."""
        if prompt_ids.ndim != 2 or prompt_ids.shape[1] == 0:
            raise GenerationError("the prompt is empty: give at least one token of text")
        if isinstance(self.settings.cache, Static) and prompt_ids.shape[1] >= self.max_context():
            raise GenerationError(f"the prompt ({prompt_ids.shape[1]:,} tokens) does not fit a static cache of "
                                  f"{self.max_context():,}; raise --max-context")
        if isinstance(self.settings.cache, Quantized):
            why = switches.quantized_shape_problem(effective_spec(self.spec, self.settings), self.settings.cache,
                                                   kv_elem_bytes(self.spec, self.settings), int(prompt_ids.shape[1]),
                                                   self.max_context(), self.mode.key)
            if why:
                raise SettingsError(why)
        calibrated = conversions.calibrate_merge(self, prompt_ids)
        if calibrated:
            self.notes.append(calibrated)
        self.ids = prompt_ids.to(self.device)
        self.prompt_tokens = int(prompt_ids.shape[1])
        self.cache = conversions.new_cache(self)
        self.cache_base_tokens = self.prompt_tokens
        self._reset_peak()
        t = self.clock()
        with torch.inference_mode(), self._forward_context():
            out = self._measured_forward()
        _sync(self.device)
        dt = self.clock() - t
        self._next_logits = out.logits[:, -1, :].float()
        self._trial_step()  # measures the attention kernel a decode step runs (untimed, undone)
        return self._sample(PHASE_PREFILL, text, step_s=dt, **quality.quality_now(self), **self._take_peak())

    def _broken_byte_tokens(self) -> torch.Tensor:
        tok = self.loaded.tokenizer
        def broken(text: str) -> bool:
            return any(ch == "\ufffd" or (not ch.isprintable() and ch not in "\n\t") for ch in text)

        bad = [i for i in range(self.spec.vocab_size) if broken(tok.decode([i]))]
        return torch.tensor(bad, dtype=torch.long)

    def _sample_next(self) -> torch.Tensor:
        logits = self._next_logits
        if self._suppressed is not None and len(self._suppressed):
            logits = logits.clone()
            logits[:, self._suppressed.to(logits.device)] = float("-inf")
        top = torch.topk(logits, k=min(TOP_K, logits.shape[-1]), dim=-1)
        probs = torch.softmax(top.values.cpu(), dim=-1)
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return top.indices.cpu().gather(-1, choice).to(self.device)

    def step(self) -> Sample:
        """Generate one token (for every sequence of the batch) and measure."""
        if self._next_logits is None or self.ids is None:
            raise GenerationError("prefill first")
        if isinstance(self.settings.cache, Static) and self.seq_len >= self.max_context():
            raise GenerationError(f"the static cache is full at {self.max_context():,} tokens (its preallocated size)")
        token = self._sample_next()
        self._reset_peak()
        t = self.clock()
        with torch.inference_mode(), self._forward_context():
            out, profiled = self._decode_forward(token)
        _sync(self.device)
        dt = self.clock() - t
        self.ids = torch.cat([self.ids, token], dim=1)
        self._next_logits = out.logits[:, -1, :].float()
        self.generated += 1
        rate = 1.0 / dt if dt > 0 and not profiled else None  # a profiled step's time is the profiler's too
        if rate is not None:
            self.tokens_per_s = rate if self.tokens_per_s is None else 0.8 * self.tokens_per_s + 0.2 * rate
        return self._sample(PHASE_DECODE, self._text_piece(int(token[0, 0])), step_s=dt, **quality.quality_now(self),
                            **self._take_peak())

    # ---------------------------------------------------------------------------------- quality probe

    def _text_piece(self, token_id: int) -> str:
        """Text of the newest token of sequence 0. Byte-level tokens can split a UTF-8 character, so
        bytes that do not decode yet are held back (up to 8 tokens) and come out with the next token."""
        self._pending_ids.append(token_id)
        text = self.loaded.tokenizer.decode(self._pending_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and len(self._pending_ids) < 8:
            return ""
        self._pending_ids = []
        return text

    def _measured_forward(self) -> Any:
        """Every token so far through the model into the (empty) cache, as generate()'s prefill calls it, with the
        allocator's peak above the start measured (kvscope.core.runtimes.transformers.peak) and predicted (kvscope.core.prediction.predict.prefill_peak) for the
        next Sample (``_take_peak``)."""
        out, reading = measure_peak(lambda: self.model(input_ids=self.ids, cache=self.cache, use_cache=True,
                                                       logits_to_keep=1), self.device)
        self._peak_fields = {"peak_bytes_observed": reading.peak if reading else None,
                             "peak_bytes_predicted": predicted.predicted_peak(self, self.seq_len, 0)}
        self._decode_peak_due = True  # the next decode step is measured too
        return out

    #: On the CPU a decode step's peak is measured under the profiler (kvscope.core.runtimes.transformers.peak), which costs
    #: more than the step: at the first step after each prefill or re-run, a step soon after each switch, and besides
    #: at most every DECODE_PEAK_EVERY tokens while the profiler's extra time stays under DECODE_PEAK_SHARE of the
    #: decode time (kvscope.core.runtimes.transformers.peak_cadence, its cost measured each time). On CUDA, every step
    #: (the allocator's counters cost nothing).
    DECODE_PEAK_EVERY = 64
    DECODE_PEAK_SHARE = 0.03

    def _peak_cadence(self):
        """This engine's schedule of measured decode steps (made at the first step; a shadow engine never steps)."""
        from kvscope.core.runtimes.transformers.peak_cadence import PeakCadence

        cadence = self.__dict__.get("_decode_peak_cadence")
        if cadence is None:
            cadence = self._decode_peak_cadence = PeakCadence(every=self.DECODE_PEAK_EVERY,
                                                              share=self.DECODE_PEAK_SHARE)
        return cadence

    def _decode_forward(self, token: torch.Tensor) -> tuple[Any, bool]:
        """One decode step, its allocator peak above the start measured and predicted (kvscope.core.prediction.predict.decode_peak) for
        the step's Sample when due; returns the output and whether the profiler ran."""
        from kvscope.core.runtimes.transformers.peak import adopt_dynamic_cache, measure_peak

        call = lambda: self.model(input_ids=token, cache=self.cache, use_cache=True, logits_to_keep=1)  # noqa: E731
        if self.device.startswith("cuda"):
            out, reading = measure_peak(call, self.device)
            self._peak_fields = {"peak_bytes_observed": reading.peak if reading else None,
                                 "peak_bytes_predicted": predicted.predicted_peak(self, 1, self.seq_len)}
            return out, False
        cadence = self._peak_cadence()
        t = self.clock()
        due = self.device == "cpu" and cadence.due(self.settings, forced=getattr(self, "_decode_peak_due", False))
        adopt = adopt_dynamic_cache(self.cache) if due else None
        if adopt is None:  # not due, or a cache the CPU measurement cannot follow (sliding, quantized): not measured
            out = call()
            cadence.plain(self.clock() - t)
            return out, False
        # Never waiting on the token path: while a re-run's pass is measured on its thread, this step is not.
        out, reading = measure_peak(call, self.device, adopt=adopt, wait=False)
        if reading is None:
            self._decode_peak_due = True  # measured at the next step instead
            cadence.plain(self.clock() - t)
            return out, False
        self._decode_peak_due = False
        self._peak_fields = {"peak_bytes_observed": reading.peak,
                             "peak_bytes_predicted": predicted.predicted_peak(self, 1, self.seq_len)}
        cadence.measured(self.clock() - t, self.settings)
        return out, True

    def _take_peak(self) -> dict[str, Any]:
        """The last measured forward pass's peak fields, once (the prefill's or the switch's re-run)."""
        fields, self._peak_fields = getattr(self, "_peak_fields", {}), {}
        return fields

    def _reset_peak(self) -> None:
        if self.probe is not None and hasattr(self.probe, "reset_peak"):
            self.probe.reset_peak()

    def predicted_kv(self, tokens: int | None = None) -> int:
        """Predicted KV bytes after ``tokens`` tokens (default: now) under the current settings."""
        n = self.seq_len if tokens is None else tokens
        return kv_bytes(self.spec, predicted.prediction_settings(self), n, prompt_tokens=min(self.cache_base_tokens, n))

    def _sample(self, phase: str, text: str, event: str | None = None, step_s: float | None = None,
                **switch: Any) -> Sample:
        observed = cache_bytes(self.cache) if self.cache is not None else None
        reading = self.probe.read() if self.probe is not None else None
        n = self.seq_len
        pred = predict(self.spec, predicted.prediction_settings(self), max(n, 1),
                       prompt_tokens=min(self.cache_base_tokens, max(n, 1)) or None)
        kv_pred = pred.breakdown.kv_cache if self.cache is not None and n > 0 else 0
        act = predicted.predicted_activations(self, phase, n, bool(switch.get("tokens_rerun")), pred)
        return Sample(
            token=self.generated,
            phase=phase,
            time_s=self.clock() - self.t0,
            text=text,
            attention=self.mode.key,
            attn_impl=self.settings.attn_impl,
            cache=self.settings.cache.key,
            kernel=self.kernel,
            device=self.device,
            dtype=self.loaded.dtype,
            # transformers reserves nothing ahead of the tokens: the cache's tensors are both figures
            kv_bytes_held=observed.logical if observed else (0 if self.cache is None else None),
            kv_bytes_reserved=observed.logical if observed else (0 if self.cache is None else None),
            kv_bytes_storage=observed.storage if observed else None,
            weights_bytes=self._weights_observed,
            allocator_allocated=getattr(reading, "allocator_allocated", None),
            allocator_reserved=getattr(reading, "allocator_reserved", None),
            allocator_peak=getattr(reading, "allocator_peak", None),
            device_used=getattr(reading, "device_used", None),
            device_total=getattr(reading, "device_total", None),
            process_gpu=getattr(reading, "process_gpu", None),
            process_rss=getattr(reading, "process_rss", None),
            kv_bytes_predicted=kv_pred,
            weights_predicted=pred.breakdown.weights,
            activations_predicted=act,
            total_predicted=(pred.breakdown.weights or 0) + kv_pred + act,
            tokens_per_s=self.tokens_per_s,
            event=event,
            context_tokens=n,
            **switch,
        )

    def event(self, kind: str, text: str, **switch: Any) -> Sample:
        """An event Sample (load, error, oom, budget...) carrying the current measurements; a refused
        switch passes ``switch_key``, ``switch_before`` and ``switch_after`` as well."""
        return self._sample(PHASE_EVENT, text, event=kind, **switch)

    def _settings_now(self) -> dict[str, str]:
        """The three switchable settings, keyed as ``parse_switch_value`` names them."""
        return {"attention": self.mode.key, "attn_impl": self.settings.attn_impl, "cache": self.settings.cache.key}

    def _asked(self, key: str, value: Any) -> tuple[str, Any, dict[str, Any]]:
        """A switch asked as ``key=value``: the setting's name, the parsed value, and its ``switch_key`` /
        ``switch_before`` / ``switch_after`` fields in canonical spellings. SettingsError if it does not parse."""
        name, parsed = switches.parse_switch_value(key, value) if isinstance(value, str) else (
            {"attention": "attention", "cache": "cache"}.get(key, "attn_impl"), value)
        wanted = parsed if name == "attn_impl" else parsed.key
        return name, parsed, {"switch_key": name.replace("_", "-"), "switch_before": self._settings_now()[name],
                              "switch_after": wanted}

    def switch_fields(self, key: str, value: Any) -> dict[str, Any]:
        """The switch fields of ``key=value`` for a refusal event (a value that does not parse is kept as written)."""
        try:
            return self._asked(key, value)[2]
        except (SettingsError, SpecError):
            return {"switch_key": str(key).strip().lower().replace("_", "-"), "switch_after": str(value)}

    def free_cache(self) -> None:
        """Drop the cache (after an out-of-memory error) and return its memory to the device."""
        self.cache = None
        self._next_logits = None
        if self._reference is not None:
            self._reference.forget()
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

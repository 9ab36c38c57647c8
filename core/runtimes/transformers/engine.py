"""The measuring engine: a real model generating token by token, every byte measured and predicted.

``Engine`` owns the model, the live cache and the token ids. ``prefill()`` and ``step()`` each
produce one ``Sample``; ``apply(key, value)`` switches attention mode, attention implementation
or cache strategy between two tokens and returns the event ``Sample`` that marks it.
``kvscope.core.live.run.run_generation`` drives an Engine for a ``RunRequest``.

Why one file of about 720 lines: the Engine is one object whose parts (prefill, step, the switch
transaction's checks, the kernel, the quality probe) share its model, cache and settings; the run loop
is core/live/run.py, the conversions core/runtimes/transformers/convert.py, the undo core/runtimes/transformers/transaction.py.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from typing import Any, Callable

import torch

from kvscope.core.base.errors import (  # noqa: F401 - its old home: `from kvscope.core.runtimes.transformers.engine import GenerationError`
    GenerationError)
from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from kvscope.core.model.attention import MLA, AttentionMode, SettingsError, Window, native_attention
from kvscope.core.model.caches import CacheStrategy, Quantized, Static, TokenSelecting, kv_layout, static_shortfall
from kvscope.core.model.settings import RunSettings, effective_spec, parse_attn_impl, parse_switch_value
from kvscope.core.model.spec import INDEXED_ATTENTION, SLIDING_ATTENTION, ModelSpec, SpecError
from kvscope.core.prediction.predict import kv_bytes, kv_elem_bytes, predict
from kvscope.core.runtimes.transformers.kernels import measure_kernel
from kvscope.core.runtimes.transformers.measure import cache_bytes, model_weight_bytes
from kvscope.core.runtimes.transformers.peak import measure_peak
from kvscope.core.runtimes.transformers.refusal import refuse

TOP_K = 40


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))
    elif device == "mps":
        torch.mps.synchronize()


@functools.lru_cache(maxsize=None)
def _backend_problem(backend: str) -> str | None:
    """Why a quantized-cache backend cannot run in this process (None when it can), found by
    quantizing one small tensor the way transformers' cache layer does. optimum-quanto builds a
    C++ extension on first use, which fails where no compiler or torch headers exist (the desktop
    bundle): better a clear refusal at the switch than an error halfway through a forward pass."""
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    try:
        layer = (QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer)(nbits=4)
        probe = torch.zeros(1, 1, 4, 64)
        layer.update(probe, probe)  # the first update quantizes
    except ImportError:
        return f"it is not installed (pip install {'optimum-quanto' if backend == 'quanto' else 'hqq'})"
    except Exception as exc:  # noqa: BLE001 - extension build errors come as RuntimeError, OSError...
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


class Engine:
    """A loaded model, its live cache and the tokens so far. Not thread-safe: one thread drives it (a switch's
    re-run prepared by ``begin_switch`` runs on a shadow of it, with models of its own, on a thread of its own)."""

    #: A shadow engine (``begin_switch``) leaves the re-run's forward pass to its background thread.
    _defer_rerun = False
    _rerun_why: str | None = None

    def __init__(self, loaded: Any, settings: RunSettings, probe: Any = None, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter, quality_probe: bool = False) -> None:
        self.loaded = loaded
        self.spec: ModelSpec = loaded.spec
        self.device: str = loaded.device
        self.base_model = loaded.model
        self.model = loaded.model
        self.probe = probe
        self.clock = clock
        #: One line before work that takes long between two tokens (re-running every token so far).
        self.progress: Callable[[str], None] = lambda text: None
        self.t0 = clock()
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.settings = settings.with_(weight_dtype=loaded.dtype, kv_dtype=None)
        #: One line each about a setting the engine adjusted; run_generation emits them as "note" events.
        self.notes: list[str] = list(getattr(loaded, "notes", ()))  # the load's own (the embedded fallback)
        limit = self.spec.max_position_embeddings
        if settings.max_context is not None and settings.max_context > limit:
            # Clamped, not refused: the window remembers its max-context across models, and a
            # static cache beyond the trained positions would only hold memory no token can use.
            self.notes.append(f"max context {settings.max_context:,} is beyond {self.spec.label}'s maximum of "
                              f"{limit:,} tokens (max_position_embeddings): using {limit:,}")
            self.settings = self.settings.with_(max_context=limit)
        self.mode: AttentionMode = native_attention(self.spec)
        self.kernel = "sdpa"
        self.cache = None
        self.cache_base_tokens = 0  # tokens pushed in the cache's first update (quantized residual bookkeeping)
        self.ids: torch.Tensor | None = None
        self.prompt_tokens = 0
        self.generated = 0
        #: The tokens the run will still generate (its host sets it: a static cache switched to must hold them).
        self.tokens_ahead: Callable[[], int] = lambda: 0
        self.tokens_per_s: float | None = None
        self._next_logits: torch.Tensor | None = None
        self._last_step_s: float | None = None
        self._tokens_rerun: int | None = None  # set by a switch that runs the tokens through the model again
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
        #: Never changed after this (not in _SWITCH_STATE): a refused switch leaves them as they are.
        self._kv_origin = convert.keep_kv_projections(self.base_model)
        #: The aligned merge's calibration (``merge.Calibration`` per layer: Gram matrices of the model's own K/V,
        #: from the last cache that held them), for merges made when the cache holds merged heads.
        self._merge_calibration: dict[int, Any] = {}
        if quality_probe:  # the model as loaded, before the starting settings convert it
            self._keep_reference()
        # Apply the requested starting settings to the model before the prefill, checked as a whole
        # (attention x cache x device x architecture) first.
        target = settings.attention or self.mode
        impl = parse_attn_impl(settings.attn_impl)
        if impl != "eager" and not getattr(self.base_model, "_supports_sdpa", True):
            self.notes.append(f"attn-impl {impl} is not available for {type(self.base_model).__name__} (transformers "
                              "runs it with eager attention only): using eager")
            settings = settings.with_(attn_impl="eager")
            impl = "eager"
        if settings.cache.needs_attention_weights and impl != "eager":
            self.notes.append(f"the {settings.cache.key} cache scores tokens by the attention they receive, which only "
                              f"eager attention returns: using attn-impl eager, not {impl}")
            settings = settings.with_(attn_impl="eager")
            impl = "eager"
        self._check_target(target, impl, settings.cache)
        if target.key != self.mode.key:
            self._set_attention(target, live=False)
        self.settings = self.settings.with_(attention=self.mode, cache=settings.cache)
        self._set_attn_impl(settings.attn_impl)

    # ---------------------------------------------------------------------------------- settings

    @property
    def seq_len(self) -> int:
        return 0 if self.ids is None else int(self.ids.shape[1])

    def _check_target(self, mode: AttentionMode, impl: str, strategy: CacheStrategy) -> None:
        """Refuse, before anything changes, a combination of attention mode, kernel and cache this model
        cannot run (SettingsError with the reason). What this does not foresee, the switch transaction
        catches: it tries the new state on one forward pass and undoes everything if that fails."""
        from kvscope.core.runtimes.transformers import (
            convert)  # transformers, a 9 s import: not when serve() imports this module

        label = self.spec.label
        target = self.settings.with_(attention=mode, cache=strategy, attn_impl=impl)
        eff = effective_spec(self.spec, target)  # SettingsError for gqa:N that does not divide the heads
        if impl != "eager" and not getattr(self.base_model, "_supports_sdpa", True):
            raise SettingsError(f"transformers runs {type(self.base_model).__name__} with eager attention only "
                                f"(it refuses sdpa for it, e.g. sdpa cannot softcap scores): {impl} is not available")
        if strategy.needs_attention_weights and impl != "eager":
            raise SettingsError(f"the {strategy.key} cache scores tokens by the attention weights they receive, which "
                                f"only eager attention returns: attn-impl {impl} cannot run while it is active "
                                "(switch the cache first)")
        if self._latent_mode(mode) and strategy.name != "dynamic":
            raise SettingsError(f"MLA's latent is a dynamic cache of its own (a latent and a basis per layer): the "
                                f"{strategy.key} cache cannot hold it; " + (
                                    "leave MLA first" if self._latent_mode() else "switch the cache to dynamic first"))
        if isinstance(strategy, TokenSelecting) and INDEXED_ATTENTION in eff.layer_types:
            raise SettingsError(f"a {strategy.name} cache cannot evict the sparse-attention indexer keys of "
                                f"{label}'s DSA layers; use dynamic or static")
        if strategy.needs_cuda and not self.device.startswith("cuda"):
            raise SettingsError(f"the {strategy.key} cache needs CUDA (this run is on {self.device}): "
                                "it moves layers between GPU and CPU memory")
        if isinstance(mode, Window) and mode.window < 2:
            raise SettingsError("a sliding window must be at least 2 tokens (transformers keeps the last W - 1)")
        if self.spec.is_mla and not isinstance(mode, MLA):
            raise SettingsError(f"{label} caches a compressed latent (MLA): it has no K/V heads to regroup and no "
                                f"sliding-window layers, so {mode.key} is not available for it")
        if not isinstance(mode, MLA) and eff.num_kv_heads != self.spec.num_kv_heads:
            convert.kv_heads_of(self.base_model)  # SettingsError with the reason: fused QKV, MLA, MHA-only
            # ... or projections shared by several layers, or wider than the hidden state (the prediction's premise).
            convert.check_kv_projections(self.base_model, self.spec.num_kv_layers, self.spec.hidden_size)
        if isinstance(strategy, Quantized):
            sliding = eff.num_sliding_layers
            if sliding:
                which = f"slide under {mode.key}" if isinstance(mode, Window) else f"of {label} slide"
                raise SettingsError(f"a quantized cache needs full-attention layers; transformers refuses it with a "
                                    f"sliding window ({sliding} of {eff.num_layers} layers {which})")
            if eff.num_state_layers:
                raise SettingsError(f"a quantized cache needs full-attention layers; transformers refuses it with "
                                    f"{eff.num_state_layers} of {eff.num_layers} layers of {label} keeping linear-attention, "
                                    "state-space or convolution states (or sharing K/V)")
            if strategy.backend in ("quanto", "hqq"):
                problem = _backend_problem(strategy.backend)
                if problem:
                    raise SettingsError(f"the {strategy.backend} cache backend cannot run here: {problem}; "
                                        "quantized:fp8 (and quantized:hqq:4 where installed) need nothing extra")
            if self.cache is not None and self.seq_len:
                # A cache switch quantizes everything held at once; an attention switch keeps the cache's own count.
                base = self.cache_base_tokens if isinstance(self.settings.cache, Quantized) else self.seq_len
                self._check_quantized_shapes(eff, target, strategy, base)

    def _check_quantized_shapes(self, eff: ModelSpec, target: RunSettings, strategy: Quantized, base: int) -> None:
        """A quantized cache quantizes everything it holds at its first update (``base`` tokens) and at each
        residual flush after it; quanto and hqq refuse tensors that their groups do not divide. Try every
        such moment up to the context limit with the predictor's formulas (they raise what the backends raise)."""
        if strategy.backend == "fp8" or base <= 0:
            return
        layout = kv_layout(eff)
        elem = kv_elem_bytes(self.spec, target)
        for n in range(base, max(self.max_context(), base) + 1, strategy.residual_length):
            try:
                strategy.kv_bytes(layout, target.batch, n, elem, prompt_tokens=base)
            except SettingsError as exc:
                raise SettingsError(f"{strategy.key} with {target.attention.key} would fail when the cache is "
                                    f"quantized at {n:,} tokens: {exc}") from None

    def max_context(self) -> int:
        """What a static cache preallocates: the setting, else the model's maximum."""
        return int(self.settings.max_context or self.spec.max_position_embeddings)

    def _new_cache(self, strategy: CacheStrategy | None = None):
        if self._latent_mode():
            from kvscope.core.runtimes.transformers import latent

            return latent.latent_cache(self.model, self._latent_rank())
        return (strategy or self.settings.cache).build(self.model.config, self.max_context())

    def _latent_mode(self, mode: AttentionMode | None = None) -> bool:
        """Whether ``mode`` (default: the current one) is KV Scope's MLA latent of this model (not a native MLA)."""
        return isinstance(mode or self.mode, MLA) and not self.spec.is_mla

    def _latent_rank(self, mode: AttentionMode | None = None) -> int:
        return int(effective_spec(self.spec, self.settings.with_(attention=mode or self.mode)).latent_rank)

    def _set_attn_impl(self, impl: str) -> None:
        impl = parse_attn_impl(impl)
        hf = "eager" if impl == "eager" else "sdpa"
        kernel = "eager" if impl == "eager" else "sdpa"
        if impl == "flash":
            try:
                import flash_attn  # noqa: F401

                hf, kernel = "flash_attention_2", "flash_attention_2"
            except ImportError:
                # Static caches and sliding windows hand SDPA an explicit mask, which its flash
                # kernel refuses; then the default SDPA dispatch runs, and the Sample says so.
                needs_mask = isinstance(self.settings.cache, Static) or isinstance(self.mode, Window)
                if self._flash_sdpa_works(needs_mask):
                    kernel = "sdpa-flash"
                else:
                    kernel = "sdpa (flash refused: " + ("masked attention)" if needs_mask else "not on this device)")
        for model in {id(m): m for m in (self.model, self.base_model) if m is not None}.values():
            model.set_attn_implementation(hf)
        self.kernel = kernel
        self.settings = self.settings.with_(attn_impl=impl)

    def _flash_sdpa_works(self, with_mask: bool) -> bool:
        """Whether SDPA's flash backend accepts this device/dtype (and a mask), tried on a small problem."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        dtype = next(self.model.parameters()).dtype
        q = torch.zeros(1, 2, 4, self.spec.head_dim, device=self.device, dtype=dtype)
        mask = torch.ones(1, 1, 4, 4, device=self.device, dtype=torch.bool).tril() if with_mask else None
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=mask is None)
            return True
        except RuntimeError:
            return False

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
            stack.enter_context(self.settings.cache.forward_context(self.model, self.cache))
        return stack

    def _layer_pattern_model(self, eff: ModelSpec):
        """The base model with the sliding/full layers ``eff`` describes (a Llama gets a Mistral twin for a window)."""
        from kvscope.core.runtimes.transformers import (
            convert)  # transformers, a 9 s import: not when serve() imports this module

        if eff.layer_types == self.spec.layer_types and eff.sliding_window == self.spec.sliding_window:
            convert.restore_layer_pattern(self.base_model, self._native_pattern)
            return self.base_model
        if eff.num_full_layers == 0:
            return convert.with_window(self.base_model, eff.sliding_window)
        if eff.num_sliding_layers == 0:
            convert.restore_layer_pattern(self.base_model, self._native_pattern)
            return convert.with_window(self.base_model, None)
        raise SettingsError(f"{self.spec.label} cannot take the layer pattern of this mode")

    def _set_attention(self, mode: AttentionMode, live: bool) -> str:
        """Convert the model (and, when ``live``, the cache) to ``mode``. Returns what happened, for the event.

        Not atomic by itself: ``apply`` runs it inside a transaction that undoes it on failure."""
        from kvscope.core.runtimes.transformers import (
            convert)  # transformers, a 9 s import: not when serve() imports this module

        previous = self.mode
        before = effective_spec(self.spec, self.settings)
        eff = effective_spec(self.spec, self.settings.with_(attention=mode))
        if self._latent_mode(mode):
            return self._set_latent(mode, previous, before, eff, live)
        target = eff.num_kv_heads
        origin = self._kv_origin
        exact = True
        try:
            current = convert.kv_heads_of(self.base_model)
        except SettingsError:
            # No regroupable heads (fused QKV) or layers of different head counts (MiMo-V2-Flash): _check_target
            # refuses head changes for such a model, so its projections are still its own, as the target needs.
            current = None
        merged, merge_note = None, None
        if origin is not None and current is not None and (current != target or target == origin.heads
                                                           or self._merging(mode)):
            # From the model's own projections, never from the last converted state; its own count: the loaded
            # tensors themselves.
            merged, merge_note = self._fit_merge(mode, target, live)
            if merged is None:
                exact = convert.set_kv_heads(self.base_model, target, origin=origin)
            else:
                from kvscope.core.runtimes.transformers import merge

                merge.set_merged(self.base_model, origin, merged)
                exact = False
        self.model = self._layer_pattern_model(eff)
        self.mode = mode
        self.settings = self.settings.with_(attention=mode)
        self._set_attn_impl(self.settings.attn_impl)
        self._weights_observed = model_weight_bytes(self.model)
        if not live or self.cache is None:
            return mode.key
        if self._latent_mode(previous):
            left = self._leave_latent()
            if left:
                return self._rerun(left)
            before = effective_spec(self.spec, self.settings.with_(attention=native_attention(self.spec)))
        pattern_changed = (before.layer_types, before.sliding_window) != (eff.layer_types, eff.sliding_window)
        if pattern_changed and self._tokens_lost(before, eff):
            return self._rerun(f"the {previous.key} cache no longer holds the earliest tokens")
        strategy = self.settings.cache
        if pattern_changed and self._tokens_dropped(before):
            return self._rerun(f"the {strategy.key} cache no longer holds the tokens it dropped")
        if strategy.needs_attention_weights:
            # Each K/V head kept its own heavy hitters: slot i is a different token in each head, so heads
            # cannot be repeated or pooled, and a refill would carry no scores.
            return self._rerun(f"{strategy.name} keeps different tokens in each K/V head")
        pooled = self._pooled_cache_rerun(mode, previous)
        if pooled:
            return self._rerun(pooled)
        notes = []
        old_heads = convert.cache_heads(self.cache)
        if old_heads is not None and old_heads != target:
            if merged is not None:
                from kvscope.core.runtimes.transformers import merge

                merge.merge_cache(self.cache, merged, old_heads)
                moved = False
            else:
                moved = convert.convert_cache_kv_heads(self.cache, old_heads, target)
            own = origin.heads if origin is not None else self.spec.num_kv_heads
            strategy = self.settings.cache
            # Back down to the model's own heads, each group of the cache is copies of one head: that head
            # (regroup_heads), exact unless a quanto/hqq cache requantizes it.
            selected = old_heads % own == 0 and target % own == 0 and not (
                isinstance(strategy, Quantized) and strategy.backend != "fp8")
            if merge_note:
                how = f"approximate ({merge_note})"
            elif not exact:
                how = f"approximate (heads mean-pooled from the model's own {own})"
            elif not (moved or selected):
                how = f"approximate (the {strategy.key} cache requantized at {target} heads)"
            elif target == own:
                how = "exact: the model's own K/V projections as loaded, and one of each repeated cache head"
            else:
                how = "exact (heads repeated)"
            notes.append(f"{old_heads} -> {target} K/V heads, {how}")
        if pattern_changed and before.layer_states:
            return self._rerun("the layers' states beside K/V are recomputed in the new cache")
        if pattern_changed:
            fresh = self._new_cache()
            convert.refill_cache(fresh, convert.dense_kv(self.cache), seq_length=self.seq_len)
            self.cache = fresh
            if eff.num_full_layers == 0:
                notes.append(f"every layer keeps the last {eff.sliding_window - 1} tokens")
            elif eff.num_sliding_layers:
                notes.append(f"the model's own window ({eff.sliding_window}) on {eff.num_sliding_layers} of "
                             f"{eff.num_layers} layers")
            else:
                notes.append("full attention in every layer")
        elif eff.num_sliding_layers and eff.num_full_layers:
            notes.append(f"the model's own window ({eff.sliding_window}) stays on {eff.num_sliding_layers} of "
                         f"{eff.num_layers} layers")
        return "cache converted in place" + (f": {'; '.join(notes)}" if notes else "")

    def _set_latent(self, mode: AttentionMode, previous: AttentionMode, before: ModelSpec, eff: ModelSpec,
                    live: bool) -> str:
        """MLA on a model that is not MLA: the model as loaded (its own K/V projections, its own layer pattern) and
        its cache's full-attention layers turned into latents of its own K/V (``kvscope.core.runtimes.transformers.latent``),
        in place; the tokens so far re-run only where the cache no longer holds the model's own K/V of them."""
        from kvscope.core.runtimes.transformers import convert, latent

        origin = self._kv_origin
        rank = self._latent_rank(mode)
        if origin is not None:
            try:
                current = convert.kv_heads_of(self.base_model)
            except SettingsError:
                current = None
            if current is not None and current != origin.heads:
                convert.set_kv_heads(self.base_model, origin.heads, origin=origin)
        self.model = self._layer_pattern_model(eff)
        self.mode = mode
        self.settings = self.settings.with_(attention=mode)
        self._set_attn_impl(self.settings.attn_impl)
        self._weights_observed = model_weight_bytes(self.model)
        if not live or self.cache is None or not self.seq_len:
            return f"latent of rank {rank} per layer, fitted at the prefill"
        why = self._latent_rerun(mode, previous)
        if why:
            return self._rerun(why)
        notes = []
        if self._latent_mode(previous):
            # Down in rank: each layer fits its new basis on what its latent holds (no re-run).
            for layer in self.cache.layers:
                if isinstance(layer, latent.LatentLayer):
                    layer.refit(rank)
            return f"latent refitted to rank {rank} in place, on what the rank-{self._latent_rank(previous)} latent held"
        held = convert.cache_heads(self.cache)
        own = origin.heads if origin is not None else self.spec.num_kv_heads
        if held is not None and held != own:
            convert.convert_cache_kv_heads(self.cache, held, own)  # repeated heads: one of each (exact)
            notes.append(f"{held} -> {own} K/V heads (the model's own, as loaded)")
        if (before.layer_types, before.sliding_window) != (eff.layer_types, eff.sliding_window):
            fresh = self.settings.cache.build(self.model.config, self.max_context())
            convert.refill_cache(fresh, convert.dense_kv(self.cache), seq_length=self.seq_len)
            self.cache = fresh
            notes.append("the model's own layer pattern")
        t = time.perf_counter()
        how = latent.convert_to_latent(self.cache, self.model, rank)
        notes.append(f"fitted on the {self.seq_len:,} tokens so far in {1000 * (time.perf_counter() - t):.0f} ms; {how}")
        return f"cache converted in place to a latent of rank {rank} per layer: " + "; ".join(notes)

    def _latent_rerun(self, mode: AttentionMode, previous: AttentionMode | None = None) -> str | None:
        """Why a switch to MLA's latent re-runs the tokens so far (None: the cache converts in place): the cache must
        hold the model's own K/V of every token (``rerun.may_rerun`` asks this too)."""
        previous = previous or self.mode
        if self.cache is None or not self.seq_len:
            return None
        if self._latent_mode(previous):
            held = self._latent_rank(previous)
            rank = self._latent_rank(mode)
            return None if rank <= held else (f"a latent of rank {held} cannot give back the directions a rank of "
                                              f"{rank} keeps")
        native = native_attention(self.spec)
        before = effective_spec(self.spec, self.settings.with_(attention=previous))
        after = effective_spec(self.spec, self.settings.with_(attention=native))
        if self._tokens_lost(before, after):
            return f"the {previous.key} cache no longer holds the earliest tokens"
        if self._tokens_dropped(before):
            return f"the {self.settings.cache.key} cache no longer holds the tokens it dropped"
        if before.layer_states and (before.layer_types, before.sliding_window) != (after.layer_types, after.sliding_window):
            return "the layers' states beside K/V are recomputed in the new cache"
        return self._pooled_cache_rerun(native, previous)

    def _leave_latent(self) -> str | None:
        """Leaving MLA's latent: a full-rank latent gives every token's K/V back (to rounding) into a dynamic cache;
        below full rank the tokens' own K/V are gone, and the reason to re-run them is returned."""
        from kvscope.core.runtimes.transformers import convert, latent

        if self.cache is None or not self.seq_len:
            return None
        layers = [layer for layer in self.cache.layers if isinstance(layer, latent.LatentLayer)]
        if any(layer.rank < layer.width for layer in layers):
            return (f"a latent of rank {layers[0].rank} kept only part of the tokens' K/V; the model as loaded "
                    "computes them again")
        fresh = self.settings.cache.build(self.model.config, self.max_context())
        convert.refill_cache(fresh, convert.dense_kv(self.cache), seq_length=self.seq_len)
        self.cache = fresh
        return None

    def _pooled_cache_rerun(self, mode: AttentionMode, previous: AttentionMode | None = None) -> str | None:
        """Why a switch to ``mode`` re-runs the tokens so far for the cache's K/V heads (None: it need not).

        Every head count that is not a multiple of the model's own is mean-pooled (from the model's own
        projections, ``convert.set_kv_heads(origin=)``), and so is a cache held at it: its tokens were pooled or
        computed by the pooled model. Going back to a count of the model's own (its heads, or those repeated),
        or up to more heads, repeating pooled heads cannot give back the tokens' own K/V: the model converts
        exactly, the tokens so far go through it again. ``rerun.may_rerun`` asks this too."""
        from kvscope.core.runtimes.transformers import (
            convert)  # transformers, a 9 s import: not when serve() imports this module

        origin = self._kv_origin
        previous = previous or self.mode
        if origin is None or self.cache is None or not self.seq_len or isinstance(mode, MLA) or isinstance(previous, MLA):
            return None
        held = convert.cache_heads(self.cache)
        target = effective_spec(self.spec, self.settings.with_(attention=mode)).num_kv_heads
        if held is None or held % origin.heads == 0:
            return None
        if held == target and self._merging(mode) == self._merging(previous):  # the same heads, merged the same way
            return None
        how = "merged" if self._merging(previous) else "mean-pooled"
        cached = f"the cache's {held} {how} head{'s' if held != 1 else ''}"
        if target % origin.heads == 0:
            own = ("the model's own K/V projections are back, as loaded" if target == origin.heads
                   else f"{target} K/V heads repeat the model's own {origin.heads}, as loaded")
            return f"{own}; {cached} cannot give the tokens' own K/V back"
        if target > held:
            return (f"{target} K/V heads are pooled afresh from the model's own {origin.heads}; repeating "
                    f"{cached} would not give their K/V")
        if self._merging(mode) or self._merging(previous):
            # Aligned merges are fitted from the model's own heads: a cache of merged heads cannot be merged again
            # the same way (mean-pooling can: a mean of equal groups' means is the mean of the heads).
            return (f"{target} K/V head{'s are' if target != 1 else ' is'} merged afresh from the model's own "
                    f"{origin.heads}; {cached} cannot be merged again")
        return None

    def _merging(self, mode: AttentionMode | None) -> bool:
        """Whether ``mode`` makes fewer K/V heads than the model's own with the aligned merge."""
        origin = self._kv_origin
        if origin is None or mode is None or getattr(mode, "merge", "mean") == "mean":
            return False
        target = effective_spec(self.spec, self.settings.with_(attention=mode)).num_kv_heads
        return target % origin.heads != 0

    def _own_kv(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """Per cache layer, the K/V it holds when they are the model's own (its own heads, or them repeated);
        None otherwise (no tokens, merged or pooled heads, a latent)."""
        from kvscope.core.runtimes.transformers import convert, latent

        origin = self._kv_origin
        if self.cache is None or not self.seq_len or latent.is_latent(self.cache) or \
                self.settings.cache.needs_attention_weights:  # h2o: each head holds tokens of its own choosing
            return None
        held = convert.cache_heads(self.cache)
        if held is None or held % origin.heads:
            return None
        return {i: convert._layer_kv(layer) for i, layer in enumerate(self.cache.layers)
                if getattr(layer, "is_initialized", False)}

    def _fit_merge(self, mode: AttentionMode, target: int, live: bool) -> tuple[Any, str | None]:
        """The aligned merge of the model's own heads to ``target`` (``kvscope.core.runtimes.transformers.merge``),
        calibrated on the cache's own K/V, else on the last calibration kept; (None, why) where the mean applies
        instead, (None, None) where no merge is asked."""
        if not self._merging(mode):
            return None, None
        from kvscope.core.runtimes.transformers import merge

        origin = self._kv_origin
        why = merge.problem(self.base_model)
        if why:
            return None, f"heads mean-pooled from the model's own {origin.heads}: {why}"
        t = time.perf_counter()
        own_kv = self._own_kv() if live else None
        passed = ""
        if not own_kv and not self._merge_calibration:
            if not (live and self.ids is not None and self.seq_len):
                return None, (f"heads mean-pooled from the model's own {origin.heads}: no tokens of its own K/V to "
                              "align them on yet")
            own_kv = self._own_kv_by_pass(self.ids)
            passed = " (their K/V computed again by the model as loaded)"
        try:
            merges, made, tokens = merge.fit(self.base_model, origin, target, own_kv=own_kv,
                                             kept=self._merge_calibration)
        except SettingsError as exc:  # a rotary the merge cannot read: the mean, and why
            return None, f"heads mean-pooled from the model's own {origin.heads}: {exc}"
        self._merge_calibration.update(made)
        return merges, (f"heads aligned and merged from the model's own {origin.heads}, calibrated on {tokens:,} "
                        f"tokens{passed}, in {1000 * (time.perf_counter() - t):.0f} ms")

    def _own_kv_by_pass(self, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The K/V the model as loaded (its own projections, put back) computes for the last ``CALIBRATION_TOKENS``
        of ``ids``, in one pass into a cache of its own (the live cache is not touched)."""
        from transformers import DynamicCache

        from kvscope.core.runtimes.transformers import convert, merge

        origin = self._kv_origin
        convert.set_kv_heads(self.base_model, origin.heads, origin=origin)
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode(), self._kernel_context():
            self.model(input_ids=ids[:, -merge.CALIBRATION_TOKENS:].to(self.device), cache=cache, use_cache=True,
                       logits_to_keep=1)
        return {i: convert._layer_kv(layer) for i, layer in enumerate(cache.layers)
                if getattr(layer, "is_initialized", False)}

    def _calibrate_merge(self, prompt_ids: torch.Tensor) -> str | None:
        """A run that starts in an aligned merge with nothing to calibrate it on: the prompt goes through the model as
        loaded first (its own K/V projections, one pass), and the merge is fitted on that K/V. Returns what was done."""
        from kvscope.core.runtimes.transformers import convert, merge

        origin = self._kv_origin
        if not self._merging(self.mode) or self._merge_calibration or merge.problem(self.base_model):
            return None
        target = effective_spec(self.spec, self.settings).num_kv_heads
        own = self._own_kv_by_pass(prompt_ids)
        try:
            merges, made, tokens = merge.fit(self.base_model, origin, target, own_kv=own)
        except SettingsError as exc:
            convert.set_kv_heads(self.base_model, target, origin=origin)
            return f"K/V heads mean-pooled from the model's own {origin.heads}: {exc}"
        self._merge_calibration.update(made)
        merge.set_merged(self.base_model, origin, merges)
        self._weights_observed = model_weight_bytes(self.model)
        return f"K/V heads aligned and merged from the model's own {origin.heads}, calibrated on the prompt's {tokens:,} tokens"

    def _tokens_dropped(self, eff: ModelSpec | None = None) -> int:
        """Tokens the live cache's full-attention layers (those of ``eff``, default the current settings')
        no longer hold: a token-selecting cache past its capacity."""
        strategy = self.settings.cache
        if not isinstance(strategy, TokenSelecting) or self.cache is None:
            return 0
        if not (eff or effective_spec(self.spec, self.settings)).num_full_layers:
            return 0
        return max(0, self.seq_len - strategy.capacity)

    def _tokens_lost(self, before: ModelSpec, after: ModelSpec) -> bool:
        """Whether some layer would need tokens that its sliding window has already dropped."""
        n = self.seq_len
        for old, new in zip(before.layer_types, after.layer_types):
            held = n if old != SLIDING_ATTENTION else min(n, (before.sliding_window or n + 1) - 1)
            needed = n if new != SLIDING_ATTENTION else min(n, (after.sliding_window or n + 1) - 1)
            if held < needed:
                return True
        return False

    def _rerun(self, why: str) -> str:
        """Rebuild the cache by running every token so far through the current model (no new token), in one
        batched pass (a prefill). A shadow engine (``begin_switch``) only builds the fresh cache here and leaves
        the pass to its background thread (``_fill``)."""
        self.cache = self._new_cache()
        self.cache_base_tokens = self.seq_len
        if self._defer_rerun:
            self._rerun_why = why
            self._tokens_rerun = self.seq_len
            return f"re-ran {self.seq_len} tokens: {why}"
        if self.ids is not None and self.seq_len:
            self.progress(f"re-running {self.seq_len:,} tokens ({why})\u2026")
            with torch.inference_mode(), self._forward_context():
                out = self._measured_forward()
            self._next_logits = out.logits[:, -1, :].float()
            self.cache = out.cache if getattr(out, "cache", None) is not None else self.cache
        self._tokens_rerun = self.seq_len
        return f"re-ran {self.seq_len} tokens: {why}"

    #: Engine fields a switch may change; the transaction restores them on failure.
    _SWITCH_STATE = ("model", "mode", "settings", "kernel", "cache", "cache_base_tokens",
                     "_next_logits", "_weights_observed")

    def apply(self, key: str, value: str | AttentionMode | CacheStrategy) -> Sample:
        """Switch a setting between two tokens, all or nothing. Returns the event Sample.

        The target (attention x kernel x cache x architecture) is checked first; then the model and the
        cache are converted together and tried on one forward pass (which is then undone). Any failure
        restores the previous model, cache and settings exactly and raises SettingsError with the
        reason, so the run goes on as before. A switch to the current setting changes nothing and
        returns a ``note`` event that says so.
        """
        from kvscope.core.runtimes.transformers.transaction import (
            Snapshot)  # transformers, a 9 s import: not when serve() imports this module

        t = self.clock()
        name, parsed, fields = self._asked(key, value)
        label, was, wanted = fields["switch_key"], fields["switch_before"], fields["switch_after"]
        if wanted == was:
            return self._sample(PHASE_EVENT, f"{label}: {was} (no change: already {wanted})", event="note",
                                step_s=self.clock() - t, **fields)
        self._tokens_rerun = None
        self._peak_fields = {}  # a re-run of this switch measures its own
        self.progress(f"switching {label} to {wanted}\u2026")
        mode, impl, strategy, eager_for = self._target_of(name, parsed)
        self._check_target(mode, impl, strategy)
        snapshot = Snapshot([self.base_model, self.model], self.cache, self, self._SWITCH_STATE)
        kernel_before = self.kernel
        try:
            with torch.inference_mode():
                detail = self._convert(name, parsed, eager_for)
                self._trial_step()
                if name == "attn_impl":
                    detail = f"kernel {self.kernel}"  # as measured on the trial pass
                    if self.kernel == kernel_before:  # F on the CPU: nothing to see, and why (issue 37)
                        why = ("on the CPU sdpa picks PyTorch's flash kernel itself" if self.kernel == "sdpa-flash-cpu"
                               else "PyTorch picks the kernel per call")
                        detail += f": the kernel that already ran ({why}), so neither the memory nor the speed moves"
        except Exception as exc:  # noqa: BLE001 - every failure is undone and reported as a refusal
            snapshot.restore()
            del snapshot
            gc.collect()
            refuse(exc)
        del snapshot
        gc.collect()
        now = self._settings_now()[name]
        text = f"{label}: {was} -> {now} ({detail})"
        return self._sample(PHASE_EVENT, text, event="switch", step_s=self.clock() - t,
                            **(fields | {"switch_after": now, "tokens_rerun": self._tokens_rerun}), **self._take_peak())

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

    def _target_of(self, name: str, parsed: Any) -> tuple[AttentionMode, str, CacheStrategy, str | None]:
        """The whole target of a switch (attention, kernel, cache) and the kernel it takes along (h2o needs eager)."""
        mode = parsed if name == "attention" else self.mode
        impl = parsed if name == "attn_impl" else self.settings.attn_impl
        strategy = parsed if name == "cache" else self.settings.cache
        eager_for = None
        if name == "cache" and strategy.needs_attention_weights and impl != "eager":
            eager_for, impl = impl, "eager"  # the switch takes the kernel along, and says so
        return mode, impl, strategy, eager_for

    def _convert(self, name: str, parsed: Any, eager_for: str | None) -> str:
        """Convert the model and the cache to the switch's target (not atomic: the caller undoes on failure).
        Returns what happened, for the event (the kernel's switch is described after the trial pass)."""
        if name == "attention":
            return self._set_attention(parsed, live=True)
        if name == "attn_impl":
            self._set_attn_impl(parsed)
            return ""
        if eager_for is not None:
            self._set_attn_impl("eager")
        detail = self._switch_cache(parsed)
        if eager_for is not None:
            detail += (f"; attn-impl {eager_for} -> eager: {parsed.name} scores tokens by the attention "
                       "weights, which only eager attention returns")
        return detail

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

    def _switch_cache(self, strategy: CacheStrategy) -> str:
        from kvscope.core.runtimes.transformers import (
            convert)  # transformers, a 9 s import: not when serve() imports this module

        if self.cache is None or self.seq_len == 0:
            self.settings = self.settings.with_(cache=strategy)
            return "takes effect at the prefill"
        if isinstance(strategy, Static):
            shortfall = static_shortfall(self.max_context(), self.seq_len, self.tokens_ahead())
            if shortfall:
                raise SettingsError(shortfall)
        dropped = self._tokens_dropped()
        old = self.settings.cache
        self.settings = self.settings.with_(cache=strategy)
        if INDEXED_ATTENTION in self.spec.layer_types:
            # A DSA layer's indexer keys cannot be carried across (dense_kv reads K/V only): recompute them.
            return self._rerun("the sparse-attention indexer keys are recomputed in the new cache")
        if effective_spec(self.spec, self.settings).layer_states:
            # Nor can the states layers keep beside K/V (convolution, recurrent, compressor): a fresh cache filled
            # with K/V alone would start them from zero at the next token.
            return self._rerun("the layers' states beside K/V are recomputed in the new cache")
        if dropped:
            return self._rerun(f"the {old.key} cache has dropped {dropped:,} of them")
        if strategy.needs_attention_weights:
            # Copied K/V carry no attention scores: the tokens so far go through the model to score them.
            return self._rerun(f"{strategy.name} scores every token by the attention it receives")
        fresh = self._new_cache(strategy)
        try:
            convert.refill_cache(fresh, convert.dense_kv(self.cache), seq_length=self.seq_len)
        except (SettingsError, NotImplementedError, RuntimeError) as exc:
            return self._rerun(f"the cache could not be moved across ({exc})")
        self.cache = fresh
        self.cache_base_tokens = self.seq_len
        self._set_attn_impl(self.settings.attn_impl)  # the flash kernel may accept this cache's mask or not
        return "cache moved across" + (" (quantized: lossy)" if isinstance(strategy, Quantized) else "")

    # ---------------------------------------------------------------------------------- tokens

    def prefill(self, prompt_ids: torch.Tensor, text: str) -> Sample:
        """Run the prompt (ids [batch, n]) through the model; the cache is built here."""
        if prompt_ids.ndim != 2 or prompt_ids.shape[1] == 0:
            raise GenerationError("the prompt is empty: give at least one token of text")
        if isinstance(self.settings.cache, Static) and prompt_ids.shape[1] >= self.max_context():
            raise GenerationError(f"the prompt ({prompt_ids.shape[1]:,} tokens) does not fit a static cache of "
                                  f"{self.max_context():,}; raise --max-context")
        if isinstance(self.settings.cache, Quantized):
            self._check_quantized_shapes(effective_spec(self.spec, self.settings), self.settings, self.settings.cache,
                                         int(prompt_ids.shape[1]))
        calibrated = self._calibrate_merge(prompt_ids)
        if calibrated:
            self.notes.append(calibrated)
        self.ids = prompt_ids.to(self.device)
        self.prompt_tokens = int(prompt_ids.shape[1])
        self.cache = self._new_cache()
        self.cache_base_tokens = self.prompt_tokens
        self._reset_peak()
        t = self.clock()
        with torch.inference_mode(), self._forward_context():
            out = self._measured_forward()
        _sync(self.device)
        dt = self.clock() - t
        self._next_logits = out.logits[:, -1, :].float()
        self._trial_step()  # measures the attention kernel a decode step runs (untimed, undone)
        return self._sample(PHASE_PREFILL, text, step_s=dt, **self._quality_now(), **self._take_peak())

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
        return self._sample(PHASE_DECODE, self._text_piece(int(token[0, 0])), step_s=dt, **self._quality_now(),
                            **self._take_peak())

    # ---------------------------------------------------------------------------------- quality probe

    def _keep_reference(self) -> None:
        """The quality probe's reference: a copy of the model as loaded sharing its tensors (``reference.py``)."""
        from kvscope.core.runtimes.transformers.reference import LoadedReference

        try:
            self._reference = LoadedReference(self.base_model, self.max_context())
        except Exception as exc:  # noqa: BLE001 - a model that cannot be copied structurally: no probe, said once
            self._reference = None
            self._reference_problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            self.notes.append(f"quality probe off: the model as loaded cannot be kept beside the run "
                              f"({self._reference_problem})")

    def _quality_now(self) -> dict[str, Any]:
        """The quality probe's figures for sequence 0 (empty when it is off), against the model as loaded on the same
        tokens (teacher-forced, its own full dynamic cache; untimed: tokens/s is the run's own): whether the run's
        most likely next token is the loaded model's (``quality_top1`` 1 or 0), KL(loaded || run) of the next-token
        distributions over the whole vocabulary in nats (``quality_kl``), and the loaded model's most likely next
        token (``quality_token``, ``quality_token_text``). The loaded model runs the tokens its cache lacks: one
        decode step per token of the run, the prompt once; everything again only if its cache was dropped."""
        from kvscope.core.runtimes.transformers.reference import quality

        if not self.quality_probe or self._reference is None or self._next_logits is None or self.ids is None:
            return {}
        ref = self._reference.follow(self.ids)
        top1, kl, best = quality(self._next_logits[0], ref)
        tokenizer = getattr(self.loaded, "tokenizer", None)
        text = tokenizer.decode([best]) if tokenizer is not None else None
        return {"quality_top1": top1, "quality_kl": kl, "quality_token": best,
                "quality_token_text": None if text is None else text[:256], "quality_kv_bytes": self._reference.nbytes}

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
                             "peak_bytes_predicted": self._predicted_peak(self.seq_len, 0)}
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
                                 "peak_bytes_predicted": self._predicted_peak(1, self.seq_len)}
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
                             "peak_bytes_predicted": self._predicted_peak(1, self.seq_len)}
        cadence.measured(self.clock() - t, self.settings)
        return out, True

    def _predicted_peak(self, new_tokens: int, past_tokens: int) -> int | None:
        """kvscope.core.prediction.predict.prefill_peak for this engine's model, settings, device and threads (None: a spec the replay
        cannot follow)."""
        from kvscope.core.prediction.predict import prefill_peak

        try:
            return prefill_peak(self.spec, self._prediction_settings(), new_tokens, past_tokens=past_tokens,
                                **self._peak_context()).peak
        except (SettingsError, SpecError, ValueError, ZeroDivisionError):
            return None

    def _peak_context(self) -> dict[str, Any]:
        """What the replay needs of the machine: the device, the CPU's threads and oneDNN's matmul scratch."""
        from kvscope.core.runtimes.transformers.peak import matmul_scratch

        cpu = self.device == "cpu"
        return {"device": "cuda" if self.device.startswith("cuda") else self.device,
                "cpu_threads": torch.get_num_threads(),
                "matmul_scratch": matmul_scratch(self.model.dtype) if cpu else None}

    def _predicted_activations(self, phase: str, n: int, rerun: bool, pred: Any) -> int:
        """Bytes the forward pass that made this Sample held at its peak beyond the weights and the KV it left
        (kvscope.core.prediction.predict.forward_activations: the prefill or re-run of ``n`` tokens, else one decode step on n - 1),
        so that weights + KV + this is the predicted total of the step, what a device allocator's peak counter
        reads. oneDNN's matmul scratch is left out here (asking oneDNN costs a profiled matmul per new shape, and
        eager's decode shapes change every token; at most ~200 KB); the old estimate where the replay cannot go."""
        from kvscope.core.prediction.predict import forward_activations

        if n == 0:
            return 0  # no forward pass yet (the load event)
        full = phase == PHASE_PREFILL or rerun
        try:
            return forward_activations(self.spec, self._prediction_settings(), n if full else 1,
                                       0 if full else max(n - 1, 0),
                                       **(self._peak_context() | {"matmul_scratch": None}))
        except (SettingsError, SpecError, ValueError, ZeroDivisionError):
            return pred.activations_prefill if phase == PHASE_PREFILL else pred.activations_decode

    def _take_peak(self) -> dict[str, Any]:
        """The last measured forward pass's peak fields, once (the prefill's or the switch's re-run)."""
        fields, self._peak_fields = getattr(self, "_peak_fields", {}), {}
        return fields

    def _reset_peak(self) -> None:
        if self.probe is not None and hasattr(self.probe, "reset_peak"):
            self.probe.reset_peak()

    def _prediction_settings(self) -> RunSettings:
        """Settings as the predictor needs them: a static cache's preallocated length made explicit."""
        if isinstance(self.settings.cache, Static):
            return self.settings.with_(max_context=self.max_context())
        return self.settings

    def predicted_kv(self, tokens: int | None = None) -> int:
        """Predicted KV bytes after ``tokens`` tokens (default: now) under the current settings."""
        n = self.seq_len if tokens is None else tokens
        return kv_bytes(self.spec, self._prediction_settings(), n, prompt_tokens=min(self.cache_base_tokens, n))

    def _sample(self, phase: str, text: str, event: str | None = None, step_s: float | None = None,
                **switch: Any) -> Sample:
        observed = cache_bytes(self.cache) if self.cache is not None else None
        reading = self.probe.read() if self.probe is not None else None
        n = self.seq_len
        pred = predict(self.spec, self._prediction_settings(), max(n, 1),
                       prompt_tokens=min(self.cache_base_tokens, max(n, 1)) or None)
        kv_pred = pred.breakdown.kv_cache if self.cache is not None and n > 0 else 0
        act = self._predicted_activations(phase, n, bool(switch.get("tokens_rerun")), pred)
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
        name, parsed = parse_switch_value(key, value) if isinstance(value, str) else (
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

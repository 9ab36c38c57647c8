"""The transformers engine's conversions: the model and its live cache converted to a switch's target.

Every function takes the ``Engine`` (its state: ``kvscope.core.runtimes.transformers.state.EngineState``) and
changes it in place, not atomically: ``kvscope.core.runtimes.transformers.switch.apply`` runs them inside the
transaction that undoes them on failure, and a re-run's shadow (``rerun.py``) runs them on a copy. The rules that
decide what may run are ``switches.py``'s (the light half, shared with the window); here is what a switch does to
the tensors: K/V heads regrouped or merged from the model's own projections, a layer pattern swapped, MLA's latent
fitted, a cache moved across, or the tokens so far run again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from kvscope.core.model.attention import MLA, AttentionMode, SettingsError, Window, native_attention
from kvscope.core.model.caches import CacheStrategy, Quantized, Static
from kvscope.core.model.settings import effective_spec, parse_attn_impl
from kvscope.core.model.spec import INDEXED_ATTENTION, ModelSpec
from kvscope.core.runtimes.transformers import caches, switches
from kvscope.core.runtimes.transformers.measure import model_weight_bytes

if TYPE_CHECKING:
    from kvscope.core.runtimes.transformers.engine import Engine


def new_cache(engine: "Engine", strategy: CacheStrategy | None = None):
    if latent_mode(engine):
        from kvscope.core.runtimes.transformers import latent

        return latent.latent_cache(engine.model, latent_rank(engine))
    return caches.build_cache(strategy or engine.settings.cache, engine.model.config, engine.max_context())


def latent_mode(engine: "Engine", mode: AttentionMode | None = None) -> bool:
    """Whether ``mode`` (default: the current one) is KV Scope's MLA latent of this model (not a native MLA)."""
    return isinstance(mode or engine.mode, MLA) and not engine.spec.is_mla


def latent_rank(engine: "Engine", mode: AttentionMode | None = None) -> int:
    return int(effective_spec(engine.spec, engine.settings.with_(attention=mode or engine.mode)).latent_rank)


def set_attn_impl(engine: "Engine", impl: str) -> None:
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
            needs_mask = isinstance(engine.settings.cache, Static) or isinstance(engine.mode, Window)
            if flash_sdpa_works(engine, needs_mask):
                kernel = "sdpa-flash"
            else:
                kernel = "sdpa (flash refused: " + ("masked attention)" if needs_mask else "not on this device)")
    for model in {id(m): m for m in (engine.model, engine.base_model) if m is not None}.values():
        model.set_attn_implementation(hf)
    engine.kernel = kernel
    engine.settings = engine.settings.with_(attn_impl=impl)


def flash_sdpa_works(engine: "Engine", with_mask: bool) -> bool:
    """Whether SDPA's flash backend accepts this device/dtype (and a mask), tried on a small problem."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = next(engine.model.parameters()).dtype
    q = torch.zeros(1, 2, 4, engine.spec.head_dim, device=engine.device, dtype=dtype)
    mask = torch.ones(1, 1, 4, 4, device=engine.device, dtype=torch.bool).tril() if with_mask else None
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=mask is None)
        return True
    except RuntimeError:
        return False


def layer_pattern_model(engine: "Engine", eff: ModelSpec):
    """The base model with the sliding/full layers ``eff`` describes (a Llama gets a Mistral twin for a window)."""
    from kvscope.core.runtimes.transformers import (
        convert)  # transformers, a 9 s import: not when serve() imports this module

    if eff.layer_types == engine.spec.layer_types and eff.sliding_window == engine.spec.sliding_window:
        convert.restore_layer_pattern(engine.base_model, engine._native_pattern)
        return engine.base_model
    if eff.num_full_layers == 0:
        return convert.with_window(engine.base_model, eff.sliding_window)
    if eff.num_sliding_layers == 0:
        convert.restore_layer_pattern(engine.base_model, engine._native_pattern)
        return convert.with_window(engine.base_model, None)
    raise SettingsError(f"{engine.spec.label} cannot take the layer pattern of this mode")


def set_attention(engine: "Engine", mode: AttentionMode, live: bool) -> str:
    """Convert the model (and, when ``live``, the cache) to ``mode``. Returns what happened, for the event.

    Not atomic by itself: ``apply`` runs it inside a transaction that undoes it on failure."""
    from kvscope.core.runtimes.transformers import (
        convert)  # transformers, a 9 s import: not when serve() imports this module

    previous = engine.mode
    before = effective_spec(engine.spec, engine.settings)
    eff = effective_spec(engine.spec, engine.settings.with_(attention=mode))
    if latent_mode(engine, mode):
        return set_latent(engine, mode, previous, before, eff, live)
    target = eff.num_kv_heads
    origin = engine._kv_origin
    exact = True
    try:
        current = convert.kv_heads_of(engine.base_model)
    except SettingsError:
        # No regroupable heads (fused QKV) or layers of different head counts (MiMo-V2-Flash): switch.check_model
        # refuses head changes for such a model, so its projections are still its own, as the target needs.
        current = None
    merged, merge_note = None, None
    if origin is not None and current is not None and (current != target or target == origin.heads
                                                       or merging(engine, mode)):
        # From the model's own projections, never from the last converted state; its own count: the loaded
        # tensors themselves.
        merged, merge_note = fit_merge(engine, mode, target, live)
        if merged is None:
            exact = convert.set_kv_heads(engine.base_model, target, origin=origin)
        else:
            from kvscope.core.runtimes.transformers import merge

            merge.set_merged(engine.base_model, origin, merged)
            exact = False
    engine.model = engine._layer_pattern_model(eff)
    engine.mode = mode
    engine.settings = engine.settings.with_(attention=mode)
    set_attn_impl(engine, engine.settings.attn_impl)
    engine._weights_observed = model_weight_bytes(engine.model)
    if not live or engine.cache is None:
        return mode.key
    if latent_mode(engine, previous):
        left = leave_latent(engine)
        if left:
            return rerun_tokens(engine, left)
        before = effective_spec(engine.spec, engine.settings.with_(attention=native_attention(engine.spec)))
    pattern_changed = (before.layer_types, before.sliding_window) != (eff.layer_types, eff.sliding_window)
    if pattern_changed and tokens_lost(engine, before, eff):
        return rerun_tokens(engine, f"the {previous.key} cache no longer holds the earliest tokens")
    strategy = engine.settings.cache
    if pattern_changed and tokens_dropped(engine, before):
        return rerun_tokens(engine, f"the {strategy.key} cache no longer holds the tokens it dropped")
    if strategy.needs_attention_weights:
        # Each K/V head kept its own heavy hitters: slot i is a different token in each head, so heads
        # cannot be repeated or pooled, and a refill would carry no scores.
        return rerun_tokens(engine, f"{strategy.name} keeps different tokens in each K/V head")
    pooled = pooled_cache_rerun(engine, mode, previous)
    if pooled:
        return rerun_tokens(engine, pooled)
    notes = []
    old_heads = convert.cache_heads(engine.cache)
    if old_heads is not None and old_heads != target:
        if merged is not None:
            from kvscope.core.runtimes.transformers import merge

            merge.merge_cache(engine.cache, merged, old_heads)
            moved = False
        else:
            moved = convert.convert_cache_kv_heads(engine.cache, old_heads, target)
        own = origin.heads if origin is not None else engine.spec.num_kv_heads
        strategy = engine.settings.cache
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
        return rerun_tokens(engine, "the layers' states beside K/V are recomputed in the new cache")
    if pattern_changed:
        fresh = new_cache(engine)
        convert.refill_cache(fresh, convert.dense_kv(engine.cache), seq_length=engine.seq_len)
        engine.cache = fresh
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


def set_latent(engine: "Engine", mode: AttentionMode, previous: AttentionMode, before: ModelSpec, eff: ModelSpec,
               live: bool) -> str:
    """MLA on a model that is not MLA: the model as loaded (its own K/V projections, its own layer pattern) and
    its cache's full-attention layers turned into latents of its own K/V (``kvscope.core.runtimes.transformers.latent``),
    in place; the tokens so far re-run only where the cache no longer holds the model's own K/V of them."""
    from kvscope.core.runtimes.transformers import convert, latent

    origin = engine._kv_origin
    rank = latent_rank(engine, mode)
    if origin is not None:
        try:
            current = convert.kv_heads_of(engine.base_model)
        except SettingsError:
            current = None
        if current is not None and current != origin.heads:
            convert.set_kv_heads(engine.base_model, origin.heads, origin=origin)
    engine.model = engine._layer_pattern_model(eff)
    engine.mode = mode
    engine.settings = engine.settings.with_(attention=mode)
    set_attn_impl(engine, engine.settings.attn_impl)
    engine._weights_observed = model_weight_bytes(engine.model)
    if not live or engine.cache is None or not engine.seq_len:
        return f"latent of rank {rank} per layer, fitted at the prefill"
    why = latent_rerun(engine, mode, previous)
    if why:
        return rerun_tokens(engine, why)
    notes = []
    if latent_mode(engine, previous):
        # Down in rank: each layer fits its new basis on what its latent holds (no re-run).
        for layer in engine.cache.layers:
            if isinstance(layer, latent.LatentLayer):
                layer.refit(rank)
        return f"latent refitted to rank {rank} in place, on what the rank-{latent_rank(engine, previous)} latent held"
    held = convert.cache_heads(engine.cache)
    own = origin.heads if origin is not None else engine.spec.num_kv_heads
    if held is not None and held != own:
        convert.convert_cache_kv_heads(engine.cache, held, own)  # repeated heads: one of each (exact)
        notes.append(f"{held} -> {own} K/V heads (the model's own, as loaded)")
    if (before.layer_types, before.sliding_window) != (eff.layer_types, eff.sliding_window):
        fresh = caches.build_cache(engine.settings.cache, engine.model.config, engine.max_context())
        convert.refill_cache(fresh, convert.dense_kv(engine.cache), seq_length=engine.seq_len)
        engine.cache = fresh
        notes.append("the model's own layer pattern")
    t = time.perf_counter()
    how = latent.convert_to_latent(engine.cache, engine.model, rank)
    notes.append(f"fitted on the {engine.seq_len:,} tokens so far in {1000 * (time.perf_counter() - t):.0f} ms; {how}")
    return f"cache converted in place to a latent of rank {rank} per layer: " + "; ".join(notes)


def latent_rerun(engine: "Engine", mode: AttentionMode, previous: AttentionMode | None = None) -> str | None:
    """Why a switch to MLA's latent re-runs the tokens so far (None: the cache converts in place): the cache must
    hold the model's own K/V of every token (``rerun.may_rerun`` asks this too)."""
    previous = previous or engine.mode
    if engine.cache is None or not engine.seq_len:
        return None
    if latent_mode(engine, previous):
        held = latent_rank(engine, previous)
        rank = latent_rank(engine, mode)
        return None if rank <= held else (f"a latent of rank {held} cannot give back the directions a rank of "
                                          f"{rank} keeps")
    native = native_attention(engine.spec)
    before = effective_spec(engine.spec, engine.settings.with_(attention=previous))
    after = effective_spec(engine.spec, engine.settings.with_(attention=native))
    if tokens_lost(engine, before, after):
        return f"the {previous.key} cache no longer holds the earliest tokens"
    if tokens_dropped(engine, before):
        return f"the {engine.settings.cache.key} cache no longer holds the tokens it dropped"
    if before.layer_states and (before.layer_types, before.sliding_window) != (after.layer_types, after.sliding_window):
        return "the layers' states beside K/V are recomputed in the new cache"
    return pooled_cache_rerun(engine, native, previous)


def leave_latent(engine: "Engine") -> str | None:
    """Leaving MLA's latent: a full-rank latent gives every token's K/V back (to rounding) into a dynamic cache;
    below full rank the tokens' own K/V are gone, and the reason to re-run them is returned."""
    from kvscope.core.runtimes.transformers import convert, latent

    if engine.cache is None or not engine.seq_len:
        return None
    layers = [layer for layer in engine.cache.layers if isinstance(layer, latent.LatentLayer)]
    if any(layer.rank < layer.width for layer in layers):
        return (f"a latent of rank {layers[0].rank} kept only part of the tokens' K/V; the model as loaded "
                "computes them again")
    fresh = caches.build_cache(engine.settings.cache, engine.model.config, engine.max_context())
    convert.refill_cache(fresh, convert.dense_kv(engine.cache), seq_length=engine.seq_len)
    engine.cache = fresh
    return None


def pooled_cache_rerun(engine: "Engine", mode: AttentionMode, previous: AttentionMode | None = None) -> str | None:
    """Why a switch to ``mode`` re-runs the tokens so far for the K/V heads the cache holds (None: it need not):
    ``switches.pooled_reason`` for the live cache's heads (``rerun.may_rerun`` asks the same rule of the settings)."""
    from kvscope.core.runtimes.transformers import (
        convert)  # transformers, a 9 s import: not when serve() imports this module

    origin = engine._kv_origin
    if origin is None or engine.cache is None or not engine.seq_len:
        return None
    held = convert.cache_heads(engine.cache)
    why = switches.pooled_reason(engine.spec, previous or engine.mode, mode, held, origin.heads)
    if why is None and not isinstance(mode, MLA):  # keys normalized after their projection (Qwen3, Gemma 3: issue 34)
        from kvscope.core.runtimes.transformers import merge

        target = effective_spec(engine.spec, engine.settings.with_(attention=mode)).num_kv_heads
        why = merge.normalized_keys_rerun(engine.base_model, held, target, origin.heads)
    return why


def merging(engine: "Engine", mode: AttentionMode | None) -> bool:
    """Whether ``mode`` makes fewer K/V heads than the model's own with the aligned merge (``switches.merging``)."""
    origin = engine._kv_origin
    return origin is not None and switches.merging(engine.spec, mode, origin.heads)


def own_kv_held(engine: "Engine") -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """Per cache layer, the K/V it holds when they are the model's own (its own heads, or them repeated);
    None otherwise (no tokens, merged or pooled heads, a latent)."""
    from kvscope.core.runtimes.transformers import convert, latent

    origin = engine._kv_origin
    if engine.cache is None or not engine.seq_len or latent.is_latent(engine.cache) or \
            engine.settings.cache.needs_attention_weights:  # h2o: each head holds tokens of its own choosing
        return None
    held = convert.cache_heads(engine.cache)
    if held is None or held % origin.heads:
        return None
    return {i: convert._layer_kv(layer) for i, layer in enumerate(engine.cache.layers)
            if getattr(layer, "is_initialized", False)}


def fit_merge(engine: "Engine", mode: AttentionMode, target: int, live: bool) -> tuple[Any, str | None]:
    """The aligned merge of the model's own heads to ``target`` (``kvscope.core.runtimes.transformers.merge``),
    calibrated on the cache's own K/V, else on the last calibration kept; (None, why) where the mean applies
    instead, (None, None) where no merge is asked."""
    if not merging(engine, mode):
        return None, None
    from kvscope.core.runtimes.transformers import merge

    origin = engine._kv_origin
    why = merge.problem(engine.base_model)
    if why:
        return None, f"heads mean-pooled from the model's own {origin.heads}: {why}"
    t = time.perf_counter()
    own_kv = own_kv_held(engine) if live else None
    passed = ""
    if not own_kv and not engine._merge_calibration:
        if not (live and engine.ids is not None and engine.seq_len):
            return None, (f"heads mean-pooled from the model's own {origin.heads}: no tokens of its own K/V to "
                          "align them on yet")
        own_kv = own_kv_by_pass(engine, engine.ids)
        passed = " (their K/V computed again by the model as loaded)"
    try:
        merges, made, tokens = merge.fit(engine.base_model, origin, target, own_kv=own_kv,
                                         kept=engine._merge_calibration)
    except SettingsError as exc:  # a rotary the merge cannot read: the mean, and why
        return None, f"heads mean-pooled from the model's own {origin.heads}: {exc}"
    engine._merge_calibration.update(made)
    return merges, (f"heads aligned and merged from the model's own {origin.heads}, calibrated on {tokens:,} "
                    f"tokens{passed}, in {1000 * (time.perf_counter() - t):.0f} ms")


def own_kv_by_pass(engine: "Engine", ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The K/V the model as loaded (its own projections, put back) computes for the last ``CALIBRATION_TOKENS``
    of ``ids``, in one pass into a cache of its own (the live cache is not touched)."""
    from transformers import DynamicCache

    from kvscope.core.runtimes.transformers import convert, merge

    origin = engine._kv_origin
    convert.set_kv_heads(engine.base_model, origin.heads, origin=origin)
    cache = DynamicCache(config=engine.model.config)
    with torch.inference_mode(), engine._kernel_context():
        engine.model(input_ids=ids[:, -merge.CALIBRATION_TOKENS:].to(engine.device), cache=cache, use_cache=True,
                     logits_to_keep=1)
    return {i: convert._layer_kv(layer) for i, layer in enumerate(cache.layers)
            if getattr(layer, "is_initialized", False)}


def calibrate_merge(engine: "Engine", prompt_ids: torch.Tensor) -> str | None:
    """A run that starts in an aligned merge with nothing to calibrate it on: the prompt goes through the model as
    loaded first (its own K/V projections, one pass), and the merge is fitted on that K/V. Returns what was done."""
    from kvscope.core.runtimes.transformers import convert, merge

    origin = engine._kv_origin
    if not merging(engine, engine.mode) or engine._merge_calibration or merge.problem(engine.base_model):
        return None
    target = effective_spec(engine.spec, engine.settings).num_kv_heads
    own = own_kv_by_pass(engine, prompt_ids)
    try:
        merges, made, tokens = merge.fit(engine.base_model, origin, target, own_kv=own)
    except SettingsError as exc:
        convert.set_kv_heads(engine.base_model, target, origin=origin)
        return f"K/V heads mean-pooled from the model's own {origin.heads}: {exc}"
    engine._merge_calibration.update(made)
    merge.set_merged(engine.base_model, origin, merges)
    engine._weights_observed = model_weight_bytes(engine.model)
    return f"K/V heads aligned and merged from the model's own {origin.heads}, calibrated on the prompt's {tokens:,} tokens"


def tokens_dropped(engine: "Engine", eff: ModelSpec | None = None) -> int:
    """Tokens the live cache's full-attention layers (those of ``eff``, default the current settings')
    no longer hold: a token-selecting cache past its capacity (``switches.tokens_dropped``)."""
    if engine.cache is None:
        return 0
    return switches.tokens_dropped(engine.settings.cache, eff or effective_spec(engine.spec, engine.settings),
                                   engine.seq_len)


def tokens_lost(engine: "Engine", before: ModelSpec, after: ModelSpec) -> bool:
    """Whether some layer would need tokens that its sliding window has already dropped (``switches.tokens_lost``)."""
    return switches.tokens_lost(before, after, engine.seq_len)


def rerun_tokens(engine: "Engine", why: str) -> str:
    """Rebuild the cache by running every token so far through the current model (no new token), in one
    batched pass (a prefill). A shadow engine (``begin_switch``) only builds the fresh cache here and leaves
    the pass to its background thread (``_fill``)."""
    engine.cache = new_cache(engine)
    engine.cache_base_tokens = engine.seq_len
    if engine._defer_rerun:
        engine._rerun_why = why
        engine._tokens_rerun = engine.seq_len
        return f"re-ran {engine.seq_len} tokens: {why}"
    if engine.ids is not None and engine.seq_len:
        engine.progress(f"re-running {engine.seq_len:,} tokens ({why})\u2026")
        with torch.inference_mode(), engine._forward_context():
            out = engine._measured_forward()
        engine._next_logits = out.logits[:, -1, :].float()
        engine.cache = out.cache if getattr(out, "cache", None) is not None else engine.cache
    engine._tokens_rerun = engine.seq_len
    return f"re-ran {engine.seq_len} tokens: {why}"


def convert_to(engine: "Engine", name: str, parsed: Any, eager_for: str | None) -> str:
    """Convert the model and the cache to the switch's target (not atomic: the caller undoes on failure).
    Returns what happened, for the event (the kernel's switch is described after the trial pass)."""
    if name == "attention":
        return set_attention(engine, parsed, live=True)
    if name == "attn_impl":
        set_attn_impl(engine, parsed)
        return ""
    if eager_for is not None:
        set_attn_impl(engine, "eager")
    detail = switch_cache(engine, parsed)
    if eager_for is not None:
        detail += (f"; attn-impl {eager_for} -> eager: {parsed.name} scores tokens by the attention "
                   "weights, which only eager attention returns")
    return detail


def switch_cache(engine: "Engine", strategy: CacheStrategy) -> str:
    from kvscope.core.runtimes.transformers import (
        convert)  # transformers, a 9 s import: not when serve() imports this module

    if engine.cache is None or engine.seq_len == 0:
        engine.settings = engine.settings.with_(cache=strategy)
        return "takes effect at the prefill"
    # A static cache too short for the run was refused by the plan (switches.refusal), before anything changed.
    dropped = tokens_dropped(engine)
    old = engine.settings.cache
    engine.settings = engine.settings.with_(cache=strategy)
    if INDEXED_ATTENTION in engine.spec.layer_types:
        # A DSA layer's indexer keys cannot be carried across (dense_kv reads K/V only): recompute them.
        return rerun_tokens(engine, "the sparse-attention indexer keys are recomputed in the new cache")
    if effective_spec(engine.spec, engine.settings).layer_states:
        # Nor can the states layers keep beside K/V (convolution, recurrent, compressor): a fresh cache filled
        # with K/V alone would start them from zero at the next token.
        return rerun_tokens(engine, "the layers' states beside K/V are recomputed in the new cache")
    if dropped:
        return rerun_tokens(engine, f"the {old.key} cache has dropped {dropped:,} of them")
    if strategy.needs_attention_weights:
        # Copied K/V carry no attention scores: the tokens so far go through the model to score them.
        return rerun_tokens(engine, f"{strategy.name} scores every token by the attention it receives")
    fresh = new_cache(engine, strategy)
    try:
        convert.refill_cache(fresh, convert.dense_kv(engine.cache), seq_length=engine.seq_len)
    except (SettingsError, NotImplementedError, RuntimeError) as exc:
        return rerun_tokens(engine, f"the cache could not be moved across ({exc})")
    engine.cache = fresh
    engine.cache_base_tokens = engine.seq_len
    set_attn_impl(engine, engine.settings.attn_impl)  # the flash kernel may accept this cache's mask or not
    return "cache moved across" + (" (quantized: lossy)" if isinstance(strategy, Quantized) else "")

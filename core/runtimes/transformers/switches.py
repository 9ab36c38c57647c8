"""The transformers runtime's light half: its switch grammar and its one rule set, answered without torch.

A switch is a value. ``plan(spec, state, key, value)`` takes the model's description, the run's settings as a
``SwitchState`` (what runs, the device, the tokens so far) and a switch ``key=value``, and answers a
``SwitchPlan``: the target settings, or the refusal and its reason; whether it may re-run the tokens so far;
what it converts. The window greys its keys with it (``switch_problem``, the registry's hook) and the engine
applies it (``kvscope.core.runtimes.transformers.engine.Engine``, which then checks only what the loaded model
itself shows: fused projections, a backend that cannot build here, a kernel transformers refuses for the class).

Plain arithmetic on the spec: no torch, no transformers (the window's process imports this).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping

from kvscope.core.model.attention import (MLA, AttentionMode, SettingsError, Window, latent_widths, native_attention,
                                          parse_attention)
from kvscope.core.model.caches import CacheStrategy, Quantized, Static, TokenSelecting, kv_layout, parse_cache, static_shortfall
from kvscope.core.model.hf_config import ViewNotKnown, known_views_only
from kvscope.core.model.settings import RunSettings, effective_spec, parse_attn_impl
from kvscope.core.model.spec import INDEXED_ATTENTION, SLIDING_ATTENTION, ModelSpec, SpecError, dtype_bytes

#: The setting each switch axis names, as the event carries it (``switch_key``).
AXES = {"attention": "attention", "attn_impl": "attn-impl", "cache": "cache"}


def parse_switch_value(key: str, value: str):
    """Parse the value of a live switch ``KEY=VALUE`` (``attention``, ``attn-impl``, ``cache``): the setting's
    name (``attention``, ``attn_impl``, ``cache``) and the parsed value. SettingsError for either that does not."""
    k = key.strip().lower().replace("_", "-")
    if k == "attention":
        return "attention", parse_attention(value)
    if k in ("attn-impl", "attn", "impl", "flash"):
        if k == "flash":
            v = value.strip().lower()
            if v in ("on", "1", "true", "yes"):
                return "attn_impl", "flash"
            if v in ("off", "0", "false", "no"):
                return "attn_impl", "sdpa"
        return "attn_impl", parse_attn_impl(value)
    if k == "cache":
        return "cache", parse_cache(value)
    raise SettingsError(f"unknown setting {key!r} to switch; use attention, attn-impl or cache")


@dataclass(frozen=True)
class SwitchState:
    """A transformers run's settings as a switch is judged from them: what runs, where, and how far it is.

    ``tokens``: the context so far (0 before the prefill: nothing converts, nothing re-runs); ``cache_tokens``: the
    tokens a quantized cache quantized at its first update (None: ``tokens``); ``max_context``: what a static cache
    preallocates (None: the model's maximum); ``ahead``: the tokens the run will still generate; ``dtype``: the
    cache's element type (None: the spec's); ``light``: judged in the window's process."""

    attention: AttentionMode
    attn_impl: str = "sdpa"
    cache: CacheStrategy = parse_cache("dynamic")
    device: str | None = None
    tokens: int = 0
    cache_tokens: int | None = None
    max_context: int | None = None
    ahead: int = 0
    dtype: str | None = None
    #: Judged where transformers must not be imported (the window): a layout only transformers knows is left to
    #: the engine (no refusal).
    light: bool = False

    @classmethod
    def of(cls, now: Mapping[str, str], device: str | None = None, **fields: Any) -> "SwitchState":
        """The state of the settings ``now`` (keyed ``attention``, ``attn-impl``, ``cache``, canonical spellings as a
        Sample carries them). KeyError / SettingsError for settings that are missing or do not parse."""
        return cls(attention=parse_attention(now["attention"]), attn_impl=parse_attn_impl(now["attn-impl"]),
                   cache=parse_cache(now["cache"]), device=device, **fields)

    def spelled(self, name: str) -> str:
        """The setting ``name`` (``attention``, ``attn_impl``, ``cache``) in its canonical spelling."""
        return self.attn_impl if name == "attn_impl" else getattr(self, name).key


@dataclass(frozen=True)
class SwitchPlan:
    """What a switch does from a state: its target, or why not; whether it may re-run; what it converts."""

    name: str  # attention / attn_impl / cache
    before: str  # the setting now, canonical
    after: str  # the setting asked, canonical
    target: SwitchState  # the settings after the switch (the kernel it takes along included)
    refusal: str | None = None  # why it cannot run (None: the rules allow it)
    #: The kernel the switch takes along to eager (a cache that scores tokens by their attention), or None.
    eager_for: str | None = None
    #: Whether it may run the tokens so far through the model again (judged from the settings: the engine's own
    #: conversions decide on the cache they find).
    reruns: bool = False
    converts: tuple[str, ...] = ()  # what changes: "model", "cache", "kernel"
    #: False where only transformers could say how the mode lays out the layers (the window's process: the
    #: engine judges).
    known: bool = True

    @property
    def key(self) -> str:
        """The switch's axis as the event names it (``switch_key``)."""
        return AXES[self.name]

    @property
    def no_change(self) -> bool:
        return self.before == self.after

    def fields(self) -> dict[str, str]:
        """Its ``switch_key`` / ``switch_before`` / ``switch_after`` fields."""
        return {"switch_key": self.key, "switch_before": self.before, "switch_after": self.after}


# ------------------------------------------------------------------------------------------------ the rules


def is_latent(spec: ModelSpec, mode: AttentionMode) -> bool:
    """Whether ``mode`` is KV Scope's MLA latent of this model (a model that is not MLA itself)."""
    return isinstance(mode, MLA) and not spec.is_mla


def tokens_lost(before: ModelSpec, after: ModelSpec, tokens: int) -> bool:
    """Whether some layer of ``after`` would need tokens that its sliding window under ``before`` has dropped."""
    for old, new in zip(before.layer_types, after.layer_types):
        held = tokens if old != SLIDING_ATTENTION else min(tokens, (before.sliding_window or tokens + 1) - 1)
        needed = tokens if new != SLIDING_ATTENTION else min(tokens, (after.sliding_window or tokens + 1) - 1)
        if held < needed:
            return True
    return False


def tokens_dropped(strategy: CacheStrategy, eff: ModelSpec, tokens: int) -> int:
    """Tokens a cache of ``strategy`` on the full-attention layers of ``eff`` no longer holds after ``tokens``: a
    token-selecting cache past its capacity."""
    if not isinstance(strategy, TokenSelecting) or not eff.num_full_layers:
        return 0
    return max(0, tokens - strategy.capacity)


def quantized_shape_problem(eff: ModelSpec, strategy: Quantized, elem: float, base: int, limit: int,
                            attention: str) -> str | None:
    """Why a quantized cache would fail on ``eff`` (None: it would not): it quantizes everything it holds at its
    first update (``base`` tokens) and at each residual flush after it, and quanto and hqq refuse tensors their
    groups do not divide; the predictor's formulas raise what the backends raise."""
    if strategy.backend == "fp8" or base <= 0:
        return None
    return _quantized_shape_problem(eff, strategy, elem, base, limit, attention)


@functools.lru_cache(maxsize=1024)
def _quantized_shape_problem(eff: ModelSpec, strategy: Quantized, elem: float, base: int, limit: int,
                             attention: str) -> str | None:
    # Sizes at the flushes repeat modulo any group size after at most 64 flushes (groups are powers of two up to 64
    # here), so those are enough, and a key press never waits on thousands of them.
    layout = kv_layout(eff)
    step = strategy.residual_length
    for n in range(base, min(max(limit, base), base + 64 * step) + 1, step):
        try:
            strategy.kv_bytes(layout, 1, n, elem, prompt_tokens=base)
        except SettingsError as exc:
            return (f"{strategy.key} with {attention} would fail when the cache is quantized at {n:,} tokens: "
                    f"{str(exc).splitlines()[0]}")
    return None


@functools.lru_cache(maxsize=256)
def _applied_known(spec: ModelSpec, mode: AttentionMode) -> ModelSpec:
    # The window's process asks this for every choice at every settings change, and never loads torch: a view
    # transformers would have to find raises ViewNotKnown.
    with known_views_only():
        mode.check(spec)
        return mode.apply(spec)


def _effective(spec: ModelSpec, mode: AttentionMode, light: bool = False) -> ModelSpec:
    """``spec`` under ``mode``; ViewNotKnown where only transformers could say and it is not to be asked here
    (``light``, or not loaded: the window's process never imports it for this)."""
    try:
        return _applied_known(spec, mode)
    except ViewNotKnown:
        if light or "transformers" not in sys.modules:
            raise
    return effective_spec(spec, RunSettings(attention=mode))


def refusal(spec: ModelSpec, now: SwitchState, target: SwitchState, name: str) -> str | None:
    """Why the switch of ``name`` from ``now`` to ``target`` cannot run (None: these rules allow it): the rules
    that the model's description, the device and the tokens so far decide. ViewNotKnown: only transformers knows."""
    mode, impl, strategy, label = target.attention, target.attn_impl, target.cache, spec.label
    try:
        eff = _effective(spec, mode, target.light)
    except ViewNotKnown:
        raise
    except (SettingsError, SpecError, ValueError) as exc:
        return str(exc).splitlines()[0] if str(exc) else f"{mode.key} is not available for {label}"
    cuda = str(target.device or "").startswith("cuda")
    if strategy.needs_attention_weights and impl != "eager":
        return (f"the {strategy.key} cache scores tokens by the attention weights they receive, which only eager "
                f"attention returns: attn-impl {impl} cannot run while it is active (switch the cache first)")
    if is_latent(spec, mode) and strategy.name != "dynamic":
        return (f"MLA's latent is a dynamic cache of its own (a latent and a basis per layer): the {strategy.key} "
                "cache cannot hold it; " + ("leave MLA first" if is_latent(spec, now.attention)
                                            else "switch the cache to dynamic first"))
    if isinstance(strategy, TokenSelecting) and INDEXED_ATTENTION in eff.layer_types:
        return (f"a {strategy.name} cache cannot evict the sparse-attention indexer keys of {label}'s DSA layers; "
                "use dynamic or static")
    if strategy.needs_cuda and not cuda:
        where = f"this run is on {target.device}" if target.device else "the device is not known yet"
        return f"the {strategy.key} cache needs CUDA ({where}): it moves layers between GPU and CPU memory"
    if isinstance(mode, Window) and mode.window < 2:
        return "a sliding window must be at least 2 tokens (transformers keeps the last W - 1)"
    if isinstance(mode, MLA) and impl == "flash" and not cuda:
        # SDPA's flash kernel off CUDA takes one head size for K and V; MLA's differ ("No available kernel").
        return "SDPA's flash kernel off CUDA cannot run MLA's K/V head sizes (it takes one head size for K and V)"
    if spec.is_mla and not isinstance(mode, MLA):
        return (f"{label} caches a compressed latent (MLA): it has no K/V heads to regroup and no sliding-window "
                f"layers, so {mode.key} is not available for it")
    limit = int(target.max_context or spec.max_position_embeddings)
    if name == "cache" and isinstance(strategy, Static) and now.tokens > 0:
        shortfall = static_shortfall(limit, now.tokens, now.ahead)
        if shortfall:
            return shortfall
    if isinstance(strategy, Quantized):
        if eff.num_sliding_layers:
            which = f"slide under {mode.key}" if isinstance(mode, Window) else f"of {label} slide"
            return (f"a quantized cache needs full-attention layers; transformers refuses it with a sliding window "
                    f"({eff.num_sliding_layers} of {eff.num_layers} layers {which})")
        if eff.num_state_layers:
            return (f"a quantized cache needs full-attention layers; transformers refuses it with "
                    f"{eff.num_state_layers} of {eff.num_layers} layers of {label} keeping linear-attention, "
                    "state-space or convolution states (or sharing K/V)")
        if now.tokens > 0:
            # A switch quantizes what the cache holds; under a quantized cache an attention switch keeps its count.
            base = now.cache_tokens if isinstance(now.cache, Quantized) and now.cache_tokens is not None else now.tokens
            return quantized_shape_problem(eff, strategy, dtype_bytes(target.dtype or spec.dtype), base, limit,
                                           mode.key)
    return None


def may_rerun(spec: ModelSpec, now: SwitchState, target: SwitchState, name: str) -> bool:
    """Whether the switch of ``name`` may run the tokens so far through the model again, judged from the settings
    alone: the cache no longer holds what the target needs (tokens a window or a token-selecting cache dropped, the
    layers' states, indexer keys, attention scores, the tokens' own K/V under pooled or merged heads, a latent's
    directions). The engine's conversions decide on the cache they find; a switch judged False never re-runs."""
    n = now.tokens
    if name == "attn_impl" or n <= 0:
        return False
    mode, previous = target.attention, now.attention
    light = now.light
    before = _effective(spec, previous, light)  # the cache's layout depends on the attention alone
    if name == "cache":
        return (INDEXED_ATTENTION in spec.layer_types or bool(before.layer_states)
                or bool(tokens_dropped(now.cache, before, n)) or target.cache.needs_attention_weights)
    if now.cache.needs_attention_weights:
        return True
    if is_latent(spec, mode):
        if is_latent(spec, previous):
            return int(_effective(spec, mode, light).latent_rank) > int(before.latent_rank)
        own = _effective(spec, native_attention(spec), light)
        if tokens_lost(before, own, n) or tokens_dropped(now.cache, before, n):
            return True
        if before.layer_states and (before.layer_types, before.sliding_window) != (own.layer_types, own.sliding_window):
            return True
        return pooled_rerun(spec, previous, native_attention(spec), light)
    if is_latent(spec, previous):
        return int(before.latent_rank) < min(latent_widths(spec))
    if pooled_rerun(spec, previous, mode, light):
        return True
    after = _effective(spec, mode, light)
    if (before.layer_types, before.sliding_window) == (after.layer_types, after.sliding_window):
        return False
    return tokens_lost(before, after, n) or bool(tokens_dropped(now.cache, before, n)) or bool(before.layer_states)


def merging(spec: ModelSpec, mode: AttentionMode | None, own: int | None = None, light: bool = False) -> bool:
    """Whether ``mode`` makes fewer K/V heads than the model's own (``own``, default the spec's) with the aligned
    merge (not a multiple of them)."""
    if mode is None or getattr(mode, "merge", "mean") == "mean" or isinstance(mode, MLA):
        return False
    own = own or spec.num_kv_heads
    return _effective(spec, mode, light).num_kv_heads % own != 0


def pooled_reason(spec: ModelSpec, previous: AttentionMode, mode: AttentionMode, held: int | None,
                  own: int | None = None, light: bool = False) -> str | None:
    """Why a switch from ``previous`` to ``mode`` re-runs the tokens so far for a cache of ``held`` K/V heads (None:
    it need not). Every head count that is not a multiple of the model's own (``own``) is pooled or merged from the
    model's own projections, and so is a cache held at it: going back to a count of the model's own, or up to more
    heads, repeating those heads cannot give back the tokens' own K/V; an aligned merge cannot merge merged heads."""
    own = own or spec.num_kv_heads
    if isinstance(mode, MLA) or isinstance(previous, MLA) or held is None or held % own == 0:
        return None
    target = _effective(spec, mode, light).num_kv_heads
    if held == target and merging(spec, mode, own, light) == merging(spec, previous, own, light):  # the same heads, the same way
        return None
    how = "merged" if merging(spec, previous, own, light) else "mean-pooled"
    cached = f"the cache's {held} {how} head{'s' if held != 1 else ''}"
    if target % own == 0:
        back = ("the model's own K/V projections are back, as loaded" if target == own
                else f"{target} K/V heads repeat the model's own {own}, as loaded")
        return f"{back}; {cached} cannot give the tokens' own K/V back"
    if target > held:
        return f"{target} K/V heads are pooled afresh from the model's own {own}; repeating {cached} would not give their K/V"
    if merging(spec, mode, own, light) or merging(spec, previous, own, light):
        # Aligned merges are fitted from the model's own heads: a cache of merged heads cannot be merged again the
        # same way (mean-pooling can: a mean of equal groups' means is the mean of the heads).
        return (f"{target} K/V head{'s are' if target != 1 else ' is'} merged afresh from the model's own {own}; "
                f"{cached} cannot be merged again")
    return None


def pooled_rerun(spec: ModelSpec, previous: AttentionMode, mode: AttentionMode, light: bool = False) -> bool:
    """``pooled_reason`` for a cache at the heads ``previous`` makes (what a run's cache holds)."""
    if isinstance(previous, MLA):
        return False
    return pooled_reason(spec, previous, mode, _effective(spec, previous, light).num_kv_heads, light=light) is not None


def plan(spec: ModelSpec, state: SwitchState, key: str, value: Any, foresee: bool = True) -> SwitchPlan:
    """Switch ``key=value`` from ``state``: its target, or the refusal and its reason; whether it may re-run the
    tokens so far (``foresee``; False: not asked, the window's greying needs only the refusal); what it converts.
    ``value`` is a spelling (parsed here) or a parsed value. SettingsError when the key or the value does not
    parse (the grammar, before any rule)."""
    if isinstance(value, str):
        name, parsed = parse_switch_value(key, value)
    else:
        name, parsed = {"attention": "attention", "cache": "cache"}.get(key, "attn_impl"), value
    eager_for = None
    changes: dict[str, Any] = {name: parsed}
    if name == "cache" and parsed.needs_attention_weights and state.attn_impl != "eager":
        eager_for, changes["attn_impl"] = state.attn_impl, "eager"  # the switch takes the kernel along, and says so
    target = replace(state, **changes)
    before, after = state.spelled(name), target.spelled(name)
    if before == after:
        return SwitchPlan(name=name, before=before, after=after, target=state)
    try:
        why = refusal(spec, state, target, name)
    except ViewNotKnown:
        return SwitchPlan(name=name, before=before, after=after, target=target, eager_for=eager_for, known=False)
    if why:
        return SwitchPlan(name=name, before=before, after=after, target=target, refusal=why, eager_for=eager_for)
    converts = ("kernel",) if name == "attn_impl" else ("model", "cache") if name == "attention" else ("cache",)
    if eager_for:
        converts += ("kernel",)
    try:
        reruns = foresee and may_rerun(spec, state, target, name)
    except (ViewNotKnown, SettingsError, SpecError, ValueError):
        reruns = True  # a layout only transformers knows (or a state no run holds): the engine's conversions decide
    return SwitchPlan(name=name, before=before, after=after, target=target, eager_for=eager_for, converts=converts,
                      reruns=reruns)


def switch_problem(spec: ModelSpec, device: str | None, now: Mapping[str, str], key: str, value: str,
                   tokens: int = 0, max_context: int | None = None, ahead: int = 0) -> str | None:
    """Why the engine would refuse ``key=value`` from the settings ``now`` (keyed ``attention``, ``attn-impl``,
    ``cache``, canonical spellings as a Sample carries them): ``plan``'s refusal, the one line the window greys a
    choice with. None when the rules allow it (the engine may still refuse what only the loaded model shows: fused
    projections, a backend that cannot build; the window remembers those refusals). ``tokens``: the run's context
    so far; ``ahead``: the tokens the run will still generate (a static cache must hold them all)."""
    try:
        state = SwitchState.of(now, device, tokens=tokens, max_context=max_context, ahead=ahead, light=True)
        answer = plan(spec, state, key, value, foresee=False)
    except (SettingsError, SpecError, KeyError, ValueError) as exc:
        return str(exc).splitlines()[0] if str(exc) else "not a setting of this run"
    return answer.refusal

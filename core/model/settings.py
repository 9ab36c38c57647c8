"""RunSettings: what the user chose for a run or a calculation, and parsing of live switches.

Spellings are canonical and shared by the command line, recordings and the window: attention
``mha``, ``gqa:2``, ``mqa``, ``mla``, ``window:256``; cache ``dynamic``, ``static``, ``quantized:4``,
``quantized:hqq:2``, ``quantized:fp8``, ``offloaded``, ``sink:4+252``, ``h2o:128+128``; attn-impl
``eager``, ``sdpa``, ``flash``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from kvscope.core.model.attention import MLA, AttentionMode, SettingsError, Window, native_attention, parse_attention
from kvscope.core.model.caches import (CacheStrategy, Dynamic, Quantized, Static, TokenSelecting, kv_layout, parse_cache,
                                       static_shortfall)
from kvscope.core.model.hf_config import ViewNotKnown, known_views_only
from kvscope.core.model.spec import INDEXED_ATTENTION, MAX_COUNT, ModelSpec, canonical_dtype, dtype_bytes, shown_count

ATTN_IMPLS = ("eager", "sdpa", "flash")


def parse_attn_impl(text: str) -> str:
    spelled = str(text).strip().lower()
    aliases = {"flash_attention_2": "flash", "fa2": "flash", "flash-attention": "flash"}
    spelled = aliases.get(spelled, spelled)
    if spelled not in ATTN_IMPLS:
        raise SettingsError(f"unknown attention implementation {text!r}; use eager, sdpa or flash")
    return spelled


# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    """What the user chose for a run or a calculation. ``attention=None`` means as the model is built.

    ``max_context`` is what a static cache preallocates (defaults to the context itself).
    ``kv_dtype=None`` means the weights' dtype, as transformers' caches store K/V in the model dtype.
    """

    batch: int = 1
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    attention: AttentionMode | None = None
    cache: CacheStrategy = Dynamic()
    attn_impl: str = "sdpa"
    max_context: int | None = None

    def __post_init__(self) -> None:
        if self.batch <= 0:
            raise SettingsError(f"batch must be positive, got {self.batch}")
        if self.batch > MAX_COUNT:  # 10**20 overflowed the predictor's float arithmetic
            raise SettingsError(f"batch {shown_count(self.batch)} is implausible (more than {MAX_COUNT:,})")
        if self.weight_dtype is not None:
            object.__setattr__(self, "weight_dtype", canonical_dtype(self.weight_dtype))
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
        if self.max_context is not None and self.max_context <= 0:
            raise SettingsError(f"max context must be positive, got {self.max_context}")

    def attention_key(self, spec: ModelSpec) -> str:
        return (self.attention or native_attention(spec)).key

    def with_(self, **changes) -> "RunSettings":
        return dataclasses.replace(self, **changes)


def parse_switch_value(key: str, value: str):
    """Parse the value of a live switch ``KEY=VALUE`` (``attention``, ``attn-impl``, ``cache``)."""
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


# ------------------------------------------------------------------------------------------------
# The choices on each axis: one list each for the command line's help, the window and the calculator.

#: Windows offered besides a model's own: one short enough to see the plateau in a live demo of a
#: few hundred tokens, one the size real sliding-window models use (Mistral 7B).
DEMO_WINDOW, COMMON_WINDOW = 256, 4096

#: Cache strategies in the order the C key cycles through them; the token-selecting ones follow, sized
#: for the model (``selecting_cache_keys``).
CACHE_KEYS = ("dynamic", "static", "quantized:4", "quantized:2", "quantized:hqq:4", "quantized:fp8", "offloaded")

#: Attention sinks a sink cache keeps: StreamingLLM's paper finds 4 initial tokens enough.
SINK_TOKENS = 4


def window_choices(spec: ModelSpec) -> list[int]:
    """Sliding windows worth offering for ``spec``, largest first: its own, and 4096 and 256 where
    they are at most half its context (else a quarter of its context)."""
    context = spec.max_position_embeddings
    sizes = {spec.sliding_window} if spec.sliding_window else set()
    sizes |= {w for w in (COMMON_WINDOW, DEMO_WINDOW) if 2 * w <= context}
    return sorted(sizes or {max(16, context // 4)}, reverse=True)


def attention_choices(spec: ModelSpec) -> tuple[str, ...]:
    """Attention modes for ``spec`` from the most KV to the least: mha, gqa:N (N descending), mqa, mla,
    windows (largest first); the model's own mode first when it is none of these."""
    out = ["mha"] + [f"gqa:{n}" for n in sorted(spec.gqa_group_counts(), reverse=True) if 1 < n < spec.num_query_heads]
    out += ["mqa", "mla"] + [f"window:{w}" for w in window_choices(spec)]
    native = native_attention(spec).key
    return tuple(out if native in out else [native, *out])


def selecting_cache_keys(spec: ModelSpec | None = None) -> tuple[str, ...]:
    """The sink and h2o sizes worth offering for ``spec``: per window size of ``window_choices`` (one a live
    demo sees go flat within a few hundred tokens, one a real model's context makes sense of), a sink
    cache of that many tokens (4 sinks + the rest recent) and an h2o cache (half heavy hitters, half
    recent); the demo size only when the model is not known."""
    sizes = window_choices(spec) if spec is not None else [DEMO_WINDOW]
    return tuple([f"sink:{SINK_TOKENS}+{w - SINK_TOKENS}" for w in sizes] + [f"h2o:{w // 2}+{w - w // 2}" for w in sizes])


def cache_choices(device: str | None = None, spec: ModelSpec | None = None) -> tuple[tuple[str, str | None], ...]:
    """Every cache strategy with None, or the reason it is not available here: a quantization backend
    that is not installed (found without importing it), or CUDA for the offloaded cache
    (``device`` None: not known yet); then the sink and h2o caches sized for ``spec``
    (``selecting_cache_keys``)."""
    import importlib.util

    out: list[tuple[str, str | None]] = []
    for key in CACHE_KEYS + selecting_cache_keys(spec):
        strategy, reason = parse_cache(key), None
        backend = getattr(strategy, "backend", None)
        if backend in ("quanto", "hqq"):
            module = "optimum.quanto" if backend == "quanto" else "hqq"
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            reason = None if found else "backend not installed"
        elif key == "offloaded" and not str(device or "").startswith("cuda"):
            reason = "needs CUDA"
        out.append((key, reason))
    return tuple(out)


def effective_spec(spec: ModelSpec, settings: RunSettings) -> ModelSpec:
    """The spec whose cache this run holds: the attention mode applied (checked) to the model."""
    if settings.attention is None:
        return spec
    return _applied(spec, settings.attention)


@functools.lru_cache(maxsize=256)
def _applied(spec: ModelSpec, mode: AttentionMode) -> ModelSpec:
    # Memoised: the engine predicts at every token and the predictor asks several times per call.
    mode.check(spec)
    return mode.apply(spec)




# ------------------------------------------------------------------------------------------------
# What a key may offer from the settings in force (issue 25: C stuck on a quantized cache the engine refuses).

#: The settings of a run, keyed by switch axis (``attention``, ``attn-impl``, ``cache``).
Now = dict


def switch_problem(spec: ModelSpec, device: str | None, now: Now, key: str, value: str,
                   tokens: int = 0, max_context: int | None = None, ahead: int = 0) -> str | None:
    """Why the engine would refuse ``key=value`` from the settings ``now`` (keyed ``attention``,
    ``attn-impl``, ``cache``, canonical spellings as a Sample carries them), found from the spec and
    the device alone: the same rules ``Engine._check_target`` applies first. None when they allow it
    (the engine may still refuse what only the loaded model shows: fused projections, a backend that
    cannot build; the window remembers those refusals). ``tokens``: the run's context so far (a quantized
    cache's groups must divide what it quantizes at every flush up to ``max_context``, as the engine checks);
    ``ahead``: the tokens the run will still generate (a static cache must hold them all)."""
    try:
        name, parsed = parse_switch_value(key, value)
        mode = parsed if name == "attention" else parse_attention(now["attention"])
        impl = parsed if name == "attn_impl" else parse_attn_impl(now["attn-impl"])
        strategy = parsed if name == "cache" else parse_cache(now["cache"])
    except (SettingsError, KeyError, ValueError) as exc:
        return str(exc) or "not a setting of this run"
    if name == "cache" and strategy.needs_attention_weights:
        impl = "eager"  # a cache switch takes the kernel along (Engine.apply)
    try:
        eff = _applied_known(spec, mode)
    except ViewNotKnown:
        return None  # only transformers would tell (the engine process has it): the engine judges
    except (SettingsError, ValueError) as exc:
        return str(exc).splitlines()[0]
    if strategy.needs_attention_weights and impl != "eager":
        return f"the {strategy.key} cache needs eager attention (switch the cache first)"
    if isinstance(strategy, TokenSelecting) and INDEXED_ATTENTION in eff.layer_types:
        return f"a {strategy.name} cache cannot evict the DSA indexer keys"
    if strategy.needs_cuda and not str(device or "").startswith("cuda"):
        return "needs CUDA"
    if isinstance(mode, Window) and mode.window < 2:
        return "a window of at least 2 tokens"
    if isinstance(mode, MLA) and impl == "flash" and not str(device or "").startswith("cuda"):
        # SDPA's flash kernel off CUDA takes one head size for K and V; MLA's differ ("No available kernel").
        return "SDPA's flash kernel off CUDA cannot run MLA's K/V head sizes"
    if spec.is_mla and not isinstance(mode, MLA):
        return "the model caches an MLA latent: no K/V heads to regroup"
    if isinstance(mode, MLA) and not spec.is_mla and strategy.name != "dynamic":
        # MLA on a model that is not MLA is a latent of the model's own K/V, a dynamic cache of its own (the engine's
        # _check_target says the same): C offered static under it and the engine refused.
        return ("MLA's latent is a dynamic cache of its own: leave MLA first" if parse_attention(now["attention"]) == mode
                else f"MLA's latent is a dynamic cache of its own: the {strategy.key} cache cannot hold it (switch the "
                     "cache to dynamic first)")
    if name == "cache" and isinstance(strategy, Static) and tokens > 0:
        shortfall = static_shortfall(int(max_context or spec.max_position_embeddings), tokens, ahead)
        if shortfall:
            return shortfall
    if isinstance(strategy, Quantized):
        if eff.num_sliding_layers:
            return ("a quantized cache needs full-attention layers (the sliding window)" if isinstance(mode, Window)
                    else "a quantized cache needs full-attention layers (this model slides)")
        if eff.num_state_layers:
            return "a quantized cache needs full-attention layers (this model keeps states)"
        if strategy.backend != "fp8" and tokens > 0:
            return _quantized_shape_problem(eff, strategy, dtype_bytes(spec.dtype), tokens,
                                            int(max_context or spec.max_position_embeddings))
    return None


@functools.lru_cache(maxsize=256)
def _applied_known(spec: ModelSpec, mode: AttentionMode) -> ModelSpec:
    # The window's process asks this for every choice at every settings change, and never loads torch: a
    # view transformers would have to find raises ViewNotKnown (an estimate swallowed inside apply is fine for these
    # structural checks; kept apart from _applied, which the engine predicts with).
    with known_views_only():
        mode.check(spec)
        return mode.apply(spec)


@functools.lru_cache(maxsize=1024)
def _quantized_shape_problem(eff: ModelSpec, strategy: Quantized, elem: float, tokens: int, limit: int) -> str | None:
    # The engine's check (Engine._check_quantized_shapes): the backends' groups must divide what is quantized
    # at each flush. Sizes at the flushes repeat modulo any group size after at most 64 flushes (groups are
    # powers of two up to 64 here), so those are enough, and a key press never waits on thousands of them.
    layout = kv_layout(eff)
    step = strategy.residual_length
    for n in range(tokens, min(max(limit, tokens), tokens + 64 * step) + 1, step):
        try:
            strategy.kv_bytes(layout, 1, n, elem, prompt_tokens=tokens)
        except SettingsError as exc:
            return str(exc).splitlines()[0]
    return None

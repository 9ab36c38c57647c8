"""RunSettings: what the user chose for a run or a calculation, and the choices on each axis.

Spellings are canonical and shared by the command line, recordings and the window: attention
``mha``, ``gqa:2``, ``mqa``, ``mla``, ``window:256``; cache ``dynamic``, ``static``, ``quantized:4``,
``quantized:hqq:2``, ``quantized:fp8``, ``offloaded``, ``sink:4+252``, ``h2o:128+128``; attn-impl
``eager``, ``sdpa``, ``flash``. A live switch's grammar and rules are the runtime's
(``kvscope.core.runtimes.transformers.switches``: ``plan`` and ``switch_problem``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from kvscope.core.model.attention import (ATTENTION_MODES, DEMO_WINDOW, AttentionMode, SettingsError,  # noqa: F401
                                          native_attention, window_choices)  # (SettingsError, AttentionMode: re-exported)
from kvscope.core.model.caches import CacheStrategy, Dynamic, parse_cache
from kvscope.core.model.spec import MAX_COUNT, ModelSpec, canonical_dtype, shown_count

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


# ------------------------------------------------------------------------------------------------
# The choices on each axis: one list each for the command line's help, the window and the calculator.

#: Cache strategies in the order the C key cycles through them; the token-selecting ones follow, sized
#: for the model (``selecting_cache_keys``).
CACHE_KEYS = ("dynamic", "static", "quantized:4", "quantized:2", "quantized:hqq:4", "quantized:fp8", "offloaded")

#: Attention sinks a sink cache keeps: StreamingLLM's paper finds 4 initial tokens enough.
SINK_TOKENS = 4


def attention_choices(spec: ModelSpec) -> tuple[str, ...]:
    """Attention modes for ``spec`` from the most KV to the least, each mode's ``choices`` in ``ATTENTION_MODES``'
    order: mha, gqa:N (N descending), mqa, mla, windows (largest first); the model's own mode first when it is none
    of these."""
    out = [choice for mode in ATTENTION_MODES for choice in mode.choices(spec)]
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



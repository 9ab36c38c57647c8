"""Attention modes: MHA, GQA(n), MQA, MLA and sliding window, as rewrites of a ModelSpec.

Each mode's ``apply`` returns the spec whose KV cache that mode holds (the predictor reads its
head counts, widths and windows); the engine converts a running model to the same shape.
Adding a mode is one class here plus one entry in ``ATTENTION_MODES``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from kvscope.core.model.spec import (FULL_ATTENTION, INDEXED_ATTENTION, MAX_COUNT, NO_KV, SLIDING_ATTENTION, ModelSpec,
                                     SettingsError)


def int_arg(arg: str | None, what: str, spelled: str) -> int:
    """Parse the numeric part of a spelling like ``gqa:2``; raise SettingsError naming the spelling."""
    if arg is None or not arg.strip():
        raise SettingsError(f"{spelled!r} needs a number, e.g. {what}")
    try:
        value = int(arg)
    except ValueError as exc:
        raise SettingsError(f"{spelled!r}: {arg!r} is not a whole number (e.g. {what})") from exc
    if value <= 0:
        raise SettingsError(f"{spelled!r}: the number must be positive")
    if value > MAX_COUNT:  # window:10**30 overflowed torch's int64 in the attention mask
        raise SettingsError(f"{spelled[:40]!r}: the number must be at most {MAX_COUNT:,}")
    return value


# ------------------------------------------------------------------------------------------------
# Attention modes: each rewrites the part of a ModelSpec that decides what the cache holds.


@dataclass(frozen=True)
class AttentionMode:
    """Base of attention modes. ``apply`` returns the spec the cache of this mode corresponds to."""

    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    #: How the mode is written, for messages and help: the first is its plain form (``gqa:N``), any others follow.
    spellings: ClassVar[tuple[str, ...]] = ()

    @property
    def key(self) -> str:
        """Canonical spelling, as on the command line."""
        return self.name

    @classmethod
    def choices(cls, spec: ModelSpec) -> list[str]:
        """The spellings the window's Attention combo and the calculator offer for ``spec``, in the order keys
        cycle (most K/V first); ``[name]`` by default."""
        return [cls.name]

    @classmethod
    def parse(cls, arg: str | None, spelled: str) -> "AttentionMode":
        if arg:
            raise SettingsError(f"{spelled!r}: {cls.name} takes no argument")
        return cls()

    def check(self, spec: ModelSpec) -> None:
        """Raise SettingsError when this mode cannot apply to ``spec``."""

    def apply(self, spec: ModelSpec) -> ModelSpec:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.key


#: How fewer K/V heads than the model's own are made from its own: ``aligned`` (the default: heads aligned per rotary
#: pair and merged, calibrated on the model's own K/V, ``kvscope.core.runtimes.transformers.merge``) or ``mean`` (the
#: GQA paper's mean-pooling). Spelled after the head count: ``gqa:2:mean``, ``mqa:mean``.
MERGES = ("aligned", "mean")


def merge_arg(arg: str | None, spelled: str) -> str:
    """The merge method a spelling names (``aligned`` when it names none); SettingsError for another word."""
    if arg is None or not arg.strip():
        return MERGES[0]
    if arg.strip() not in MERGES:
        raise SettingsError(f"{spelled!r}: {arg.strip()!r} is not a way to merge K/V heads; use "
                            f"{' or '.join(MERGES)} (default {MERGES[0]})")
    return arg.strip()


def with_kv_heads(spec: ModelSpec, kv_heads: int) -> ModelSpec:
    """The spec with ``kv_heads`` K/V heads; k_proj/v_proj parameters change with it (one
    ``hidden x head_dim`` matrix, plus a bias row when the model has one, per head per layer).

    The layer pattern: a model that mixes sliding and full layers (Gemma 3, Qwen2 with
    max_window_layers) keeps its own pattern, as the engine keeps it; a model whose every layer
    slides (Mistral) is in the ``window`` mode when built, and a head mode means full attention.
    """
    if spec.is_mla:
        # Expanding MLA to per-head K/V: K is nope+rope wide, V is v_head_dim wide (DeepSeek's layout).
        return replace(spec, num_kv_heads=kv_heads, head_dim=(spec.qk_nope_head_dim or 0) + (spec.qk_rope_head_dim or 0),
                       kv_lora_rank=None, layer_kv=None)
    bias = 1 if spec.kv_bias else 0
    delta = 2 * spec.num_kv_layers * (kv_heads - spec.num_kv_heads) * spec.head_dim * (spec.hidden_size + bias)
    # A head change makes every layer compute kv_heads heads of head_dim: the model's own per-layer shapes are gone.
    layer_kv = spec.layer_kv if kv_heads == spec.num_kv_heads else None
    spec = replace(spec, num_kv_heads=kv_heads, num_parameters=spec.num_parameters + delta, layer_kv=layer_kv)
    return full_attention(spec) if spec.num_full_layers == 0 else spec


def full_attention(spec: ModelSpec) -> ModelSpec:
    """``spec`` with every attention layer attending to (and caching) every token (a layer without K/V,
    linear attention or a state-space mixer, stays as it is)."""
    return _every_kv_layer(replace(spec, sliding_window=None), FULL_ATTENTION)


def _every_kv_layer(spec: ModelSpec, kind: str) -> ModelSpec:
    return replace(spec, layer_types=tuple(t if t == NO_KV else kind for t in spec.layer_types))


@dataclass(frozen=True)
class MHA(AttentionMode):
    name: ClassVar[str] = "mha"
    help: ClassVar[str] = "multi-head: one K/V head per query head"
    spellings: ClassVar[tuple[str, ...]] = ("mha",)

    def apply(self, spec: ModelSpec) -> ModelSpec:
        return with_kv_heads(spec, spec.num_query_heads)


@dataclass(frozen=True)
class GQA(AttentionMode):
    name: ClassVar[str] = "gqa"
    help: ClassVar[str] = ("grouped-query: N K/V heads shared by groups of query heads (N divides the query heads); "
                           "fewer than the model's own are aligned and merged (gqa:N:mean mean-pools them)")
    spellings: ClassVar[tuple[str, ...]] = ("gqa:N", "gqa:N:mean")
    kv_heads: int = 1
    merge: str = MERGES[0]

    @property
    def key(self) -> str:
        return f"gqa:{self.kv_heads}" + ("" if self.merge == MERGES[0] else f":{self.merge}")

    @classmethod
    def choices(cls, spec: ModelSpec) -> list[str]:
        return [f"gqa:{n}" for n in sorted(spec.gqa_group_counts(), reverse=True) if 1 < n < spec.num_query_heads]

    @classmethod
    def parse(cls, arg: str | None, spelled: str) -> "GQA":
        count, _, how = (arg or "").partition(":")
        return cls(int_arg(count or None, "gqa:2", spelled), merge_arg(how, spelled))

    def check(self, spec: ModelSpec) -> None:
        if spec.num_query_heads % self.kv_heads:
            choices = ", ".join(f"gqa:{n}" for n in spec.gqa_group_counts())
            raise SettingsError(
                f"gqa:{self.kv_heads} does not divide {spec.num_query_heads} query heads of {spec.label}; "
                f"choose one of {choices}"
            )

    def apply(self, spec: ModelSpec) -> ModelSpec:
        self.check(spec)
        return with_kv_heads(spec, self.kv_heads)


@dataclass(frozen=True)
class MQA(AttentionMode):
    name: ClassVar[str] = "mqa"
    help: ClassVar[str] = ("multi-query: a single K/V head for all query heads, the model's own aligned and merged "
                           "(mqa:mean mean-pools them)")
    spellings: ClassVar[tuple[str, ...]] = ("mqa", "mqa:mean")
    merge: str = MERGES[0]

    @property
    def key(self) -> str:
        return "mqa" + ("" if self.merge == MERGES[0] else f":{self.merge}")

    @classmethod
    def parse(cls, arg: str | None, spelled: str) -> "MQA":
        return cls(merge_arg(arg, spelled))

    def apply(self, spec: ModelSpec) -> ModelSpec:
        return with_kv_heads(spec, 1)


def latent_widths(spec: ModelSpec) -> list[int]:
    """Per full-attention layer of ``spec`` (a model that is not MLA), the elements of K and V it caches per token:
    the widths KV Scope's MLA latent compresses (sliding layers stay as they are)."""
    from kvscope.core.model.caches import kv_layout

    return [layer.heads * (layer.k_dim + layer.v_dim) for layer in kv_layout(spec) if layer.window is None]


@dataclass(frozen=True)
class MLA(AttentionMode):
    """Multi-head latent attention. A DeepSeek-V2/V3 model caches its own latent; any other model gets KV Scope's
    latent of its own keys and values (``kvscope.core.runtimes.transformers.latent``): per full-attention layer one
    basis of ``rank`` directions over the K/V of all its heads, fitted on the tokens so far, and ``rank`` elements
    per token. Default rank: half the layer's own K/V width (half its KV bytes per token); full rank is exact."""

    name: ClassVar[str] = "mla"
    help: ClassVar[str] = ("multi-head latent: a DeepSeek model's own latent; any other model caches a low-rank latent "
                           "of its own K/V per layer (mla:RANK; default half its KV, full rank exact)")
    spellings: ClassVar[tuple[str, ...]] = ("mla", "mla:RANK")
    rank: int | None = None

    @property
    def key(self) -> str:
        return "mla" if self.rank is None else f"mla:{self.rank}"

    @classmethod
    def parse(cls, arg: str | None, spelled: str) -> "MLA":
        return cls(int_arg(arg, "mla:128", spelled) if arg else None)

    def check(self, spec: ModelSpec) -> None:
        if spec.num_kv_layers == 0:
            raise SettingsError(f"{spec.label} has no attention layer (it caches no K/V, only fixed-size states): "
                                "there are no keys and values to compress into a latent")
        if spec.is_mla:
            if self.rank is not None and self.rank != spec.kv_lora_rank:
                raise SettingsError(f"{spec.label} caches its own latent of rank {spec.kv_lora_rank} (MLA): "
                                    f"{self.key} cannot change it; use mla")
            return
        if any(t == INDEXED_ATTENTION for t in spec.layer_types):
            raise SettingsError(f"{spec.label}'s sparse-attention layers cache indexer keys beside K/V: KV Scope's "
                                "latent covers plain K/V layers only")
        states = spec.layer_states or (None,) * spec.num_layers
        if any(st and (st.elements or st.fixed_bytes) for t, st in zip(spec.layer_types, states) if t != NO_KV):
            raise SettingsError(f"{spec.label}'s attention layers keep states beside K/V: KV Scope's latent covers "
                                "plain K/V layers only")
        if spec.num_full_layers == 0:
            raise SettingsError(f"every layer of {spec.label} slides (a window of {spec.sliding_window} tokens): KV "
                                "Scope's latent compresses full-attention layers and leaves sliding ones as they are, "
                                "so there is nothing to compress here")
        widths = latent_widths(spec)
        if self.rank is not None and self.rank > min(widths):
            raise SettingsError(f"{self.key}: {spec.label}'s layers cache {min(widths)} K/V elements per token "
                                f"(its full rank); choose a rank from 1 to {min(widths)}")

    def rank_for(self, spec: ModelSpec) -> int:
        """The latent's rank for ``spec``: the one asked, else half the narrowest full layer's K/V width."""
        return self.rank if self.rank is not None else max(1, min(latent_widths(spec)) // 2)

    def apply(self, spec: ModelSpec) -> ModelSpec:
        self.check(spec)
        if spec.is_mla:
            return spec
        # The model as loaded (its own heads and layer pattern), its full-attention layers caching the latent.
        return replace(spec, latent_rank=self.rank_for(spec))


@dataclass(frozen=True)
class Window(AttentionMode):
    name: ClassVar[str] = "window"
    help: ClassVar[str] = "sliding window: every layer attends to (and caches) only the last W tokens"
    spellings: ClassVar[tuple[str, ...]] = ("window:W",)
    window: int = 4096

    @property
    def key(self) -> str:
        return f"window:{self.window}"

    @classmethod
    def choices(cls, spec: ModelSpec) -> list[str]:
        return [f"window:{w}" for w in window_choices(spec)]

    @classmethod
    def parse(cls, arg: str | None, spelled: str) -> "Window":
        return cls(int_arg(arg, "window:4096", spelled))

    def apply(self, spec: ModelSpec) -> ModelSpec:
        return _every_kv_layer(replace(spec, sliding_window=self.window), SLIDING_ATTENTION)


#: Every attention mode, in the order the window offers them (most K/V first) and messages name them: a new mode is
#: its class and one entry here (docs/extending.md, recipe 3; tests/test_attention_recipe.py adds one).
ATTENTION_MODES: list[type[AttentionMode]] = [MHA, GQA, MQA, MLA, Window]


def attention_spellings(every: bool = False, sep: str = ", ", last: str = " or ") -> str:
    """The modes as a user writes them, for messages and help: ``mha, gqa:N, mqa, mla or window:W`` (``every``:
    each mode's other spellings too, ``gqa:N:mean``...)."""
    words = [w for mode in ATTENTION_MODES for w in (mode.spellings if every else mode.spellings[:1]) or (mode.name,)]
    return words[0] if len(words) == 1 else sep.join(words[:-1]) + last + words[-1]


def parse_attention(text: str) -> AttentionMode:
    """Parse ``mha``, ``gqa:N[:mean]``, ``mqa[:mean]``, ``mla[:RANK]``, ``window:W`` (or another mode of
    ``ATTENTION_MODES``). Raises SettingsError."""
    spelled = str(text).strip().lower()
    name, _, arg = spelled.partition(":")
    for mode in ATTENTION_MODES:
        if mode.name == name:
            return mode.parse(arg or None, spelled)
    raise SettingsError(f"unknown attention mode {text!r}; use {attention_spellings(every=True)}")


#: Windows offered besides a model's own: one short enough to see the plateau in a live demo of a
#: few hundred tokens, one the size real sliding-window models use (Mistral 7B).
DEMO_WINDOW, COMMON_WINDOW = 256, 4096


def window_choices(spec: ModelSpec) -> list[int]:
    """Sliding windows worth offering for ``spec``, largest first: its own, and 4096 and 256 where
    they are at most half its context (else a quarter of its context)."""
    context = spec.max_position_embeddings
    sizes = {spec.sliding_window} if spec.sliding_window else set()
    sizes |= {w for w in (COMMON_WINDOW, DEMO_WINDOW) if 2 * w <= context}
    return sorted(sizes or {max(16, context // 4)}, reverse=True)


def native_attention(spec: ModelSpec) -> AttentionMode:
    """The attention mode a model is built with (for Mistral-style all-sliding models: its window)."""
    if spec.is_mla:
        return MLA()
    if spec.sliding_window and spec.num_full_layers == 0:
        return Window(spec.sliding_window)
    if spec.num_kv_heads == spec.num_query_heads:
        return MHA()
    if spec.num_kv_heads == 1:
        return MQA()
    return GQA(spec.num_kv_heads)



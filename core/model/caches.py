"""Cache strategies (dynamic, static, quantized, offloaded, sink, h2o) and the exact bytes each one holds.

Every formula mirrors what the transformers 5.24 cache layer classes allocate
(``transformers/cache_utils.py``, and ``core/runtimes/transformers/sparse_caches.py`` for the token-selecting layers built
on them); the comment on each names the class it copies. Plain arithmetic for the window and ``calc``: the
transformers cache objects are built by ``kvscope.core.runtimes.transformers.caches``. Adding a strategy is one
class here, one entry in ``CACHE_STRATEGIES`` and its construction there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from kvscope.core.model.spec import (INDEXED_ATTENTION, MAX_COUNT, NO_KV, SLIDING_ATTENTION, ModelSpec, SettingsError,
                                     shown_count)


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer caches per token: ``heads`` x (``k_dim`` + ``v_dim``) elements.

    ``window`` is the sliding window W of a sliding layer (None for full attention). For MLA the
    cache holds one "head" whose K slot is the compressed latent (kv_lora_rank) and whose V slot is
    the rope key (qk_rope_head_dim), exactly as DeepseekV3Attention calls ``cache.update``.
    """

    heads: int
    k_dim: int
    v_dim: int
    window: int | None = None
    extra: int = 0  # elements per token cached beside K/V in one head: a DSA layer's indexer key
    fixed: int = 0  # elements held once per layer whatever the tokens and the batch: a latent layer's basis


    @property
    def width(self) -> int:
        """Elements per token (K and V together, and any indexer key) in this layer, per sequence."""
        return self.heads * (self.k_dim + self.v_dim) + self.extra


def kv_layout(spec: ModelSpec) -> tuple[LayerKV, ...]:
    """Per-layer cache shapes of an (effective) spec: its layers that cache K/V (a ``no_kv`` layer's
    fixed-size states are ``kvscope.core.model.states``')."""
    if spec.is_mla:
        # transformers >= 5.15 DeepseekV3Attention: cache.update(kv_nope [b,1,s,kv_lora_rank], k_rot [b,1,s,rope])
        shape = dict(heads=1, k_dim=int(spec.kv_lora_rank or 0), v_dim=int(spec.qk_rope_head_dim or 0))
    else:
        shape = dict(heads=spec.num_kv_heads, k_dim=spec.head_dim, v_dim=spec.v_head_dim or spec.head_dim)
    # DynamicIndexedLayer / StaticIndexedLayer: indexer keys [b, tokens, index_head_dim] beside K/V.
    extra = int(spec.indexer_head_dim or 0)
    if spec.latent_rank is not None and not spec.is_mla:
        # kvscope.core.runtimes.transformers.latent.LatentLayer: latent [b, tokens, rank] and basis [heads x (k + v), rank];
        # sliding layers stay as the model caches them.
        own = kv_layout(replace(spec, latent_rank=None))
        return tuple(layer if layer.window is not None else
                     LayerKV(heads=1, k_dim=spec.latent_rank, v_dim=0, fixed=layer.heads * (layer.k_dim + layer.v_dim) * spec.latent_rank)
                     for layer in own)
    if spec.layer_kv is not None:
        # Layers that differ from the counts (kvscope.core.model.spec.ModelSpec.layer_kv): each as transformers' cache holds it.
        return tuple(LayerKV(heads=h, k_dim=k, v_dim=v, extra=e, window=spec.sliding_window if t == SLIDING_ATTENTION
                             else None) for t, (h, k, v, e) in zip(spec.layer_types, spec.layer_kv) if t != NO_KV)
    return tuple(
        LayerKV(window=spec.sliding_window if t == SLIDING_ATTENTION else None,
                extra=extra if t == INDEXED_ATTENTION else 0, **shape) for t in spec.layer_types if t != NO_KV
    )


# ------------------------------------------------------------------------------------------------
# Cache strategies


@dataclass(frozen=True)
class CacheStrategy:
    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    needs_cuda: ClassVar[bool] = False
    #: Scores tokens by the attention weights they receive, which only eager attention returns: the engine
    #: runs it with eager, and fills it by running the tokens through the model (a copy has no scores).
    needs_attention_weights: ClassVar[bool] = False
    #: Most tokens a full-attention layer holds; None: every token (the cache grows with the context).
    capacity: ClassVar[int | None] = None

    @property
    def key(self) -> str:
        return self.name

    @classmethod
    def parse(cls, arg: str | None, spelled: str) -> "CacheStrategy":
        if arg:
            raise SettingsError(f"{spelled!r}: {cls.name} takes no argument")
        return cls()

    def __str__(self) -> str:
        return self.key

    def layer_bytes(self, layer: LayerKV, batch: int, tokens: int, elem_bytes: float, max_context: int,
                    prompt_tokens: int) -> int:
        """Bytes this layer's cache holds after ``tokens`` tokens (``prompt_tokens`` of them in the prefill)."""
        raise NotImplementedError

    def kv_bytes(self, layers: tuple[LayerKV, ...], batch: int, tokens: int, elem_bytes: float,
                 max_context: int | None = None, prompt_tokens: int | None = None) -> int:
        """Total bytes of K/V held by this cache after ``tokens`` tokens, summed over ``layers``."""
        if tokens <= 0:
            return 0
        max_context = max_context or tokens
        prompt_tokens = tokens if prompt_tokens is None else min(prompt_tokens, tokens)
        return sum(self.layer_bytes(layer, batch, tokens, elem_bytes, max_context, prompt_tokens)
                   + _dense(1, 1, 1, layer.fixed, elem_bytes) for layer in layers)


def _dense(batch: int, heads: int, tokens: int, width: int, elem_bytes: float) -> int:
    return int(math.ceil(batch * heads * tokens * width * elem_bytes))


@dataclass(frozen=True)
class Dynamic(CacheStrategy):
    name: ClassVar[str] = "dynamic"
    help: ClassVar[str] = "grows by concatenation, one token at a time (transformers DynamicCache)"

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        # DynamicLayer.update: keys = cat([keys, new], dim=-2) -> [b, h, tokens, d].
        # DynamicSlidingWindowLayer.update keeps full_states[:, :, -sliding_window + 1:], i.e. W - 1 tokens.
        held = tokens if layer.window is None else min(tokens, layer.window - 1)
        return _dense(batch, layer.heads, held, layer.k_dim + layer.v_dim, elem_bytes) + _dense(batch, 1, held, layer.extra, elem_bytes)


@dataclass(frozen=True)
class Static(CacheStrategy):
    name: ClassVar[str] = "static"
    help: ClassVar[str] = "preallocated to the max context up front, like llama.cpp (transformers StaticCache)"

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        # StaticLayer.lazy_initialization: zeros([b, h, max_cache_len, d]) for K and for V, on first update.
        # StaticSlidingWindowLayer: max_cache_len = min(sliding_window, max_cache_len).
        slots = max_context if layer.window is None else min(layer.window, max_context)
        return _dense(batch, layer.heads, slots, layer.k_dim + layer.v_dim, elem_bytes) + _dense(batch, 1, slots, layer.extra, elem_bytes)


def static_shortfall(capacity: int, tokens: int, ahead: int = 0) -> str | None:
    """Why a static cache of ``capacity`` slots cannot hold a run with ``tokens`` in its context that will still
    generate ``ahead`` tokens (each step writes one slot), or None when it can. The one rule behind the window's
    grey C entry and the engine's refusal (issue 37: C offered 4,096 slots at 3,874 tokens of an 8,000-token run,
    and the run ended 222 tokens later)."""
    if tokens + max(ahead, 0) <= capacity:
        return None
    if tokens >= capacity:
        return f"a static cache of {capacity:,} tokens cannot hold the {tokens:,} so far"
    return (f"a static cache of {capacity:,} tokens would be full {capacity - tokens:,} tokens from now, and this run "
            f"still generates {ahead:,} (raise the max context, or lower the new tokens)")


QUANT_BACKENDS = ("quanto", "hqq", "fp8")


@dataclass(frozen=True)
class Quantized(CacheStrategy):
    """transformers QuantizedCache: KIVI-style integer groups (quanto/hqq) or per-tensor fp8."""

    name: ClassVar[str] = "quantized"
    help: ClassVar[str] = "stores K/V in 4/2-bit groups (quanto, hqq) or fp8, keeping the newest tokens unquantized"
    backend: str = "quanto"
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128

    @property
    def key(self) -> str:
        if self.backend == "fp8":
            return "quantized:fp8"
        if self.backend == "quanto":
            return f"quantized:{self.nbits}"
        return f"quantized:{self.backend}:{self.nbits}"

    @classmethod
    def parse(cls, arg: str | None, spelled: str) -> "Quantized":
        parts = [p for p in (arg or "").split(":") if p]
        backend, nbits = "quanto", 4
        for part in parts:
            if part in QUANT_BACKENDS:
                backend = part
            elif part.isdigit():
                nbits = int(part)
            else:
                raise SettingsError(f"{spelled!r}: {part!r} is neither a backend ({', '.join(QUANT_BACKENDS)}) nor a bit width")
        if backend == "fp8":
            return cls(backend="fp8", nbits=8)
        allowed = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}[backend]
        if nbits not in allowed:
            raise SettingsError(f"{spelled!r}: {backend} stores {', '.join(map(str, allowed))} bits, not {nbits}")
        return cls(backend=backend, nbits=nbits)

    def split(self, tokens: int, prompt_tokens: int) -> tuple[int, int]:
        """(quantized tokens, residual full-precision tokens) after ``tokens`` tokens.

        Mirrors ``QuantizedLayer.update`` (transformers 5.24): the first update (the prefill)
        quantizes all ``prompt_tokens`` and leaves the residual empty; each later single-token update
        joins the residual, except that when ``residual + 1 >= residual_length`` everything
        (quantized + residual + new) is requantized and the residual emptied. So after k decode
        tokens the residual holds ``k % residual_length`` tokens. ``Fp8QuantizedLayer.update``
        keeps no residual: new tokens are quantized with the frozen scale and appended.
        """
        if self.backend == "fp8":
            return tokens, 0
        residual = max(tokens - prompt_tokens, 0) % self.residual_length
        return tokens - residual, residual

    def quantized_bytes(self, batch: int, heads: int, tokens: int, dim: int, elem_bytes: float) -> int:
        """Bytes of one quantized K or V tensor of shape [batch, heads, tokens, dim] (payload + scales + zero-points).

        ``elem_bytes`` is the model dtype's size: the dtype quanto and hqq keep scales and
        zero-points in. Quantization is along axis 0 (transformers' ``axis_key=axis_value=0``).
        Raises SettingsError for a shape the backend itself refuses to quantize.
        """
        n = batch * heads * tokens * dim
        if n <= 0:
            return 0
        g = self.q_group_size
        if self.backend == "fp8":
            # Fp8QuantizedLayer._quantize: (tensor.float() / scale).to(float8_e4m3fn) -> 1 byte per
            # element, and scale = amax().float() / fp8_max, a 0-dim fp32 tensor (4 bytes), frozen
            # after the prefill and kept beside the data as (data, scale).
            return n + 4
        if self.backend == "quanto":
            return self._quanto_bytes(batch, n, g, elem_bytes)
        return self._hqq_bytes(n, g, elem_bytes)

    def _quanto_bytes(self, batch: int, n: int, g: int, elem_bytes: float) -> int:
        # QuantoQuantizedLayer._quantize -> MaxOptimizer(tensor, qint{2,4}, axis=0, g) and
        # quantize_weight(...) -> WeightQBitsTensor(_data=PackedTensor, _scale, _shift).
        # optimum/quanto/tensor/grouped.py group(): the tensor is viewed as (n // g, g) rows, and
        # raises unless g divides the elements per batch row (heads * tokens * dim).
        per_row = n // batch
        if g > per_row or per_row % g:
            raise SettingsError(
                f"quanto cannot quantize a K/V tensor of {per_row} elements per sequence in groups of {g} "
                f"(heads x tokens x head_dim must be a multiple of {g})"
            )
        groups = n // g
        # packed.py pack_weights(): 8 // bits codes per uint8 along dim 0, so the (groups, g) codes
        # become ceil(groups / (8 // bits)) rows of g bytes (padding when groups is not a multiple).
        per_byte = 8 // self.nbits
        payload = math.ceil(groups / per_byte) * g
        # affine_optimizer.py AffineOptimizer.__call__: with a single group the axis becomes None and
        # MaxOptimizer reduces over dim 0, giving a (1, g) scale and shift; otherwise (groups, 1).
        scales = g if groups == 1 else groups
        # scale (max - min) / (qmax - qmin) and shift -min, both in the tensor's dtype.
        return payload + 2 * math.ceil(scales * elem_bytes)

    def _hqq_bytes(self, n: int, g: int, elem_bytes: float) -> int:
        # HQQQuantizedLayer._quantize -> hqq.core.quantize.Quantizer.quantize(axis=0, group_size=g)
        # asserts g divides the element count, reshapes to (g, n // g) and packs along dim 0
        # (hqq/core/bitpack.py), then Quantizer.cuda casts scale and zero to compute_dtype.
        if n % g:
            raise SettingsError(
                f"hqq cannot quantize a K/V tensor of {n} elements in groups of {g} "
                f"(batch x heads x tokens x head_dim must be a multiple of {g})"
            )
        columns = n // g
        if self.nbits == 3:
            # pack_3bit_32: rows padded to a multiple of 10, ten 3-bit codes per int32.
            rows_bytes = 4 * math.ceil(g / 10)
        else:
            # pack_8bit_u8 / pack_4bit_u8 / pack_2bit_u8 / pack_1bit_u8: 8 // nbits codes per uint8,
            # int(g / (8 // nbits)) rows; a group size that does not split evenly cannot be packed.
            per_byte = 8 // self.nbits
            if g % per_byte:
                raise SettingsError(f"hqq cannot pack {self.nbits}-bit codes in groups of {g}; use a multiple of {per_byte}")
            rows_bytes = g // per_byte
        # meta["scale"] (the inverted scale) and meta["zero"]: one per column, shape (1, n // g),
        # in compute_dtype = the cache's dtype (HQQQuantizedLayer sets meta["compute_dtype"]).
        return rows_bytes * columns + 2 * math.ceil(columns * elem_bytes)

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        if layer.window is not None:
            raise SettingsError("a quantized cache needs full-attention layers (transformers refuses sliding ones)")
        # BaseQuantizedLayer: the quantized K and V (_quantized_keys/_quantized_values), each quantized
        # separately, plus the residual keys/values in the model dtype (empty tensors, 0 bytes, after
        # the prefill and after each flush; fp8 never fills them).
        quantized, residual = self.split(tokens, prompt_tokens)
        q = sum(self.quantized_bytes(batch, layer.heads, quantized, d, elem_bytes) for d in (layer.k_dim, layer.v_dim))
        return q + _dense(batch, layer.heads, residual, layer.k_dim + layer.v_dim, elem_bytes)


@dataclass(frozen=True)
class Offloaded(CacheStrategy):
    name: ClassVar[str] = "offloaded"
    help: ClassVar[str] = "keeps all but the running layers' K/V in CPU memory (CUDA only)"
    needs_cuda: ClassVar[bool] = True

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        # DynamicCache(offloading=True): same tensors as a dynamic cache; all but the running and the
        # prefetched layer live in pinned CPU memory (see device_layers).
        return Dynamic().layer_bytes(layer, batch, tokens, elem_bytes, max_context, prompt_tokens)


def _two_counts(cls: type, arg: str | None, spelled: str, first: str, second: str) -> tuple[int, int]:
    """``A+B`` of a token-selecting strategy (``sink:4+252``), checked: A >= 0, B >= 1."""
    usage = f"{cls.name}:{first[0].upper()}+{second[0].upper()} ({first} + {second}, e.g. {cls.name}:{cls.example})"
    a, plus, b = (arg or "").partition("+")
    a, b = a.strip(), b.strip()
    if not plus or not (a.isascii() and a.isdigit() and b.isascii() and b.isdigit()):
        raise SettingsError(f"{spelled!r}: write {usage}, two whole numbers of tokens")
    if len(a) > 12 or len(b) > 12 or max(int(a), int(b)) > MAX_COUNT:
        big = max(int(a[:40]), int(b[:40]))
        raise SettingsError(f"{spelled!r}: {shown_count(big)} tokens is implausible (more than {MAX_COUNT:,})")
    if int(b) < 1:
        raise SettingsError(f"{spelled!r}: the {second} must hold at least 1 token (the newest)")
    return int(a), int(b)


@dataclass(frozen=True)
class TokenSelecting(CacheStrategy):
    """A cache whose full-attention layers hold at most ``capacity`` tokens and drop the others
    (``kvscope.core.runtimes.transformers.sparse_caches``); sliding layers stay as the dynamic cache has them."""

    example: ClassVar[str] = ""

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    def held(self, layer: LayerKV, tokens: int) -> int:
        """Tokens one layer holds after ``tokens`` tokens: evictions start at ``capacity + 1`` tokens."""
        if layer.extra:
            raise SettingsError(f"a {self.name} cache cannot evict a sparse-attention indexer's keys (DeepSeek-V3.2 "
                                "DSA layers); use dynamic or static")
        # SinkWindowLayer / HeavyHitterLayer keep min(tokens, capacity); DynamicSlidingWindowLayer W - 1.
        return min(tokens, self.capacity) if layer.window is None else min(tokens, layer.window - 1)

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        return _dense(batch, layer.heads, self.held(layer, tokens), layer.k_dim + layer.v_dim, elem_bytes)


@dataclass(frozen=True)
class SinkWindow(TokenSelecting):
    """StreamingLLM (Xiao et al. 2023, arXiv:2309.17453; kvpress ``StreamingLLMPress``): attention sinks + recent window.

    Each full-attention layer keeps the first ``sinks`` tokens and the last ``window``
    (``kvscope.core.runtimes.transformers.sparse_caches.SinkWindowLayer``)."""

    name: ClassVar[str] = "sink"
    help: ClassVar[str] = "keeps the first S tokens (attention sinks) and the last W, drops the rest (StreamingLLM)"
    example: ClassVar[str] = "4+252"
    sinks: int = 4
    window: int = 252

    @property
    def key(self) -> str:
        return f"sink:{self.sinks}+{self.window}"

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    @classmethod
    def parse(cls, arg, spelled):
        sinks, window = _two_counts(cls, arg, spelled, "sinks", "window")
        return cls(sinks=sinks, window=window)


@dataclass(frozen=True)
class HeavyHitter(TokenSelecting):
    """H2O (Zhang et al. 2023, arXiv:2306.14048; kvpress's H2O-style ``ObservedAttentionPress``): heavy hitters + recent window.

    Each full-attention layer keeps the last ``window`` tokens and the ``budget`` older ones with the
    highest accumulated attention, per KV head, plus one float32 score per held token and KV head
    (``kvscope.core.runtimes.transformers.sparse_caches.HeavyHitterLayer``). The scores come from the attention weights: eager only."""

    name: ClassVar[str] = "h2o"
    help: ClassVar[str] = ("keeps the B tokens with the most attention so far and the last W (H2O; runs with eager "
                           "attention, which returns the weights)")
    example: ClassVar[str] = "128+128"
    needs_attention_weights: ClassVar[bool] = True
    budget: int = 128
    window: int = 128

    @property
    def key(self) -> str:
        return f"h2o:{self.budget}+{self.window}"

    @property
    def capacity(self) -> int:
        return self.budget + self.window

    @classmethod
    def parse(cls, arg, spelled):
        budget, window = _two_counts(cls, arg, spelled, "budget", "window")
        return cls(budget=budget, window=window)

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        kv = super().layer_bytes(layer, batch, tokens, elem_bytes, max_context, prompt_tokens)
        if layer.window is not None:
            return kv  # a sliding layer stays DynamicSlidingWindowLayer: no scores
        # HeavyHitterLayer.scores: [batch, kv_heads, held] float32 (MLA: the one latent "head").
        return kv + batch * layer.heads * self.held(layer, tokens) * 4

CACHE_STRATEGIES: list[type[CacheStrategy]] = [Dynamic, Static, Quantized, Offloaded, SinkWindow, HeavyHitter]


def parse_cache(text: str) -> CacheStrategy:
    """Parse ``dynamic``, ``static``, ``quantized[:BACKEND][:BITS]``, ``offloaded``, ``sink:S+W`` or ``h2o:B+W``.
    Raises SettingsError."""
    spelled = str(text).strip().lower()
    name, _, arg = spelled.partition(":")
    for strategy in CACHE_STRATEGIES:
        if strategy.name == name:
            return strategy.parse(arg or None, spelled)
    raise SettingsError(f"unknown cache strategy {text!r}; use dynamic, static, quantized[:4|:2|:hqq:4|:fp8], "
                        "offloaded, sink:S+W or h2o:B+W")



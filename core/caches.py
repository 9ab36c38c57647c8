"""Cache strategies (dynamic, static, quantized, offloaded) and the exact bytes each one holds.

Every formula mirrors what the transformers 5.24 cache layer classes allocate
(``transformers/cache_utils.py``); the comment on each names the class it copies.
Adding a strategy is one class here plus one entry in ``CACHE_STRATEGIES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from core.attention import SettingsError
from core.spec import SLIDING_ATTENTION, ModelSpec


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

    @property
    def width(self) -> int:
        """Elements per token (K and V together) in this layer, per sequence."""
        return self.heads * (self.k_dim + self.v_dim)


def kv_layout(spec: ModelSpec) -> tuple[LayerKV, ...]:
    """Per-layer cache shapes of an (effective) spec."""
    if spec.is_mla:
        # transformers >= 5.15 DeepseekV3Attention: cache.update(kv_nope [b,1,s,kv_lora_rank], k_rot [b,1,s,rope])
        shape = dict(heads=1, k_dim=int(spec.kv_lora_rank or 0), v_dim=int(spec.qk_rope_head_dim or 0))
    else:
        shape = dict(heads=spec.num_kv_heads, k_dim=spec.head_dim, v_dim=spec.v_head_dim or spec.head_dim)
    return tuple(
        LayerKV(window=spec.sliding_window if t == SLIDING_ATTENTION else None, **shape) for t in spec.layer_types
    )


# ------------------------------------------------------------------------------------------------
# Cache strategies


@dataclass(frozen=True)
class CacheStrategy:
    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    needs_cuda: ClassVar[bool] = False

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
        return sum(self.layer_bytes(layer, batch, tokens, elem_bytes, max_context, prompt_tokens) for layer in layers)


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
        return _dense(batch, layer.heads, held, layer.k_dim + layer.v_dim, elem_bytes)


@dataclass(frozen=True)
class Static(CacheStrategy):
    name: ClassVar[str] = "static"
    help: ClassVar[str] = "preallocated to the max context up front, like llama.cpp (transformers StaticCache)"

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        # StaticLayer.lazy_initialization: zeros([b, h, max_cache_len, d]) for K and for V, on first update.
        # StaticSlidingWindowLayer: max_cache_len = min(sliding_window, max_cache_len).
        slots = max_context if layer.window is None else min(layer.window, max_context)
        return _dense(batch, layer.heads, slots, layer.k_dim + layer.v_dim, elem_bytes)


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

        QuantizedLayer.update: the first update (the prefill) quantizes everything; each later token
        joins the residual, and when residual + new reaches ``residual_length`` all of it is
        requantized and the residual emptied. Fp8QuantizedLayer keeps no residual.
        """
        if self.backend == "fp8":
            return tokens, 0
        residual = (tokens - prompt_tokens) % self.residual_length
        return tokens - residual, residual

    def quantized_bytes(self, batch: int, heads: int, tokens: int, dim: int, elem_bytes: float) -> int:
        """Bytes of one quantized K or V tensor of shape [batch, heads, tokens, dim]."""
        n = batch * heads * tokens * dim
        if self.backend == "fp8":
            # Fp8QuantizedLayer._quantize: float8_e4m3fn data + one fp32 per-tensor scale.
            return n + 4
        # Group-wise integer codes packed into bytes, plus a scale and a zero-point per group in the
        # model dtype (KIVI-style asymmetric quantization, q_group_size elements per group).
        groups = math.ceil(n / self.q_group_size)
        return math.ceil(n * self.nbits / 8) + 2 * groups * int(elem_bytes)

    def layer_bytes(self, layer, batch, tokens, elem_bytes, max_context, prompt_tokens):
        if layer.window is not None:
            raise SettingsError("a quantized cache needs full-attention layers (transformers refuses sliding ones)")
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


CACHE_STRATEGIES: list[type[CacheStrategy]] = [Dynamic, Static, Quantized, Offloaded]


def parse_cache(text: str) -> CacheStrategy:
    """Parse ``dynamic``, ``static``, ``quantized[:BACKEND][:BITS]`` or ``offloaded``. Raises SettingsError."""
    spelled = str(text).strip().lower()
    name, _, arg = spelled.partition(":")
    for strategy in CACHE_STRATEGIES:
        if strategy.name == name:
            return strategy.parse(arg or None, spelled)
    raise SettingsError(f"unknown cache strategy {text!r}; use dynamic, static, quantized[:4|:2|:hqq:4|:fp8] or offloaded")



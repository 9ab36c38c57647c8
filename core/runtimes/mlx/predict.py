"""MLX's KV caches, predicted byte for byte from mlx-lm's rules (``mlx_lm/models/cache.py``, mlx-lm 0.32.2).

Pure integer arithmetic, no MLX import: ``calc --runtime mlx`` and the window use it without MLX installed.

The three caches mlx-lm builds for a Llama-style model, and how their arrays grow (``update_and_fetch``):

- ``KVCache``: K and V arrays of ``[1, kv_heads, capacity, head_dim]`` in the model's dtype. When the tokens
  no longer fit, ``ceil(S / 256) * 256`` slots of zeros are concatenated (``step = 256``), after slicing the
  arrays down to the tokens held if that count is not a multiple of 256. A run decoded token by token
  therefore holds ``ceil(n / 256) * 256`` slots: a staircase of 256-token prepayments.
- ``RotatingKVCache(max_size, keep)``: grows the same way one token at a time (``min(256, max_size - offset)``
  slots per step) up to ``max_size``, then writes in a ring, keeping the first ``keep`` tokens. A prompt of
  several tokens is concatenated instead (``_update_concat``): the arrays then hold ``min(size, max_size - 1)
  + S`` slots until the next single token trims them back to ``max_size``.
- ``QuantizedKVCache(group_size, bits)``: the KVCache's capacity rule, each slot stored as
  ``mx.quantize`` leaves it: ``head_dim * bits / 32`` uint32 codes plus one scale and one bias per group of
  ``group_size`` values, in the model's dtype. ``KVCache.to_quantized`` keeps the capacity (zeros included).

How mlx-lm feeds a prompt (``generate_step``): all but the last token in chunks of ``prefill_step_size``
(2048), then the last token alone, whose logits give the first generated token. Every generated token is
then one ``update_and_fetch`` of one token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.caches import kv_layout
from kvscope.core.model.spec import dtype_bytes

#: ``KVCache.step`` (also QuantizedKVCache's and RotatingKVCache's) in mlx-lm 0.32.2.
STEP = 256
#: ``generate_step(prefill_step_size=2048)``: the prompt's chunk size.
PREFILL_STEP = 2048
#: ``make_prompt_cache(max_kv_size=...)``: the tokens a rotating cache keeps at the front.
DEFAULT_KEEP = 4
#: ``generate_step(kv_group_size=64)``.
DEFAULT_GROUP_SIZE = 64
#: The bits ``mx.quantize`` takes (MLX 0.32.4: "The supported bits are 1, 2, 3, 4, 5, 6 and 8"). mlx-lm's
#: ``QuantizedKVCache`` keeps ``dim // (32 // bits)`` uint32 codes per row where ``mx.quantize`` writes
#: ``dim * bits / 32``: equal for 1, 2, 4 and 8 bits at any head dim, for 3, 5 and 6 only at some
#: (``quantize_problem`` says which; 3 bits fits head dims 32 to 128, not 256).
QUANT_BITS = (1, 2, 3, 4, 5, 6, 8)
#: The group sizes ``mx.quantize`` takes ("The supported group sizes are 32, 64, and 128"). Anything else is
#: refused before MLX sees it: a group of 0 kills the process with SIGFPE inside ``mx.quantize``.
GROUP_SIZES = (32, 64, 128)
#: The cache the window and the CLI start with.
DEFAULT_CACHE = "kv"

KV, ROTATING, QUANTIZED = "kv", "rotating", "quantized"


@dataclass(frozen=True)
class MlxCache:
    """One of mlx-lm's caches with its parameters, spelled ``kv``, ``rotating:MAX[:KEEP]`` or
    ``quantized:BITS[:GROUP]`` (see ``parse_cache``)."""

    kind: str = KV
    max_size: int | None = None  # rotating: RotatingKVCache(max_size=...)
    keep: int = 0  # rotating: the first tokens it never overwrites
    bits: int | None = None  # quantized: QuantizedKVCache(bits=...)
    group_size: int | None = None  # quantized: QuantizedKVCache(group_size=...)

    @property
    def key(self) -> str:
        """The spelling the command line and the Samples use."""
        if self.kind == ROTATING:
            return f"rotating:{self.max_size}:{self.keep}"
        if self.kind == QUANTIZED:
            return f"quantized:{self.bits}:{self.group_size}"
        return KV

    @property
    def class_name(self) -> str:
        """mlx-lm's class for this cache."""
        return {KV: "KVCache", ROTATING: "RotatingKVCache", QUANTIZED: "QuantizedKVCache"}[self.kind]

    def describe(self) -> str:
        if self.kind == ROTATING:
            return f"RotatingKVCache(max_size={self.max_size}, keep={self.keep})"
        if self.kind == QUANTIZED:
            return f"QuantizedKVCache(group_size={self.group_size}, bits={self.bits})"
        return "KVCache (256-token steps)"


def parse_cache(text: str) -> MlxCache:
    """``kv`` (also ``dynamic``, the CLI's default), ``rotating:MAX[:KEEP]`` (keep defaults to mlx-lm's 4) or
    ``quantized:BITS[:GROUP]`` (also ``q8``, ``q4:32``; group defaults to mlx-lm's 64). SettingsError, one line,
    for anything else."""
    spelled = str(text).strip().lower()
    head, _, rest = spelled.partition(":")
    parts = [p.strip() for p in rest.split(":")] if rest else []
    if head in ("kv", "dynamic", "kvcache") and not parts:
        return MlxCache(KV)
    q = re.fullmatch(r"q(\d+)", head)
    if head in ("rotating", "rotatingkvcache"):
        if not 1 <= len(parts) <= 2 or not all(re.fullmatch(r"[0-9]+", p) for p in parts):
            raise SettingsError(f"MLX cache {text!r}: write rotating:MAX or rotating:MAX:KEEP, e.g. rotating:512:4")
        max_size = int(parts[0])
        keep = int(parts[1]) if len(parts) > 1 else DEFAULT_KEEP
        if max_size < 2 or max_size > 1 << 24:
            raise SettingsError(f"MLX cache {text!r}: the window must be 2 to {1 << 24:,} tokens")
        if keep >= max_size:
            raise SettingsError(f"MLX cache {text!r}: keep ({keep}) must be less than the window ({max_size})")
        return MlxCache(ROTATING, max_size=max_size, keep=keep)
    if head in ("quantized", "quantizedkvcache") or q:
        if q:
            parts = [q[1]] + parts
        if not 1 <= len(parts) <= 2 or not all(re.fullmatch(r"[0-9]+", p) for p in parts):
            raise SettingsError(f"MLX cache {text!r}: write quantized:BITS or quantized:BITS:GROUP, e.g. quantized:8:64")
        bits = int(parts[0])
        group = int(parts[1]) if len(parts) > 1 else DEFAULT_GROUP_SIZE
        return quantized_cache(bits, group, f"MLX cache {text!r}")
    raise SettingsError(f"MLX cache {text!r}: one of kv, rotating:MAX[:KEEP], quantized:BITS[:GROUP] "
                        "(e.g. rotating:512:4, quantized:8:64)")


def quantized_cache(bits: int, group: int, what: str) -> MlxCache:
    """A QuantizedKVCache of ``bits`` and ``group``, or SettingsError (one line, ``what`` first) with MLX's own rule
    for anything ``mx.quantize`` refuses, checked here so that MLX never sees it (a group of 0 is SIGFPE there)."""
    if bits not in QUANT_BITS:
        raise SettingsError(f"{what}: mx.quantize refuses {bits} bits (the supported bits are "
                            f"{', '.join(map(str, QUANT_BITS[:-1]))} and {QUANT_BITS[-1]})")
    if group not in GROUP_SIZES:
        raise SettingsError(f"{what}: mx.quantize refuses groups of {group} (the supported group sizes are "
                            f"{', '.join(map(str, GROUP_SIZES[:-1]))} and {GROUP_SIZES[-1]})")
    return MlxCache(QUANTIZED, bits=bits, group_size=group)


# ---------------------------------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class LayerShape:
    """What one attention layer hands its cache: K/V heads, K and V head dims, bytes per value of the dtype,
    and the sliding window the model gives that layer (None: full attention)."""

    heads: int
    k_dim: int
    v_dim: int
    itemsize: int
    window: int | None = None


def slot_bytes(layer: LayerShape, cache: MlxCache) -> int:
    """Bytes of one token slot (K + V over the layer's heads) in ``cache``'s arrays, as ``nbytes`` counts them."""
    if cache.kind != QUANTIZED:
        return layer.heads * (layer.k_dim + layer.v_dim) * layer.itemsize
    per_int = 32 // int(cache.bits)  # el_per_int = 8 * mx.uint32.size // bits
    g = int(cache.group_size)

    def one(dim: int) -> int:  # codes (uint32) + scales + biases (the dtype of the keys)
        return 4 * (dim // per_int) + 2 * layer.itemsize * (dim // g)

    return layer.heads * (one(layer.k_dim) + one(layer.v_dim))


def quantize_problem(layers: Sequence[LayerShape], cache: MlxCache) -> str | None:
    """Why ``mx.quantize`` would refuse this model's K/V with ``cache``'s groups (None: it takes them)."""
    if cache.kind != QUANTIZED:
        return None
    bits = int(cache.bits)
    for dim in sorted({d for layer in layers for d in (layer.k_dim, layer.v_dim)}):
        if dim % int(cache.group_size):
            return (f"mx.quantize needs the head dim ({dim}) to be a multiple of the group size "
                    f"({cache.group_size}); try quantized:{cache.bits}:32")
        kept, written = dim // (32 // bits), dim * bits // 32
        if kept != written:  # QuantizedKVCache's el_per_int = 8 * mx.uint32.size // bits
            return (f"mlx-lm's QuantizedKVCache keeps {kept} uint32 codes per {dim} values at {bits} bits where "
                    f"mx.quantize writes {written} (it cannot store them: '[broadcast_shapes]'); try 2, 4 or 8 bits")
    return None


# ---------------------------------------------------------------------------------------------------- one cache


@dataclass
class CacheTrack:
    """The shape state of one mlx-lm cache object: its capacity (slots in K's array), ``offset`` (tokens seen)
    and, for a rotating cache, ``_idx`` (the next slot written). ``feed`` moves it as ``update_and_fetch`` moves
    the arrays; ``decode`` does many one-token updates at once."""

    cache: MlxCache
    capacity: int = 0
    offset: int = 0
    idx: int = 0
    empty: bool = True

    def feed(self, n: int) -> None:
        """One ``update_and_fetch`` of ``n`` tokens."""
        if n <= 0:
            raise ValueError(f"a cache update takes at least one token, not {n}")
        if self.cache.kind == ROTATING:
            self._rotating(n)
            return
        # KVCache and QuantizedKVCache: the same rule.
        if self.empty or self.offset + n > self.capacity:
            grow = -(-n // STEP) * STEP
            if self.empty:
                self.capacity = grow
            else:
                if self.offset % STEP:
                    self.capacity = self.offset  # keys[..., :prev, :]
                self.capacity += grow
            self.empty = False
        self.offset += n

    def _rotating(self, n: int) -> None:
        m, keep = int(self.cache.max_size), self.cache.keep
        if n == 1:  # _update_in_place
            if self.empty or (self.offset >= self.capacity and self.capacity < m):
                new = min(STEP, m - self.offset)
                self.capacity = new if self.empty else self.capacity + new
                self.empty = False
                self.idx = self.offset
            if self.capacity > m:  # _trim: the first `keep` slots and the last ones
                self.capacity = m
                self.idx = m
            if self.idx == m:
                self.idx = keep
            self.offset += 1
            self.idx += 1
            return
        # _update_concat
        if self.empty:
            self.capacity = n
            self.empty = False
        else:
            if self.idx == self.capacity:
                pass
            elif self.idx < self.offset:
                pass  # reordered in time, same size
            else:
                self.capacity = self.idx  # sliced to the slots written
            trim = self.capacity - m + 1
            if trim > 0:
                self.capacity -= trim
            self.capacity += n
        self.offset += n
        self.idx = self.capacity

    def decode(self, n: int) -> None:
        """``n`` one-token updates, in O(window / 256) steps rather than O(n)."""
        while n > 0:
            if self.cache.kind != ROTATING:
                if self.empty:
                    self.feed(1)
                    n -= 1
                    continue
                room = self.capacity - self.offset
                if n <= room:
                    self.offset += n
                    return
                self.offset = self.capacity
                n -= room
                k = n
                self.capacity += -(-k // STEP) * STEP  # one step each time the tokens reach the capacity
                self.offset += k
                return
            m, keep = int(self.cache.max_size), self.cache.keep
            if self.empty or self.capacity > m or (self.offset >= self.capacity and self.capacity < m):
                self.feed(1)
                n -= 1
                continue
            if self.capacity < m:  # writes into slots already there, no growth until offset reaches capacity
                k = min(n, self.capacity - self.offset)
                self.offset += k
                self.idx += k
                n -= k
                continue
            # Full ring: the size stays; _idx walks keep+1 .. max_size and wraps to keep lazily.
            start = keep if self.idx == m else self.idx
            self.idx = keep + ((start - keep + n - 1) % (m - keep)) + 1
            self.offset += n
            return

    def copy(self) -> "CacheTrack":
        return replace(self)


def prompt_chunks(prompt_tokens: int, prefill_step: int = PREFILL_STEP) -> list[int]:
    """The updates ``generate_step`` makes for a prompt: all but the last token in chunks of ``prefill_step``,
    then the last token alone."""
    if prompt_tokens < 1:
        raise ValueError("a prompt has at least one token")
    rest = prompt_tokens - 1
    chunks = []
    while rest > 0:
        chunks.append(min(prefill_step, rest))
        rest -= chunks[-1]
    return chunks + [1]


# ---------------------------------------------------------------------------------------------------- a model


def layer_cache(layer: LayerShape, cache: MlxCache) -> MlxCache:
    """The cache a layer gets: a model's sliding-window layer keeps a RotatingKVCache of its window (mlx-lm's
    ``make_cache`` for such models, keep 0) under a plain KVCache; the asked cache otherwise."""
    if layer.window is not None and cache.kind == KV:
        return MlxCache(ROTATING, max_size=int(layer.window), keep=0)
    return cache


@dataclass
class ModelTrack:
    """Every layer's cache of one model, moved together (each layer gets the same updates)."""

    layers: tuple[LayerShape, ...]
    cache: MlxCache
    tracks: list[CacheTrack] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tracks:
            self.tracks = [CacheTrack(layer_cache(layer, self.cache)) for layer in self.layers]

    def feed(self, n: int) -> None:
        for t in self.tracks:
            t.feed(n)

    def decode(self, n: int) -> None:
        for t in self.tracks:
            t.decode(n)

    def prompt(self, prompt_tokens: int, prefill_step: int = PREFILL_STEP) -> None:
        for n in prompt_chunks(prompt_tokens, prefill_step):
            self.feed(n)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V arrays (``sum(c.nbytes for c in cache)``)."""
        return sum(0 if t.empty else t.capacity * slot_bytes(layer, t.cache) for layer, t in zip(self.layers, self.tracks))

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots that hold tokens (the rest of the arrays is the prepaid step)."""
        return sum(min(t.offset, t.capacity) * slot_bytes(layer, t.cache)
                   for layer, t in zip(self.layers, self.tracks))

    @property
    def offset(self) -> int:
        return self.tracks[0].offset if self.tracks else 0

    def switched(self, cache: MlxCache) -> "ModelTrack":
        """The tracks after the engine's switch to ``cache`` (``kvscope.core.runtimes.mlx.engine``): a quantized cache
        from a KVCache is ``KVCache.to_quantized`` (same capacity); a rotating one is filled with the tokens it
        would keep (the first ``keep`` and the last ``max_size - keep``: as many slots as tokens); a KVCache from
        a quantized one is the dequantized arrays (same capacity)."""
        out = []
        for layer, t in zip(self.layers, self.tracks):
            target = layer_cache(layer, cache)
            if t.cache == target:
                out.append(t.copy())
            elif target.kind == ROTATING:
                held = min(t.offset, t.capacity) if t.cache.kind == ROTATING else t.offset
                size = min(held, int(target.max_size))
                out.append(CacheTrack(target, capacity=size, offset=t.offset, idx=size, empty=t.empty))
            else:
                out.append(CacheTrack(target, capacity=t.capacity, offset=t.offset, idx=t.idx, empty=t.empty))
        return ModelTrack(self.layers, cache, out)


def layers_of(spec, itemsize: int | None = None) -> tuple[LayerShape, ...]:
    """The K/V layers of a ``kvscope.core.model.spec.ModelSpec`` as mlx-lm's attention hands them to the cache.

    ``itemsize``: bytes per value of the arrays the model computes in (default: the spec's dtype)."""
    size = int(itemsize if itemsize is not None else dtype_bytes(spec.dtype))
    return tuple(LayerShape(heads=l.heads, k_dim=l.k_dim, v_dim=l.v_dim, itemsize=size, window=l.window)
                 for l in kv_layout(spec))


def kv_after(layers: Sequence[LayerShape], cache: MlxCache, prompt_tokens: int, generated: int = 0,
             quantized_kv_start: int | None = None) -> int:
    """Bytes of the caches' arrays after a prompt of ``prompt_tokens`` (fed as ``generate_step`` feeds it) and
    ``generated`` more tokens decoded one at a time.

    ``quantized_kv_start``: with a quantized ``cache``, mlx-lm's ``--quantized-kv-start``: the layers hold a
    KVCache until its offset reaches it after an update, then ``to_quantized`` (same capacity)."""
    track = history(layers, cache, prompt_tokens, generated, quantized_kv_start)
    return track.nbytes


def history(layers: Sequence[LayerShape], cache: MlxCache, prompt_tokens: int, generated: int = 0,
            quantized_kv_start: int | None = None) -> ModelTrack:
    """The ModelTrack after that history (see ``kv_after``)."""
    layers = tuple(layers)
    if cache.kind != QUANTIZED or not quantized_kv_start:
        track = ModelTrack(layers, cache)
        track.prompt(prompt_tokens)
        track.decode(generated)
        return track
    track = ModelTrack(layers, MlxCache(KV))
    quantized = False
    for n in prompt_chunks(prompt_tokens):
        track.feed(n)
        if not quantized and track.offset >= quantized_kv_start:
            track, quantized = track.switched(cache), True
    if not quantized and generated:
        before = max(0, quantized_kv_start - track.offset)
        first = min(generated, before)
        track.decode(first)
        generated -= first
        if track.offset >= quantized_kv_start:
            track, quantized = track.switched(cache), True
    track.decode(generated)
    return track


def staircase(layers: Sequence[LayerShape], cache: MlxCache, contexts: Iterable[int]) -> list[tuple[int, int]]:
    """(context, bytes) for each context: a one-token prompt decoded token by token to that many tokens (for a
    KVCache or QuantizedKVCache the same capacity as any prompt fed the ``generate_step`` way)."""
    return [(n, kv_after(layers, cache, 1, n - 1)) for n in contexts]


def kv_capacity(tokens: int) -> int:
    """Slots a KVCache holds for ``tokens`` fed the ``generate_step`` way: ``ceil(tokens / 256) * 256``."""
    return -(-tokens // STEP) * STEP if tokens > 0 else 0


def describe_step(layers: Sequence[LayerShape], cache: MlxCache) -> str:
    """One line: the bytes of one 256-token step of this cache, over every layer."""
    per_slot = sum(slot_bytes(layer, layer_cache(layer, cache)) for layer in layers)
    return f"{per_slot:,} B per token slot x {STEP} slots per step = {per_slot * STEP:,} B per step"


__all__ = ["STEP", "PREFILL_STEP", "MlxCache", "parse_cache", "LayerShape", "slot_bytes", "CacheTrack",
           "ModelTrack", "layers_of", "kv_after", "history", "staircase", "prompt_chunks", "quantize_problem",
           "kv_capacity", "describe_step"]


# ---------------------------------------------------------------------------------------------------- the prefill peak


def prefill_peak(layers: Sequence[LayerShape], hidden: int, query_heads: int, prompt_tokens: int,
                 prefill_step: int = PREFILL_STEP) -> int:
    """The bytes a prompt's prefill adds to MLX's active memory at its peak (``mx.get_peak_memory()`` after
    ``mx.reset_peak_memory()``, less the memory active before), as ``generate_step`` feeds it with a KVCache.

    Counted, for the largest chunk of n tokens over S keys: the caches' arrays after it (``ModelTrack``), one
    layer's attention as MLX's CPU ``scaled_dot_product_attention`` computes it (the scores of every query head,
    ``heads x n x S`` values, and the causal mask, ``n x S`` bytes of bool) and that layer's per-token tensors
    (the residual, its norm, Q, K, V, Q and K after RoPE, the scaled Q: ``itemsize x (3 x hidden + 3 x heads x
    head_dim + 3 x kv_heads x head_dim)`` per token). Not counted, so the prediction is a floor: the other
    temporaries alive at that moment. MLX's CPU backend runs the graph on a thread of its own and a buffer is freed
    when the task that last reads it completes, so which temporaries overlap the scores depends on that timing:
    measured 16 to 26 KiB per token over this floor across tiny Llamas (hidden 256/512, intermediate 688/1376,
    head dims 16 to 64) and lengths 300/600, not a fixed count of tensors (benchmarks/mlx_prefill_peak.py)."""
    layers = tuple(layers)
    track = ModelTrack(layers, MlxCache(KV))
    peak = 0
    chunks = prompt_chunks(prompt_tokens, prefill_step)
    for i, n in enumerate(chunks):
        start = track.offset
        track.feed(n)
        keys = start + n
        worst = 0
        # A chunk before the last is evaluated for the caches only (mx.eval of their state): the last layer's K
        # and V are all it needs of that layer, so its attention never runs; the last token's pass runs them all.
        attending = layers if i == len(chunks) - 1 else layers[:-1]
        for layer in attending:
            s = keys if layer.window is None else min(keys, start + n)  # the keys attended (a window keeps S >= n)
            scores = query_heads * n * s * layer.itemsize + n * s
            per_token = layer.itemsize * (3 * hidden + 3 * query_heads * layer.k_dim + 3 * layer.heads * layer.k_dim)
            worst = max(worst, scores + n * per_token)
        peak = max(peak, track.nbytes + worst)
    return peak

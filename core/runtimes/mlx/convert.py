"""An MLX run's conversions between two tokens: its caches moved into another kind (``switch_cache``) and its K/V
heads regrouped, weights and cache together (``switch_attention``); and the bytes mlx-lm's caches hold.

Every function reads and changes the ``MlxEngine`` it is given; a refusal (SettingsError) leaves the model and the
caches as they were (everything is computed before anything is committed). This module imports mlx and mlx_lm
where it converts: only the engine's side (a run) calls it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvscope.core.base.sample import Sample
from kvscope.core.model.attention import SettingsError, parse_attention
from kvscope.core.model.spec import human_bytes
from kvscope.core.runtimes.mlx.predict import KV, QUANTIZED, MlxCache, ModelTrack, layer_cache

if TYPE_CHECKING:
    from kvscope.core.runtimes.mlx.engine import MlxEngine


def layer_nbytes(c: Any) -> int:
    """One cache's bytes as mlx-lm's ``nbytes`` counts them; an empty cache (``c.empty()``: no arrays yet) holds 0.

    mlx-lm 0.32.2's ``QuantizedKVCache.nbytes`` reduces over ``(keys, values)`` with no guard, so before its first
    update it raises ``AttributeError: 'NoneType' object has no attribute 'nbytes'`` (KVCache's and
    RotatingKVCache's return 0 there). Only that state is read as 0: any other failure is raised as it is."""
    try:
        return int(c.nbytes)
    except AttributeError:
        if c.empty():
            return 0
        raise


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes of the caches' arrays as mlx-lm's ``nbytes`` counts them (the observation)."""
    return sum(layer_nbytes(c) for c in cache)


def regroup(x: Any, old: int, new: int, axis: int) -> Any:
    """``x`` with ``old`` heads along ``axis`` made ``new`` (``kvscope.core.runtimes.transformers.convert.regroup_heads``' rules in MLX): up by
    repeating each head in place, down by averaging consecutive heads in float32, otherwise through their lcm."""
    import mlx.core as mx

    if new == old:
        return x
    if new % old == 0:
        return mx.repeat(x, new // old, axis=axis)
    if old % new == 0:
        shape = list(x.shape)
        grouped = x.reshape(*shape[:axis], new, old // new, *shape[axis + 1:])
        return grouped.astype(mx.float32).mean(axis=axis + 1).astype(x.dtype)
    via = math.lcm(old, new)
    return regroup(regroup(x, old, via, axis), via, new, axis)


def switch_cache(engine: "MlxEngine", target: MlxCache, fields: dict[str, Any]) -> Sample:
    if target == engine.cache_setting:
        return engine.event("note", f"the cache is already {target.key}: nothing to convert", **fields)
    engine._check_cache(target)
    before = cache_nbytes(engine.cache)
    converted = [convert_layer(engine, c, layer_cache(layer, target)) for c, layer in zip(engine.cache, engine.layers)]
    engine.mx.eval([c.state for c in converted])
    engine.cache = converted
    engine.cache_setting = target
    engine.track = engine.track.switched(target)
    engine.predictable = engine._predictable()
    after = cache_nbytes(engine.cache)
    fields["switch_after"] = target.key
    return engine.event("switch", f"cache: {fields['switch_before']} -> {target.key} ({target.describe()}): KV "
                        f"{human_bytes(before)} -> {human_bytes(after)}", **fields)


def convert_layer(engine: "MlxEngine", c: Any, target: MlxCache) -> Any:
    """One layer's cache as ``target``; SettingsError (nothing changed) where MLX cannot."""
    mx = engine.mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    if isinstance(c, RotatingKVCache):
        if target.kind == QUANTIZED:
            raise SettingsError("mlx-lm does not quantize a RotatingKVCache ('RotatingKVCache Quantization NYI')")
        dropped = c.offset > c.max_size if c.keys is not None else False
        if target.kind == KV and dropped:
            raise SettingsError(f"the rotating cache has dropped {c.offset - c.max_size:,} of the "
                                f"{c.offset:,} tokens; a KVCache needs them all")
        keys = values = None
        if c.keys is not None:
            keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
        if target.kind == KV:
            out = KVCache()
            if keys is not None:
                # The arrays as they were (the slots allocated ahead included): nothing was dropped.
                out.keys, out.values, out.offset = c.keys, c.values, c.offset
            return out
        return rotating_from(engine, keys, values, c.offset, target)
    if isinstance(c, QuantizedKVCache):
        keys = values = None
        if c.keys is not None:
            keys = mx.dequantize(*c.keys, group_size=c.group_size, bits=c.bits)
            values = mx.dequantize(*c.values, group_size=c.group_size, bits=c.bits)
        if target.kind == KV:
            out = KVCache()
            if keys is not None:
                out.keys, out.values, out.offset = keys, values, c.offset
            return out
        if target.kind == QUANTIZED:
            plain = KVCache()
            if keys is not None:
                plain.keys, plain.values, plain.offset = keys, values, c.offset
            return plain.to_quantized(group_size=int(target.group_size), bits=int(target.bits))
        held = None if keys is None else (keys[..., :c.offset, :], values[..., :c.offset, :])
        return rotating_from(engine, *(held or (None, None)), c.offset, target)
    if isinstance(c, KVCache):
        if target.kind == QUANTIZED:
            if c.keys is None:
                return QuantizedKVCache(group_size=int(target.group_size), bits=int(target.bits))
            return c.to_quantized(group_size=int(target.group_size), bits=int(target.bits))
        if target.kind == KV:
            return c
        held = None if c.keys is None else (c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
        return rotating_from(engine, *(held or (None, None)), c.offset, target)
    raise SettingsError(f"{type(c).__name__} is a cache KV Scope does not convert")


def rotating_from(engine: "MlxEngine", keys: Any, values: Any, offset: int, target: MlxCache) -> Any:
    """A RotatingKVCache holding what it would keep of ``keys``/``values`` (tokens in time order, the last one
    at ``offset``): the first ``keep`` and the last ``max_size - keep``."""
    mx = engine.mx
    from mlx_lm.models.cache import RotatingKVCache

    out = RotatingKVCache(max_size=int(target.max_size), keep=target.keep)
    if keys is None:
        return out
    held = keys.shape[2]
    m, keep = int(target.max_size), target.keep
    if held > m:
        keys = mx.concatenate([keys[..., :keep, :], keys[..., held - (m - keep):, :]], axis=2)
        values = mx.concatenate([values[..., :keep, :], values[..., held - (m - keep):, :]], axis=2)
    out.keys, out.values, out.offset, out._idx = keys, values, int(offset), int(keys.shape[2])
    return out


def attention_modules(engine: "MlxEngine") -> list[Any]:
    layers = getattr(getattr(engine.model, "model", None), "layers", None) or getattr(engine.model, "layers", [])
    mods = [getattr(layer, "self_attn", None) for layer in layers]
    if not mods or any(m is None or not hasattr(m, "k_proj") or not hasattr(m, "n_kv_heads") for m in mods):
        raise SettingsError(f"{engine.spec.label}'s attention in mlx-lm has no separate k_proj/v_proj with "
                            "n_kv_heads to regroup")
    return mods


def switch_attention(engine: "MlxEngine", spelled: str, fields: dict[str, Any]) -> Sample:
    import mlx.nn as nn

    mode = parse_attention(spelled)
    if mode.name not in ("mha", "gqa", "mqa"):
        raise SettingsError(f"{mode.key} is not a switch an MLX run makes (mha, gqa:N and mqa regroup the K/V "
                            "heads; MLA and windows need another model)")
    mode.check(engine.spec_now)
    new_spec = mode.apply(engine.spec_now)
    old_heads, new_heads = engine.spec_now.num_kv_heads, new_spec.num_kv_heads
    if new_heads == old_heads:
        return engine.event("note", f"attention is already {engine.attention}: nothing to regroup", **fields)
    merged = "mean-pooled"
    if getattr(mode, "merge", "mean") != "mean" and new_heads % old_heads:
        # The aligned merge folds maps into the query and output projections of a transformers model
        # (kvscope.core.runtimes.transformers.merge); an MLX run mean-pools, and its setting says so.
        mode = replace(mode, merge="mean")
        merged = "mean-pooled: the aligned merge is the transformers runtime's"
    if engine.quantized_weights:
        raise SettingsError("the model's K/V projections are quantized (QuantizedLinear): regrouping their heads "
                            "needs float weights")
    if engine.own_caches:
        raise SettingsError(f"{engine.spec.label} builds its own caches (make_cache); KV Scope regroups only "
                            "models with one plain cache per layer")
    if engine.cache_setting.kind == QUANTIZED:
        raise SettingsError("the cache is quantized: switch the cache to kv first, then the attention")
    mods = attention_modules(engine)
    updates = []
    for m in mods:
        hd = m.head_dim if hasattr(m, "head_dim") else engine.spec_now.head_dim
        for proj in (m.k_proj, m.v_proj):
            if not isinstance(proj, nn.Linear):
                raise SettingsError(f"{type(proj).__name__} K/V projections cannot be regrouped")
            w = proj.weight  # [heads * head_dim, hidden]
            new_w = regroup(w.reshape(old_heads, hd, w.shape[-1]), old_heads, new_heads, 0)
            b = getattr(proj, "bias", None) if "bias" in proj else None
            new_b = None if b is None else regroup(b.reshape(old_heads, hd), old_heads, new_heads, 0).reshape(-1)
            updates.append((proj, new_w.reshape(new_heads * hd, w.shape[-1]), new_b))
    new_caches = []
    for c in engine.cache:
        keys = getattr(c, "keys", None)
        if keys is None:
            new_caches.append(c)
            continue
        c2 = type(c).__new__(type(c))
        c2.__dict__.update(c.__dict__)
        c2.keys = regroup(c.keys, old_heads, new_heads, 1)
        c2.values = regroup(c.values, old_heads, new_heads, 1)
        new_caches.append(c2)
    # Everything computed: now commit (nothing above touched the model or the caches).
    engine.mx.eval([w for _, w, _ in updates] + [b for _, _, b in updates if b is not None]
                   + [c.state for c in new_caches])
    before = cache_nbytes(engine.cache)
    for proj, w, b in updates:
        proj.weight = w
        if b is not None:
            proj.bias = b
    for m in mods:
        m.n_kv_heads = new_heads
    engine.cache = new_caches
    engine.spec_now = new_spec
    from mlx.utils import tree_flatten

    engine.weights = int(sum(p.nbytes for _, p in tree_flatten(engine.model.parameters())))
    engine.layers = tuple(replace(layer, heads=new_heads) for layer in engine.layers)
    engine.track = ModelTrack(engine.layers, engine.cache_setting,
                              [t.copy() for t in engine.track.tracks])
    engine.attention = mode.key
    fields["switch_after"] = mode.key
    after = cache_nbytes(engine.cache)
    how = "repeated" if new_heads > old_heads and new_heads % old_heads == 0 else merged
    return engine.event("switch", f"attention: {fields['switch_before']} -> {mode.key}: K/V heads {old_heads} -> "
                        f"{new_heads} ({how}, weights and cache); KV {human_bytes(before)} -> "
                        f"{human_bytes(after)}", **fields)

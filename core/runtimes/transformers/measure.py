"""Observed bytes: what a transformers cache object and a model really hold, found by walking tensors.

``cache_bytes`` is the ground truth the predictor (``kvscope.core.prediction.predict.kv_bytes``) is tested against, byte
for byte, and what the generation loop reports as "KV observed". It needs no knowledge of a cache
class: it walks the object graph of any transformers ``Cache`` (dynamic, static, sliding-window,
quantized, offloaded, encoder-decoder) and adds up every tensor it finds.

The walk
- enters transformers cache objects (``Cache``, its layers, and any object defined in a
  ``transformers`` module hanging off them) through their instance attributes, and tuples, lists and
  dicts inside them (HQQ stores ``(packed, meta)`` with ``meta["scale"]``/``meta["zero"]``; fp8
  stores ``(data, scale)``);
- opens tensor subclasses through ``__tensor_flatten__`` (the PyTorch protocol for wrapper tensors):
  quanto's ``WeightQBitsTensor`` holds no storage itself but ``_data`` (a ``PackedTensor`` whose own
  ``_data`` is the uint8 payload), ``_scale`` and ``_shift``;
- does not enter anything else (a backend's optimizer or quantizer class, CUDA streams, dtypes).

Bookkeeping rule: tensors that count, index or position tokens rather than hold cached states are
left out, by attribute name (``BOOKKEEPING_ATTRS``): ``cumulative_length`` (StaticLayer's token
counter), ``_sliding_window_tensor`` (DynamicSlidingWindowLayer's window as a tensor),
``_pending_beam_idx`` (QuantizedLayer's deferred beam order), ``indexer_cumulative_length`` and
``indexer_position_ids`` (DSA indexer positions). They are a few bytes per layer, do not grow with
the context, and no formula for "KV bytes" includes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from kvscope.core.model.states import BOOKKEEPING_ATTRS


@dataclass(frozen=True)
class CacheBytes:
    """Bytes a cache object holds.

    ``logical``: sum of ``nelement() * element_size()`` over every tensor the cache holds (keys,
    values, quantized payloads, their scales and zero-points) — what the predictor predicts.
    ``storage``: sum of the sizes of the distinct storages those tensors keep alive. It can exceed
    ``logical``: a sliding-window layer keeps a slice (a view) of the concatenated states, so the
    whole concatenation stays allocated until the next step replaces it.
    ``layers``: number of cache layers (0 for an object with no ``layers``).
    ``logical_by_device``: ``logical`` split by device type (``"cuda"``, ``"cpu"``, ...), which
    shows where an offloaded cache keeps its layers.
    """

    logical: int
    storage: int
    layers: int
    logical_by_device: dict[str, int] = field(default_factory=dict, compare=False)


class _Walker:
    def __init__(self) -> None:
        self.logical = 0
        self.by_device: dict[str, int] = {}
        self.storages: dict[tuple[str, int], int] = {}
        self.seen: set[int] = set()

    def tensor(self, t: torch.Tensor) -> None:
        if id(t) in self.seen:
            return
        self.seen.add(id(t))
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None:
            # Wrapper subclass (quanto QTensor/QBitsTensor/PackedTensor, DTensor...): its own
            # "storage" is a shell; the bytes live in the inner tensors it names.
            inner_names, _ = flatten()
            for name in inner_names:
                inner = getattr(t, name, None)
                if isinstance(inner, torch.Tensor):
                    self.tensor(inner)
            return
        nbytes = t.nelement() * t.element_size()
        self.logical += nbytes
        self.by_device[t.device.type] = self.by_device.get(t.device.type, 0) + nbytes
        if t.device.type == "meta":
            return  # no memory behind it
        storage = t.untyped_storage()
        size = storage.nbytes()
        if size:
            # Two live storages never share a start address on one device, so (device, address) is
            # a storage's identity; views of one storage (slices, reshapes) collapse onto it.
            self.storages[(str(storage.device), storage.data_ptr())] = size

    def value(self, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            self.tensor(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            if id(v) in self.seen:
                return
            self.seen.add(id(v))
            for item in v:
                self.value(item)
        elif isinstance(v, dict):
            if id(v) in self.seen:
                return
            self.seen.add(id(v))
            for item in v.values():
                self.value(item)
        elif _is_cache_object(v):
            if id(v) in self.seen:
                return
            self.seen.add(id(v))
            for name, attr in vars(v).items():
                if name in BOOKKEEPING_ATTRS:
                    continue
                self.value(attr)


@functools.lru_cache(maxsize=1)
def _cache_base_classes() -> tuple[type, ...]:
    """transformers' cache and cache-layer base classes, so subclasses defined elsewhere are entered too."""
    try:
        from transformers import cache_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return ()
    names = ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer")
    return tuple(getattr(cache_utils, n) for n in names if isinstance(getattr(cache_utils, n, None), type))


def _is_cache_object(obj: Any) -> bool:
    """True for caches and cache layers: instances of transformers' cache classes (wherever subclassed) or of
    any class a ``transformers`` module defines; never for classes themselves or for anything else."""
    if isinstance(obj, type) or not hasattr(obj, "__dict__"):
        return False
    return type(obj).__module__.startswith("transformers.") or isinstance(obj, _cache_base_classes())


def cache_bytes(cache: Any) -> CacheBytes:
    """Bytes held by a transformers cache (``DynamicCache``, ``StaticCache``, ``QuantizedCache``, offloaded...).

    Returns logical bytes (every held tensor's elements x element size), storage bytes (distinct
    storages kept alive, each once) and the number of layers; see ``CacheBytes``. ``None`` or an
    empty cache gives zeros. Walking is a few microseconds per tensor and never copies data.
    """
    if cache is None:
        return CacheBytes(0, 0, 0, {})
    walker = _Walker()
    walker.value(cache)
    layers = getattr(cache, "layers", None)
    if layers is None and isinstance(cache, (list, tuple)):
        layers = cache  # legacy format: one (keys, values) tuple per layer
    return CacheBytes(
        logical=int(walker.logical),
        storage=int(sum(walker.storages.values())),
        layers=len(layers) if isinstance(layers, (list, tuple)) else 0,
        logical_by_device=dict(walker.by_device),
    )


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each distinct storage counted once (tied weights once).

    This is the observed "weights" figure: what the loaded model keeps allocated, in bytes. A
    quantized parameter (a tensor subclass) is counted through its inner tensors.
    """
    walker = _Walker()
    for p in model.parameters():
        # A Parameter wrapping a tensor subclass (a quantized weight) is opened through its ``data``.
        walker.tensor(p.data if getattr(p.data, "__tensor_flatten__", None) is not None else p)
    for b in model.buffers():
        walker.tensor(b)
    # A model on the meta device has no storage: its logical size is what it would occupy.
    return int(sum(walker.storages.values())) if walker.storages else int(walker.logical)

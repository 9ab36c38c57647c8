"""All-or-nothing changes to a running model and its cache: the switch transaction's undo log.

A live switch rewrites K/V projections, config fields, attention modules' attributes, the engine's
own fields and the cache, in several steps, any of which can fail (an architecture transformers
will not run that way, a shape a cache backend refuses, a kernel the device lacks). ``Snapshot``
records, before the first step, everything those steps can touch, by reference and without copying
tensors, so that ``restore()`` puts the model and the cache back exactly as they were:

- every module's ``__dict__`` and its parameter, buffer and submodule tables (conversions assign
  new tensors and attributes; they never write into an existing tensor);
- every config object's fields (deep-copied: they are small), restored into the same objects that
  the modules hold;
- the cache object and each of its layers' fields; the few tensors transformers updates in place
  (``StaticLayer.cumulative_length``; a full ``StaticSlidingWindowLayer``'s buffers, which roll)
  are cloned, so a trial forward pass on the new cache can be undone too;
- the named attributes of the owner (the engine: current model, mode, settings, kernel...).

Nothing here knows a particular architecture or cache class beyond those in-place tensors.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import nn
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

_MISSING = object()


def _configs_of(model: nn.Module) -> list[Any]:
    """The config objects a model and its modules read (the top config and its sub-configs)."""
    found: dict[int, Any] = {}
    stack = [getattr(model, "config", None)]
    while stack:
        config = stack.pop()
        if config is None or id(config) in found or not hasattr(config, "to_dict"):
            continue
        found[id(config)] = config
        stack.extend(v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    for module in model.modules():
        config = vars(module).get("config")
        if config is not None and hasattr(config, "to_dict"):
            found.setdefault(id(config), config)
    return list(found.values())


class CacheSnapshot:
    """The fields of a cache and of its layers, to undo conversions or a trial forward pass."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.fields = dict(vars(cache)) if cache is not None else {}
        self.layers = [(layer, self._layer_fields(layer)) for layer in getattr(cache, "layers", None) or []]

    @staticmethod
    def _layer_fields(layer: Any) -> dict[str, Any]:
        # Dicts are copied: a layer may keep state in a dict it updates entry by entry (DeepSeek-V4's compressor
        # buffers, entries and counts per name), which restoring the same dict object would not undo.
        fields = {name: dict(value) if isinstance(value, dict) else value for name, value in vars(layer).items()}
        if isinstance(layer, StaticLayer):
            for name in ("cumulative_length",):
                if isinstance(fields.get(name), torch.Tensor):
                    fields[name] = fields[name].clone()
            if isinstance(layer, StaticSlidingWindowLayer) and getattr(layer, "is_initialized", False):
                # A full sliding buffer rolls in place (copy_), so the trial step needs its own copy to undo.
                fields["keys"] = layer.keys.clone()
                fields["values"] = layer.values.clone()
        return fields

    def restore(self) -> None:
        if self.cache is None:
            return
        # A cache filled under inference mode holds inference tensors, which only accept an in-place write inside
        # it (the static buffers' copy_ below); a restore outside it, on the window's re-run path after key C then 5
        # then 1, ended the run with "Inplace update to inference tensor outside InferenceMode" (issue 37). Writing
        # a normal tensor in place inside inference mode is allowed, so every restore runs under it.
        with torch.inference_mode():
            self._restore()

    def _restore(self) -> None:
        for layer, fields in self.layers:
            for name, value in fields.items():
                current = vars(layer).get(name, _MISSING)
                if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current is not value \
                        and isinstance(layer, StaticLayer) and current.shape == value.shape and name != "cumulative_length":
                    current.copy_(value)  # keep the static buffer's address (marked static for torch.compile)
                    fields[name] = current
            vars(layer).clear()
            vars(layer).update({name: dict(value) if isinstance(value, dict) else value for name, value in fields.items()})
        vars(self.cache).clear()
        vars(self.cache).update(self.fields)
        if hasattr(self.cache, "layers"):
            self.cache.layers = [layer for layer, _ in self.layers]


class Snapshot:
    """Everything a switch may change, taken before the first change; ``restore()`` undoes them all."""

    def __init__(self, models: Iterable[nn.Module | None], cache: Any, owner: Any, attrs: Iterable[str]) -> None:
        distinct = {id(m): m for m in models if m is not None}
        self.modules: list[tuple[nn.Module, dict[str, Any]]] = []
        seen: set[int] = set()
        configs: dict[int, Any] = {}
        for model in distinct.values():
            for module in model.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                fields = dict(vars(module))
                for table in ("_parameters", "_buffers", "_modules"):
                    if table in fields:
                        fields[table] = dict(fields[table])
                self.modules.append((module, fields))
            for config in _configs_of(model):
                configs.setdefault(id(config), config)
        self.configs = [(c, copy.deepcopy(vars(c))) for c in configs.values()]
        self.cache = CacheSnapshot(cache)
        self.owner = owner
        self.attrs = {name: getattr(owner, name, _MISSING) for name in attrs}

    def restore(self) -> None:
        for module, fields in self.modules:
            vars(module).clear()
            vars(module).update(fields)
        for config, fields in self.configs:
            vars(config).clear()
            vars(config).update(copy.deepcopy(fields))
        self.cache.restore()
        for name, value in self.attrs.items():
            if value is _MISSING:
                if hasattr(self.owner, name):
                    delattr(self.owner, name)
            else:
                setattr(self.owner, name, value)

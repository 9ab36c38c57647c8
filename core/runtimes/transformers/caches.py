"""transformers' cache objects for KV Scope's cache strategies: what ``kvscope.core.model.caches`` describes (the
strategies and their exact bytes, plain arithmetic), built here as the transformers 5.24 classes it copies
(``transformers/cache_utils.py``, and ``sparse_caches.py`` for the token-selecting layers). Engine side only: it
imports transformers when a cache is built."""

from __future__ import annotations

import contextlib
from typing import Any

from kvscope.core.model.caches import CacheStrategy, HeavyHitter, Offloaded, Quantized, SinkWindow, Static


def build_cache(strategy: CacheStrategy, config: Any, max_context: int) -> Any:
    """A fresh transformers cache of ``strategy`` for a model of ``config`` (``max_context``: what a static cache
    preallocates)."""
    if isinstance(strategy, Static):
        from transformers import StaticCache

        return StaticCache(config=config, max_cache_len=max_context)
    if isinstance(strategy, Quantized):
        from transformers import QuantizedCache

        if strategy.backend == "fp8":
            return QuantizedCache(backend="fp8", config=config)
        return QuantizedCache(backend=strategy.backend, config=config, nbits=strategy.nbits,
                              q_group_size=strategy.q_group_size, residual_length=strategy.residual_length)
    if isinstance(strategy, SinkWindow):
        from kvscope.core.runtimes.transformers.sparse_caches import SinkWindowLayer, selecting_cache

        return selecting_cache(config, lambda: SinkWindowLayer(strategy.sinks, strategy.window))
    if isinstance(strategy, HeavyHitter):
        from kvscope.core.runtimes.transformers.sparse_caches import HeavyHitterLayer, selecting_cache

        return selecting_cache(config, lambda: HeavyHitterLayer(strategy.budget, strategy.window))
    from transformers import DynamicCache

    return DynamicCache(config=config, offloading=True) if isinstance(strategy, Offloaded) else DynamicCache(config=config)


def forward_context(strategy: CacheStrategy, model: Any, cache: Any) -> contextlib.AbstractContextManager:
    """What a forward pass of ``model`` on a cache of ``strategy`` runs inside (the heavy-hitter cache's attention
    hooks; nothing for the others)."""
    if isinstance(strategy, HeavyHitter):
        from kvscope.core.runtimes.transformers.sparse_caches import observing_attention

        return observing_attention(model, cache)
    return contextlib.nullcontext()

"""Token-selecting KV caches as transformers cache layers: attention sinks + a recent window, and heavy hitters.

Both keep a bounded number of tokens per full-attention layer and drop the rest, so the cache stops
growing with the context (the strategies and their exact bytes are ``kvscope.core.model.caches.SinkWindow`` and
``kvscope.core.model.caches.HeavyHitter``):

- ``SinkWindowLayer``: StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with
  Attention Sinks", arXiv:2309.17453) keeps the first S tokens, which soak up attention whatever they
  say, and the last W. kvpress calls the same rule ``StreamingLLMPress`` (``n_sink``).
- ``HeavyHitterLayer``: H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
  Inference of Large Language Models", arXiv:2306.14048) keeps the last W tokens and, of the older
  ones, the B that have received the most attention so far, per KV head. kvpress's H2O-style press is
  ``ObservedAttentionPress`` (scores from the attention weights, eager attention only); kvpress
  normalises by how many queries saw each key, the paper accumulates the plain sum, as here.

kvpress itself cannot be a dependency (it pins transformers < 5.3); this follows the papers. Like
kvpress, the kept keys keep the rotary position they were cached with (StreamingLLM's paper re-rotates
them to their slot in the cache), and the query takes its true position: ``get_seq_length`` counts
every token seen, as ``DynamicSlidingWindowLayer`` does. Sliding-window layers of a model stay
``DynamicSlidingWindowLayer`` (they already keep fewer tokens), as do any other layer kinds.

The layers subclass ``DynamicLayer``, so generation, the switch code (``kvscope.core.runtimes.transformers.convert``) and the byte
walker (``kvscope.core.runtimes.transformers.measure``) treat them as any dynamic layer. Each forward pass attends over everything
held plus the new tokens (the prompt is attended in full); the eviction happens after it: in
``update`` for the sink layer, after the attention weights arrive for the heavy-hitter layer
(``observing_attention`` hands them over, from a forward hook on each attention module that exists
only for the duration of one forward pass, as kvpress's ``with press(model):`` does).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

#: Bytes of one accumulated attention score (kept in float32 whatever the model dtype).
SCORE_BYTES = 4


class _SelectingLayer(DynamicLayer):
    """A full-attention dynamic layer that holds at most ``capacity`` tokens and counts every token seen."""

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.capacity = int(capacity)
        self.cumulative_length = 0

    def get_seq_length(self) -> int:
        # The true count, so positions (RoPE) continue after evictions.
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The held keys all lie before the new queries; the offset makes the new block's own causal
        # mask use true positions (kv index offset + i) while every held key stays visible.
        held = 0 if not self.is_initialized or self.keys.numel() == 0 else int(self.keys.shape[-2])
        return held + query_length, self.cumulative_length - held

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"a {type(self).__name__} has dropped tokens and cannot be cropped back")


class SinkWindowLayer(_SelectingLayer):
    """StreamingLLM: the first ``sinks`` tokens and the last ``window`` (kvpress ``StreamingLLMPress``)."""

    is_croppable = False

    def __init__(self, sinks: int, window: int, **kwargs: Any) -> None:
        super().__init__(capacity=sinks + window, **kwargs)
        self.sinks = int(sinks)
        self.window = int(window)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        if keys.shape[-2] > self.capacity:
            # Evict the middle: the attention of this pass still sees every token it was given.
            self.keys = torch.cat([keys[:, :, :self.sinks], keys[:, :, -self.window:]], dim=-2)
            self.values = torch.cat([values[:, :, :self.sinks], values[:, :, -self.window:]], dim=-2)
        else:
            self.keys, self.values = keys, values
        return keys, values


class HeavyHitterLayer(_SelectingLayer):
    """H2O: the last ``window`` tokens plus the ``budget`` older ones with the most attention, per KV head.

    ``scores`` [batch, kv_heads, held] is the attention each held token has received, summed over
    every query that saw it and over the query heads that share its KV head (float32). A token's
    score starts when it is cached; the tokens of the recent window are never evicted, and when one
    leaves the window it competes with what it has gathered so far.
    """

    is_croppable = False

    def __init__(self, budget: int, window: int, **kwargs: Any) -> None:
        super().__init__(capacity=budget + window, **kwargs)
        self.budget = int(budget)
        self.window = int(window)
        self.scores: torch.Tensor | None = None
        self.awaiting_scores = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.awaiting_scores:
            raise RuntimeError("the h2o cache got no attention weights for its last tokens: it needs eager "
                               "attention (attn-impl eager), which returns them")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            b, h = key_states.shape[0], key_states.shape[1]
            self.scores = torch.zeros(b, h, 0, dtype=torch.float32, device=key_states.device)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        new = torch.zeros(*self.scores.shape[:2], key_states.shape[-2], dtype=torch.float32, device=self.scores.device)
        self.scores = torch.cat([self.scores, new], dim=-1)
        self.awaiting_scores = True
        return self.keys, self.values

    def observe_attention(self, weights: torch.Tensor) -> None:
        """Add this pass's attention weights [batch, query_heads, q_len, held] and evict down to the capacity."""
        if not self.awaiting_scores:
            return
        b, kv_heads, held = self.scores.shape
        if weights.dim() != 4 or weights.shape[-1] != held or weights.shape[1] % kv_heads:
            raise RuntimeError(f"the h2o cache cannot read attention weights of shape {tuple(weights.shape)} "
                               f"for {held} held tokens and {kv_heads} KV heads")
        received = weights.float().sum(dim=2)  # over the queries: [b, query_heads, held]
        received = received.view(b, kv_heads, -1, held).sum(dim=2)  # query heads of one KV head together
        self.scores = self.scores + received
        self.awaiting_scores = False
        if held > self.capacity:
            self._evict()

    def _evict(self) -> None:
        held = self.scores.shape[-1]
        older = held - self.window
        # Heavy hitters among the older tokens, then back in time order (stable for equal scores).
        top = torch.topk(self.scores[:, :, :older], self.budget, dim=-1).indices.sort(dim=-1).values
        recent = torch.arange(older, held, device=top.device).expand(*top.shape[:2], self.window)
        keep = torch.cat([top, recent], dim=-1)  # [b, kv_heads, capacity]
        self.scores = self.scores.gather(-1, keep)
        index = keep.unsqueeze(-1)
        self.keys = self.keys.gather(-2, index.expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(-2, index.expand(-1, -1, -1, self.values.shape[-1]))

    def reset(self) -> None:
        super().reset()
        self.scores = None
        self.awaiting_scores = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.scores is not None and self.scores.numel():
            self.scores = self.scores.index_select(0, beam_idx.to(self.scores.device))


def selecting_cache(config: Any, make_layer: Callable[[], DynamicLayer]) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are ``make_layer()`` (the rest as transformers builds them)."""
    cache = DynamicCache(config=config)
    cache.layers = [make_layer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that call ``cache.update(..., self.layer_idx)`` and return (output, attention weights)."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
            and type(m).__name__.endswith("Attention") and any(isinstance(c, nn.Linear) for c in m.children())]


@contextlib.contextmanager
def observing_attention(model: nn.Module, cache: Any) -> Iterator[None]:
    """For one forward pass: hand each attention module's weights to the heavy-hitter layer of ``cache`` it updated.

    The hooks exist only inside the ``with`` block, so the model at rest is as transformers built it
    (and the switch transaction's snapshot of the model holds no hook to restore)."""
    layers = getattr(cache, "layers", None) or []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        idx = module.layer_idx
        layer = layers[idx] if idx < len(layers) else None
        if not isinstance(layer, HeavyHitterLayer):
            return
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(weights, torch.Tensor):
            layer.observe_attention(weights)

    handles = [m.register_forward_hook(hook) for m in _attention_modules(model)] if any(
        isinstance(layer, HeavyHitterLayer) for layer in layers) else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

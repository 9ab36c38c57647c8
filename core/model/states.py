"""The states a cache holds beside K/V: what non-attention layers keep per sequence, whatever the context.

transformers 5.24 gives every decoder layer one cache layer (``cache_utils.get_layer_types_and_kwargs``
and ``DYNAMIC_LAYER_TYPE_MAPPING``). Besides the K/V layers (``DynamicLayer``, sliding, indexed) it has:

- ``LinearAttentionLayer`` for ``linear_attention`` and ``conv`` layers (Qwen3-Next's gated delta net,
  Mamba and Mamba-2 mixers in Jamba, Zamba, Nemotron-H..., LFM2's short convolutions): no per-token
  K/V, but ``conv_states[i]`` (the last ``conv_kernel_size`` inputs of each causal convolution) and
  ``recurrent_states[i]`` (the SSM or linear-attention state), ``number_of_conv_states`` of each;
- ``LinearAttentionAndFullAttentionLayer`` / ``...SlidingWindowAttentionLayer`` for ``hybrid`` and
  ``hybrid_sliding`` layers: those states *and* a K/V layer;
- ``DummyLayer`` for layers that cache nothing (``dummy``, ``moe``/``mlp`` layers without attention,
  layers that reuse another layer's K/V).

The states' shapes are fixed by the mixer's widths (the model class computes them from config fields
of its own naming), never by the context: allocated at the first token, copied into in place after it.
So per layer they are a constant per sequence, which ``kvscope.core.model.hf.probe_states`` measures once per config:
it runs the model transformers builds for the config on the ``meta`` device (no memory, any size) with
a real ``DynamicCache`` and reads the tensors each layer then holds, at two dtypes (a state that follows
the model's dtype, and one kept in a fixed dtype, e.g. float32). The view keeps the result
(``kvscope.core.model.spec.ConfigView.states``) and this module turns it into bytes.

Here only arithmetic: no torch, no transformers (the window and ``calc`` import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Attribute names of tensors that are cache bookkeeping, not cached states (``kvscope.core.runtimes.transformers.measure`` leaves them out of the bytes it walks).
BOOKKEEPING_ATTRS: frozenset[str] = frozenset({
    "cumulative_length",
    "_sliding_window_tensor",
    "_pending_beam_idx",
    "indexer_cumulative_length",
    "indexer_position_ids",
})


@dataclass(frozen=True)
class LayerState:
    """What one layer holds beside K/V, per sequence: ``elements`` in the model's dtype plus ``fixed_bytes``
    in dtypes of their own (a float32 recurrent state in a bfloat16 model).

    A compressing layer (DeepSeek-V4's ``DeepseekV4HCACache`` / ``DeepseekV4CSACache``) also keeps state that
    grows with the tokens, in windows of ``compress_rate``: one compressed entry per full window (``entry``), the
    tokens since the last full window (``buffered``, each), and, once a first window is full, the last window's
    overlap series (``overlap``); each an (elements in the model's dtype, bytes in dtypes of their own) pair."""

    elements: int = 0
    fixed_bytes: int = 0
    compress_rate: int = 0
    entry: tuple[int, int] = (0, 0)
    buffered: tuple[int, int] = (0, 0)
    overlap: tuple[int, int] = (0, 0)

    def nbytes(self, batch: int, elem_bytes: float, tokens: int = 1) -> int:
        total = self.elements * elem_bytes + self.fixed_bytes
        if self.compress_rate:
            windows, rest = divmod(tokens, self.compress_rate)
            for (elements, fixed), count in ((self.entry, windows), (self.buffered, rest),
                                             (self.overlap, 1 if windows else 0)):
                total += count * (elements * elem_bytes + fixed)
        return int(batch * total)

    @property
    def holds_any(self) -> bool:
        return bool(self.elements or self.fixed_bytes or self.compress_rate)

    def to_json(self) -> list[int]:
        if not self.compress_rate:
            return [self.elements, self.fixed_bytes]
        return [self.elements, self.fixed_bytes, self.compress_rate, *self.entry, *self.buffered, *self.overlap]

    @classmethod
    def from_json(cls, data: Any) -> "LayerState | None":
        if isinstance(data, list) and len(data) in (2, 9) and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 0 for v in data):
            if len(data) == 2:
                return cls(data[0], data[1])
            return cls(data[0], data[1], data[2], (data[3], data[4]), (data[5], data[6]), (data[7], data[8]))
        return None


def state_bytes(states: tuple[LayerState, ...] | None, batch: int, elem_bytes: float, tokens: int) -> int:
    """Bytes of every layer's non-K/V states once at least one token went through (0 before: lazily allocated).
    ``elem_bytes``: the model's dtype (states are computed from activations, never in a KV dtype)."""
    if not states or tokens <= 0:
        return 0
    return sum(s.nbytes(batch, elem_bytes, tokens) for s in states)


def states_from_json(data: Any) -> tuple[LayerState, ...] | None | bool:
    """The per-layer states stored in a view: a tuple, None (none stored), or False (damaged)."""
    if data is None:
        return None
    if not isinstance(data, list):
        return False
    states = tuple(LayerState.from_json(d) for d in data)
    return False if any(s is None for s in states) else states


#: One cache layer's K/V as transformers' cache holds it: (heads, key width, value width, indexer-key width) per
#: token, i.e. keys [b, heads, t, key width], values [b, heads, t, value width], indexer keys [b, t, indexer width];
#: (0, 0, 0, 0) for a layer that caches no K/V.
KVShape = tuple[int, int, int, int]


def kv_shapes_from_json(data: Any) -> tuple[KVShape, ...] | None | bool:
    """The per-layer K/V shapes stored in a view: a tuple, None (none stored: the spec's formula holds), or False
    (damaged)."""
    if data is None:
        return None
    if not isinstance(data, list) or not all(
            isinstance(d, list) and len(d) == 4 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                        for v in d) for d in data):
        return False
    return tuple(tuple(d) for d in data)

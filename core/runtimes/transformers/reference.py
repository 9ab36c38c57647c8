"""The quality probe's reference: the model as loaded, kept beside the running one, teacher-forced on the run's tokens.

The quality probe (``--quality-probe``) compares every next-token distribution of the run with the one the
*unswitched loaded model* gives on the same tokens: its own weights (the K/V projections as loaded), its own
attention and layer pattern (a window only where the model has one), a full dynamic cache, the kernel it was
loaded with (no process-wide SDPA backend forced), whatever the run has switched since (attention, kernel, cache).

``LoadedReference`` is a structural copy of the model taken at the engine's start, before any conversion
(``kvscope.core.runtimes.transformers.rerun.shadow_models``: the modules, configs and attributes copied, every parameter,
buffer and tensor attribute shared, so it costs no weight memory). It stays the loaded model because the
conversions only ever *assign* into the running model's modules and configs (new Parameters for K/V heads,
``_own_storage``'s copies of fused q/k/v views, a window's config fields and module attributes, a Mistral twin
built around the Llama's own modules, the attention implementation) and never write into a tensor; MLA changes the
running model's cache only (a latent of its own K/V, ``latent``), never the model. ``is_loaded`` checks the K/V half
of that at any time.

Cost: one decode step of the loaded model per token of the run, for sequence 0 only, while the probe is on, off
the timed step; the prompt once at the prefill; a rebuild (every token so far in one batched pass) only when the
reference has lost its cache (an out-of-memory error freed it) or the tokens are not the run's any more. An
attention, kernel or cache switch changes nothing here: the reference does not follow the run's model. Its cache
is its own ``DynamicCache``, never the engine's ``cache``: the KV figures of a Sample (``kv_bytes_held``, walked
from the engine's cache) never include it; ``nbytes`` is what it holds, reported as the probe's own.
Engine side only (imports torch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvscope.core.model.caches import Dynamic
from kvscope.core.runtimes.transformers.caches import build_cache

#: What the probe compares against, in the words of its note and its summary line.
REFERENCE_WORDS = ("the model as loaded (its own K/V projections, attention and layer pattern, a full dynamic cache, "
                   "its default kernel), teacher-forced on the same tokens")


class LoadedReference:
    """A copy of the loaded model sharing its tensors, with a full dynamic cache that follows the run's tokens."""

    def __init__(self, model: nn.Module, max_context: int) -> None:
        from kvscope.core.runtimes.transformers.rerun import shadow_models

        (self.model,) = shadow_models([model])
        self.model.eval()
        self.max_context = max_context
        self.cache: Any = None
        self.tokens = 0  # tokens of sequence 0 the cache holds
        self.logits: torch.Tensor | None = None  # its next-token logits after those tokens, [vocab], float32
        self._ids: torch.Tensor | None = None  # those tokens, [1, tokens]: what a later call must start with
        self.rebuilds = 0  # batched passes over every token so far (the prefill's included)

    def forget(self) -> None:
        """Drop the cache (an out-of-memory error freed the run's): the next ``follow`` rebuilds it."""
        self.cache = self.logits = self._ids = None
        self.tokens = 0

    def follow(self, ids: torch.Tensor) -> torch.Tensor:
        """The loaded model's next-token logits [vocab] after sequence 0 of ``ids`` ([batch, n]), teacher-forced:
        the tokens its cache lacks go through it (one decode step per new token of the run); a sequence that is
        not a continuation of what it holds is run again from the start, in one pass."""
        seq = ids[:1]
        n = int(seq.shape[1])
        held = self._ids
        if self.cache is not None and self.logits is not None and held is not None and 0 < self.tokens <= n \
                and torch.equal(seq[:, :self.tokens], held.to(seq.device)):
            if self.tokens == n:
                return self.logits
            self.logits = self._forward(seq[:, self.tokens:])
        else:
            self.cache = None
            self.cache = build_cache(Dynamic(), self.model.config, self.max_context)
            self.rebuilds += 1
            self.logits = self._forward(seq)
        self.tokens = n
        self._ids = seq
        return self.logits

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1, :].float()

    @property
    def nbytes(self) -> int:
        """Bytes the reference's own cache holds (the probe's memory, never the run's KV)."""
        if self.cache is None:
            return 0
        from kvscope.core.runtimes.transformers.measure import cache_bytes

        return cache_bytes(self.cache).logical

    def is_loaded(self, origin: Any) -> bool:
        """Whether this copy's K/V projections are the loaded tensors themselves (``convert.KVOrigin``)."""
        return origin is None or origin.is_loaded(self.model)


def quality(ours: torch.Tensor, ref: torch.Tensor) -> tuple[int, float, int]:
    """(1 when ``ours``' most likely token is ``ref``'s else 0, KL(ref || ours) in nats >= 0, ``ref``'s most
    likely token) of two next-token logit vectors over the whole vocabulary."""
    ref = ref.to(ours.device)
    log_ours, log_ref = torch.log_softmax(ours.float(), dim=-1), torch.log_softmax(ref.float(), dim=-1)
    kl = float((log_ref.exp() * (log_ref - log_ours)).sum())
    best = int(ref.argmax())
    return int(int(ours.argmax()) == best), max(0.0, kl), best

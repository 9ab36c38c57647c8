"""What a switch changes in a transformers engine, as one value: ``EngineState``.

The switch transaction records it before the first change and puts it back on failure
(``kvscope.core.runtimes.transformers.switch.apply``); a re-run's shadow (``rerun.py``) works on a copy of it and
hands the copy back whole when it applies. ``Engine`` reads and writes it through ``StateField``s, so
``engine.cache`` is ``engine.state.cache``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvscope.core.model.attention import AttentionMode
from kvscope.core.model.settings import RunSettings


@dataclass
class EngineState:
    """A running model and its cache as a switch leaves them."""

    model: Any  # the module that runs (a Llama's sliding-window twin shares the base model's layers)
    base_model: Any  # the model as loaded, converted in place (its K/V projections swapped, never written into)
    mode: AttentionMode
    settings: RunSettings
    kernel: str = "sdpa"  # the attention kernel PyTorch really dispatched (measured)
    cache: Any = None
    cache_base_tokens: int = 0  # tokens pushed in the cache's first update (quantized residual bookkeeping)
    next_logits: Any = None  # the logits the next token is sampled from
    weights_observed: int = 0  # bytes of the running model's tensors, measured
    tokens_rerun: int | None = None  # set by a switch that runs the tokens through the model again

    def copy(self) -> "EngineState":
        """A copy of the value (the models and the cache are the same objects: the shadow replaces them)."""
        return dataclasses.replace(self)


#: The state's fields, for the transaction's undo log.
FIELDS = tuple(f.name for f in dataclasses.fields(EngineState))


class StateField:
    """An attribute of the owner that is a field of its ``state``."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(owner.state, self.field)

    def __set__(self, owner: Any, value: Any) -> None:
        setattr(owner.state, self.field, value)

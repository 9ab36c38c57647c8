"""One guarded first import of transformers.

transformers resolves its public names lazily (``_LazyModule.__getattr__``); two threads resolving
them for the first time at once can fail with "cannot import name 'AutoConfig'". The window's
calculator loads specs on a pool thread while the generation worker loads a model on its own, so
every core entry point that touches transformers calls ``ensure_transformers()`` first: one thread
imports and resolves the names we use, the others wait for it.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_ready = False


def ensure_transformers() -> None:
    """Import transformers and resolve the names core uses, once per process, thread-safely."""
    global _ready
    if _ready:
        return
    with _lock:
        if _ready:
            return
        import transformers
        from transformers import cache_utils  # noqa: F401

        for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "DynamicCache", "StaticCache",
                     "QuantizedCache", "PreTrainedTokenizerFast", "GenerationConfig", "LlamaConfig",
                     "LlamaForCausalLM", "MistralConfig", "MistralForCausalLM", "DeepseekV3Config",
                     "DeepseekV3ForCausalLM"):
            getattr(transformers, name)
        _ready = True

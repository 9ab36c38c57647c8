"""One guarded first import of transformers.

transformers resolves its public names lazily (``_LazyModule.__getattr__``); two threads resolving
them for the first time at once can fail with "cannot import name 'AutoConfig'". The window's
calculator loads specs on a pool thread while the generation worker loads a model on its own, so
every core entry point that touches transformers calls ``ensure_transformers()`` first: one thread
imports and resolves the names we use, the others wait for it.
"""

from __future__ import annotations

import gc
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
        freeze_long_lived()
        _ready = True


def freeze_long_lived() -> None:
    """Take every object alive now out of the cyclic garbage collector's walks (``gc.freeze``).

    Importing torch and transformers leaves hundreds of thousands of objects (modules, classes,
    functions) that live as long as the process. Each full collection walks all of them while
    holding the GIL, and every thread waits: 150-520 ms pauses were measured, in the generation
    thread and in the window's. Frozen, they are skipped; refcounting still frees them. Call it
    after big imports, never with a model alive (a model's cycles would then never be collected).
    """
    gc.freeze()

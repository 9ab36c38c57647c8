"""What core asks transformers about a config, and one guarded first import of transformers.

``compute_view`` is the one place a config meets transformers (and torch) outside the engine: the
layer types its cache builds, the window it fills in, the meta-device facts (``core.spec.ConfigView``).
It runs once per config and transformers version; presets and the on-disk memo answer after that.

transformers resolves its public names lazily (``_LazyModule.__getattr__``); two threads resolving
them for the first time at once can fail with "cannot import name 'AutoConfig'". The window's
calculator loads specs on a pool thread while the generation worker loads a model on its own, so
every core entry point that touches transformers calls ``ensure_transformers()`` first: one thread
imports and resolves the names we use, the others wait for it.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

from core.longlived import freeze_long_lived
from core.spec import (FULL_ATTENTION, INDEXED_ATTENTION, SLIDING_ATTENTION, ConfigView, ModelFacts, is_plain_int,
                        is_transformers_refusal, transformers_refusal)

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


def build_hf_config(cfg: dict[str, Any]):
    """A transformers config object for ``cfg``, or None for model types transformers does not know.

    A config of a known type that transformers' own validation refuses (hidden size not a multiple of
    the heads...) is a SpecError (core.spec.transformers_refusal): ``run`` refuses it with the same line."""
    ensure_transformers()
    from transformers import AutoConfig

    model_type = cfg.get("model_type")
    if not model_type:
        return None
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "_kvscope", "auto_map")}
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:  # an unknown model type (ValueError), or a refusal (StrictDataclassError)
        if is_transformers_refusal(exc):
            raise transformers_refusal(exc) from None
        return None


@functools.lru_cache(maxsize=64)
def meta_facts(config_json: str) -> ModelFacts | None:
    """Facts of the model a config describes, built on the meta device (no memory)."""
    import torch

    ensure_transformers()
    from transformers import AutoModelForCausalLM

    hf_config = build_hf_config(json.loads(config_json))
    if hf_config is None:
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception:  # unknown architecture, encoder-only, remote code...
        return None
    # parameters() yields tied weights once, which is what the weights occupy; buffers likewise.
    params = int(sum(p.numel() for p in model.parameters()))
    buffers = int(sum(b.numel() * b.element_size() for b in model.buffers()))
    kv_bias = any(getattr(getattr(m, "k_proj", None), "bias", None) is not None for m in model.modules())
    # transformers refuses sdpa for some classes (Gemma 2: sdpa cannot softcap); they load with eager.
    return ModelFacts(params, buffers, kv_bias, bool(getattr(type(model), "_supports_sdpa", True)))


def hf_layer_types(hf_config) -> tuple[str, ...] | None:
    """Per-layer attention types exactly as transformers' cache builds them (None if it cannot say)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, _ = get_layer_types_and_kwargs(hf_config.get_text_config(decoder=True))
    except Exception:
        return None
    return tuple(SLIDING_ATTENTION if t in ("sliding_attention", "chunked_attention")
                 else INDEXED_ATTENTION if t == INDEXED_ATTENTION else FULL_ATTENTION for t in types)


def compute_view(key: str) -> ConfigView:
    """The view of the config ``key`` (its canonical JSON), found with transformers (and torch)."""
    cfg = json.loads(key)
    hf_config = build_hf_config(cfg)
    if hf_config is None:
        return ConfigView(known=False)
    window = getattr(hf_config, "sliding_window", None)
    window = window if is_plain_int(window) and window > 0 else None
    return ConfigView(True, hf_layer_types(hf_config), window, meta_facts(key))

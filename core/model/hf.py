"""What core asks transformers about a config, and one guarded first import of transformers.

``compute_view`` is the one place a config meets transformers (and torch) outside the engine: the
layer types its cache builds, the window it fills in, the meta-device facts (``kvscope.core.model.spec.ConfigView``).
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

from kvscope.core.base.longlived import freeze_long_lived
from kvscope.core.model.caches import kv_layout
from kvscope.core.model.spec import (FULL_ATTENTION, INDEXED_ATTENTION, NO_KV, SLIDING_ATTENTION, ConfigView,
                                     ModelFacts, ModelSpec, SpecError, _checked_counts, _text_config, is_plain_int,
                                     is_transformers_refusal, transformers_refusal)
from kvscope.core.model.states import BOOKKEEPING_ATTRS, KVShape, LayerState

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

        _import_cache_utils()
        for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "DynamicCache", "StaticCache",
                     "QuantizedCache", "PreTrainedTokenizerFast", "GenerationConfig", "LlamaConfig",
                     "LlamaForCausalLM", "MistralConfig", "MistralForCausalLM", "DeepseekV3Config",
                     "DeepseekV3ForCausalLM"):
            getattr(transformers, name)
        freeze_long_lived()
        _ready = True


class _LazyHQQQuantizer:
    """hqq's ``Quantizer``, imported at its first use. transformers' cache module imports it at its own import
    when hqq is installed, and hqq defines its classes under ``torch.compile``, which imports dynamo's backends
    and inductor: about 1 s of CPU at every engine start (5.2 -> 4.1 s for torch and transformers here), for
    a cache backend few runs use."""

    def __getattr__(self, name: str) -> Any:
        from hqq.core.quantize import Quantizer

        return getattr(Quantizer, name)


def _import_cache_utils() -> None:
    """``transformers.cache_utils``, with hqq's quantizer left to its first use (``_LazyHQQQuantizer``)."""
    import sys

    if "transformers.cache_utils" in sys.modules:
        return
    from transformers import utils as hf_utils

    real = hf_utils.is_hqq_available
    hf_utils.is_hqq_available = lambda *args, **kwargs: False  # what cache_utils asks at its import only
    try:
        from transformers import cache_utils
    finally:
        hf_utils.is_hqq_available = real
    cache_utils.is_hqq_available = real  # HQQQuantizedLayer asks it again when built
    if not hasattr(cache_utils, "HQQQuantizer") and real():
        cache_utils.HQQQuantizer = _LazyHQQQuantizer()


def build_hf_config(cfg: dict[str, Any]):
    """A transformers config object for ``cfg``, or None for model types transformers does not know.

    A config of a known type that transformers' own validation refuses (hidden size not a multiple of
    the heads...) is a SpecError (kvscope.core.model.spec.transformers_refusal): ``run`` refuses it with the same line."""
    ensure_transformers()
    from transformers import AutoConfig

    model_type = cfg.get("model_type")
    if not model_type:
        return None
    kwargs = {k: v for k, v in _decoded_floats(cfg).items() if k not in ("model_type", "_kvscope", "auto_map")}
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:  # an unknown model type (ValueError), or a refusal (StrictDataclassError)
        if is_transformers_refusal(exc):
            raise transformers_refusal(exc) from None
        return None


def _decoded_floats(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` as transformers' own reader gives it to a config class: ``save_pretrained`` writes infinity and
    NaN as ``{"__float__": "Infinity"}`` (``PreTrainedConfig._encode_special_floats``; Mamba-2's
    ``time_step_limit`` is ``[0.0, inf]``), and ``from_pretrained`` decodes them again
    (``_dict_from_json_file`` -> ``_decode_special_floats``). A plain JSON read keeps the tag dicts, which the
    config class's validation refuses ("time_step_limit ... doesn't match any type in list[float]")."""
    from transformers.configuration_utils import PreTrainedConfig

    decode = getattr(PreTrainedConfig, "_decode_special_floats", None)
    return decode(cfg) if callable(decode) else cfg


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


#: transformers' cache layer types (``cache_utils.DYNAMIC_LAYER_TYPE_MAPPING``) as the K/V they hold: sliding
#: and chunked layers keep a window (DynamicSlidingWindowLayer), hybrid layers a linear-attention state *and*
#: K/V, linear-attention, conv and dummy layers no K/V (their states: ``probe_states``).
_KV_KIND = {"sliding_attention": SLIDING_ATTENTION, "chunked_attention": SLIDING_ATTENTION,
            # DeepSeek-V4's compressing layers keep a sliding window of K=V (and their compressor's state: kvscope.core.model.states)
            "heavily_compressed_attention": SLIDING_ATTENTION, "compressed_sparse_attention": SLIDING_ATTENTION,
            "hybrid_sliding": SLIDING_ATTENTION, INDEXED_ATTENTION: INDEXED_ATTENTION,
            "linear_attention": NO_KV, "conv": NO_KV, "dummy": NO_KV}


def _cache_layer_types(hf_config) -> tuple[list[str], list[dict]] | None:
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return get_layer_types_and_kwargs(hf_config.get_text_config(decoder=True))
    except Exception:
        return None


def hf_layer_types(hf_config) -> tuple[str, ...] | None:
    """Per-layer K/V kinds exactly as transformers' cache builds them (None if it cannot say)."""
    found = _cache_layer_types(hf_config)
    if found is None:
        return None
    return tuple(_KV_KIND.get(t, FULL_ATTENTION) for t in found[0])


def hf_sliding_window(hf_config) -> int | None:
    """The window the cache's sliding layers keep: the config's ``sliding_window``, else what transformers
    gives its sliding layers (Llama 4's chunked layers: ``attention_chunk_size``)."""
    window = getattr(hf_config.get_text_config(decoder=True), "sliding_window", None)
    if window is None:
        found = _cache_layer_types(hf_config)
        windows = {kw.get("sliding_window") for kw in found[1]} - {None} if found else set()
        window = windows.pop() if len(windows) == 1 else None
    return window if is_plain_int(window) and window > 0 else None


#: Tensors a cache layer holds that are its K/V (predicted by the layer formulas, not here) or bookkeeping
#: (kvscope.core.model.states.BOOKKEEPING_ATTRS).
_NOT_STATES = frozenset({"keys", "values", "indexer_keys"})


#: A compressing cache layer's state that grows with the tokens (DeepSeek-V4's DeepseekV4HCACache and
#: DeepseekV4CSACache, per entry name: "compressor", "indexer"): ``_compressing_state`` reads it.
_COMPRESSOR_BUFFERS = ("buffer_kv", "buffer_gate")
_COMPRESSOR_ENTRIES = ("compressed_kv",)
_COMPRESSOR_OVERLAP = ("overlap_kv", "overlap_gate")


def _compress_rate(layer) -> int:
    rate = getattr(layer, "compress_rate", None)
    return rate if is_plain_int(rate) and rate > 0 and isinstance(getattr(layer, "compressed_kv", None), dict) else 0


def _layer_states(layer) -> dict[str, tuple[int, int]]:
    """{name: (elements, bytes)} of the tensors a cache layer holds beside K/V and its bookkeeping (a compressing
    layer's growing state left out: ``_compressing_state``)."""
    import torch


    growing = (*_COMPRESSOR_BUFFERS, *_COMPRESSOR_ENTRIES, *_COMPRESSOR_OVERLAP) if _compress_rate(layer) else ()
    out = {}
    for name, value in vars(layer).items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for key, tensor in items:
            if not isinstance(tensor, torch.Tensor) or name in _NOT_STATES or name in BOOKKEEPING_ATTRS \
                    or name in growing:
                continue
            out[f"{name}[{key}]" if key is not None else name] = (tensor.numel(), tensor.numel() * tensor.element_size())
    return out


def _probe_cache(hf_config, dtype, tokens: int = 2):
    """A DynamicCache filled by ``tokens`` tokens through the model of ``hf_config`` built in ``dtype``, all
    on the meta device (no memory; ~25 ms a layer: the meta kernels are Python)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    with torch.device("meta"), _meta_nonzero():
        # batched_mm: the default grouped_mm experts kernel only takes bfloat16 on the meta device.
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, experts_implementation="batched_mm")
        cache = DynamicCache(config=hf_config)
        with torch.inference_mode():
            model(input_ids=torch.zeros((1, tokens), dtype=torch.long), cache=cache, use_cache=True)
    return cache


def _meta_nonzero():
    """torch.nonzero on meta tensors answers as if every element were non-zero (a routing's token picks:
    Qwen4-exp's), instead of refusing: the states' shapes never depend on which tokens were picked."""
    import contextlib

    try:
        import torch.fx.experimental._config as fx_config

        return fx_config.patch(meta_nonzero_assume_all_nonzero=True)
    except (ImportError, AttributeError, KeyError):  # another torch: the probe refuses such models, as before
        return contextlib.nullcontext()


def _compressing_state(layer) -> LayerState | None:
    """The growing state of a compressing cache layer (``kvscope.core.model.states.LayerState``), read off a layer that has seen
    more tokens than its ``compress_rate`` (every tensor then exists, in its real dtype): per entry name, a buffered
    token is one row of ``buffer_kv`` and of ``buffer_gate`` [b, tokens, w], a full window one row of
    ``compressed_kv`` [b, entries, w], and the overlap ``overlap_kv`` / ``overlap_gate`` [b, rate, w] whole.
    Widths in bfloat16 (the probe's dtype) follow the model's dtype; others are bytes. None if a tensor is missing."""
    import torch

    def per_row(names: tuple[str, ...], whole: bool = False) -> tuple[int, int] | None:
        elements = fixed = 0
        for attr in names:
            for tensor in (getattr(layer, attr, None) or {}).values():
                if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
                    return None
                n = int(tensor.shape[1] * tensor.shape[2]) if whole else int(tensor.shape[2])
                if tensor.element_size() == 2:
                    elements += n
                else:
                    fixed += n * tensor.element_size()
        return elements, fixed

    rate = _compress_rate(layer)
    entry, buffered, overlap = per_row(_COMPRESSOR_ENTRIES), per_row(_COMPRESSOR_BUFFERS), per_row(_COMPRESSOR_OVERLAP,
                                                                                                   whole=True)
    if not rate or entry is None or buffered is None or overlap is None:
        return None
    return LayerState(compress_rate=rate, entry=entry, buffered=buffered, overlap=overlap)


def _kv_shape(layer) -> KVShape:
    """What one probed cache layer holds per token (``kvscope.core.model.states.KVShape``): keys [b, h, t, dk], values
    [b, h, t, dv], indexer keys [b, t, di]; keys and values of different head counts are one "head" each wide."""
    import torch

    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == values.dim() == 4):
        return (0, 0, 0, 0)
    index = getattr(layer, "indexer_keys", None)
    extra = int(index.shape[-1]) if isinstance(index, torch.Tensor) and index.dim() == 3 else 0
    if keys is values:  # one tensor for both (DeepSeek-V4's shared-KV layers): held once
        return (int(keys.shape[1]), int(keys.shape[-1]), 0, extra)
    if keys.shape[1] == values.shape[1]:
        return (int(keys.shape[1]), int(keys.shape[-1]), int(values.shape[-1]), extra)
    return (1, int(keys.shape[1] * keys.shape[-1]), int(values.shape[1] * values.shape[-1]), extra)


def probe_states(hf_config, types: tuple[str, ...] | None) -> tuple[tuple[str, ...] | None, tuple[LayerState, ...] | None,
                                                                    tuple[KVShape, ...] | None]:
    """What each cache layer holds beside K/V, per sequence, measured on the meta device (``kvscope.core.model.states``),
    the layer kinds corrected by what the layers really cache (a layer that stays empty after a
    forward pass caches nothing: GPT-1, RWKV keep no K/V), and each layer's K/V shape (``_kv_shape``).
    ``(types, None, None)``: the probe cannot say (the model does not run on meta, or brings a cache of its
    own); states None: no layer holds any.

    One forward pass of a bfloat16 model: a state in bfloat16 follows the model's dtype (``elements``); one
    in another dtype (float32) is kept in it whatever the model's (``fixed_bytes``)."""
    import torch

    if types is None:
        return types, None, None
    try:
        cache = _probe_cache(hf_config, torch.bfloat16)
    except Exception:  # data-dependent ops on meta (nonzero), a cache class of its own, no causal-LM class...
        return types, None, None
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or len(layers) < len(types):
        return types, None, None
    if len(layers) > len(types):
        # The forward pass added cache layers of its own: Dory runs its recurrent layers in loops and appends a copy
        # of their cache layers per extra loop. Each copy is of the class of a layer it copies: that layer's kind.
        kinds = {}
        for layer, kind in zip(layers, types):
            kinds.setdefault(type(layer), set()).add(kind)
        extra = [kinds.get(type(layer), set()) for layer in layers[len(types):]]
        if any(len(k) != 1 for k in extra):
            return types, None, None
        types = (*types, *(next(iter(k)) for k in extra))
    found_types, states = list(types), []
    rates = [_compress_rate(layer) for layer in layers]
    later = None
    if any(rates):
        # Compressing layers: a second pass past every window, so that each growing tensor exists in its real dtype.
        try:
            later = _probe_cache(hf_config, torch.bfloat16, tokens=max(rates) + 1).layers
        except Exception:
            return types, None, None
        if len(later) != len(layers):
            return types, None, None
    for i, kind in enumerate(types):
        held = _layer_states(layers[i])
        state = LayerState(sum(n for n, b in held.values() if b == 2 * n),
                           sum(b for n, b in held.values() if b != 2 * n))
        if rates[i]:
            growing = _compressing_state(later[i])
            if growing is None:
                return types, None, None
            state = LayerState(state.elements, state.fixed_bytes, growing.compress_rate, growing.entry,
                               growing.buffered, growing.overlap)
        states.append(state)
        if kind != NO_KV and getattr(layers[i], "keys", None) is None:
            found_types[i] = NO_KV
    if not any(s.holds_any for s in states):
        states = None
    shapes = tuple(_kv_shape(layer) if kind != NO_KV else (0, 0, 0, 0) for layer, kind in zip(layers, found_types))
    return tuple(found_types), None if states is None else tuple(states), shapes


def _shapes_beyond_formula(cfg: dict[str, Any], types: tuple[str, ...] | None,
                           shapes: tuple[KVShape, ...] | None) -> tuple[KVShape, ...] | None:
    """The probed per-layer K/V shapes where some layer differs from what ``kvscope.core.model.caches.kv_layout`` derives from the
    config's counts (a spec without ``layer_kv``); None where every layer agrees (nearly every model: their views,
    presets' included, stay as they were) or the counts cannot be read (the spec refuses the config then)."""
    if types is None or shapes is None:
        return None
    try:
        counts = _checked_counts(_text_config(cfg), "model")
    except SpecError:
        return None
    formula = kv_layout(ModelSpec(
        name="model", model_type="", num_layers=len(types), num_query_heads=counts["heads"],
        num_kv_heads=counts["kv_heads"], head_dim=counts["head_dim"], hidden_size=counts["hidden"],
        vocab_size=counts["vocab"], tie_word_embeddings=False, max_position_embeddings=counts["max_pos"],
        dtype="float32", num_parameters=0, layer_types=types,
        indexer_head_dim=counts["indexer"] if INDEXED_ATTENTION in types else None, **counts["mla"]))
    probed = [s for s, kind in zip(shapes, types) if kind != NO_KV]
    derived = [(kv.heads, kv.k_dim, kv.v_dim, kv.extra) for kv in formula]
    return None if probed == derived else shapes


def compute_view(key: str) -> ConfigView:
    """The view of the config ``key`` (its canonical JSON), found with transformers (and torch)."""
    cfg = json.loads(key)
    hf_config = build_hf_config(cfg)
    if hf_config is None:
        return ConfigView(known=False)
    types, states, shapes = probe_states(hf_config, hf_layer_types(hf_config))
    # Tied output head: what transformers' tying reads (a missing field is False), where config.json names nothing.
    tied = None if "tie_word_embeddings" in cfg else bool(getattr(hf_config.get_text_config(decoder=True),
                                                                  "tie_word_embeddings", False))
    return ConfigView(True, types, hf_sliding_window(hf_config), meta_facts(key), states, tied,
                      _shapes_beyond_formula(cfg, types, shapes))

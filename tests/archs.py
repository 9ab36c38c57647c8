"""Tiny random models of every decoder-only architecture transformers registers for causal LM.

A helper module for ``tests/test_arch_matrix.py`` (not a test file itself; ``python tests/archs.py``
lists what builds). The list of architectures is transformers' own ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, so a new transformers
release brings its new architectures into the matrix without an edit here.

``tiny_config(model_type)`` starts from the model type's own config class with its defaults
(``AutoConfig.for_model``) and shrinks it generically, by attribute name: every size field the
config class has (hidden size, heads, KV heads, head_dim, MLP width, experts, MLA ranks, SSM
state...) is set to a tiny value, whatever the class calls it. Per-layer lists (``layer_types``,
``mlp_layer_types``...) are cut to the fewest leading layers that still contain every kind of layer
the full model has, so a model that mixes sliding and full attention keeps both. A short table of
exceptions (``_EXCEPTIONS``) covers what the generic rules cannot know, each with a reason.

``build_tiny_folder(model_type, root)`` writes an ordinary model folder (config.json, safetensors
weights, the embedded demo model's tokenizer) that ``kvscope.core.runtimes.transformers.loading.load_model`` loads.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The embedded model folder (for its tokenizer) goes to this checkout's test cache, as in conftest.
_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("KVSCOPE_CACHE", str(_ROOT / ".pytest_cache" / "kvscope"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Tiny sizes.
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
MAX_POSITIONS = 512
WINDOW = 16
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
#: Most leading layers a per-layer pattern may need to show every kind of layer (Gemma 3: 6).
MAX_LAYERS = 8

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TinyBuildError(RuntimeError):
    """This architecture cannot be built as a tiny text-only causal LM here; the message says why."""


# ------------------------------------------------------------------------------------------------
# Which model types


@functools.lru_cache(maxsize=1)
def _mappings() -> dict[str, Any]:
    from transformers.models.auto import modeling_auto as ma

    return {
        "causal": dict(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "masked": set(ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        "seq2seq": set(ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
    }


#: Encoder-style types that transformers lists for causal LM but not for masked LM: BERT used as a
#: decoder half (BertGenerationDecoder) and XLNet (a permutation LM with bidirectional two-stream
#: attention and its own ``mems``, no KV cache of transformers' kind).
_ENCODER_ONLY_EXTRA = {"bert-generation", "xlnet"}


def registry_model_types() -> list[str]:
    """Every model type in transformers' causal-LM registry, sorted."""
    return sorted(_mappings()["causal"])


def skip_reason(model_type: str) -> str | None:
    """Why a registered type is not a decoder-only model (None when it is)."""
    _quiet()
    m = _mappings()
    if model_type in m["seq2seq"]:
        return "encoder-decoder (seq2seq registry)"
    if model_type in m["masked"] or model_type in _ENCODER_ONLY_EXTRA:
        return "encoder-only (BERT-like; causal class is a decoder half)"
    try:
        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if getattr(AutoConfig.for_model(model_type), "is_encoder_decoder", False):
                return "encoder-decoder (is_encoder_decoder)"
    except Exception:  # noqa: BLE001 - a config that cannot be built is reported by tiny_config
        pass
    return None


def causal_lm_model_types() -> list[str]:
    """Decoder-only model types of transformers' causal-LM registry, sorted."""
    return [t for t in registry_model_types() if skip_reason(t) is None]


# ------------------------------------------------------------------------------------------------
# Shrinking a config

#: Size fields by name, whatever the config class calls them. Only names the class has are set.
_SIZES: dict[str, int] = {}
for _names, _value in (
    (("hidden_size", "n_embd", "d_model", "emb_dim", "embedding_dim", "attention_hidden_size", "lru_width",
      "hidden_size_per_layer_input", "backbone_hidden_size", "word_embed_proj_dim", "embedding_size",
      "input_embedding_size", "ple_embed_dim", "router_hidden_size", "hidden_size_global"), HIDDEN),
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), LAYERS),
    (("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "swa_num_attention_heads",
      "decoder_attention_heads"), HEADS),
    (("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads", "multi_query_group_num", "num_query_groups",
      "swa_num_key_value_heads"), KV_HEADS),
    (("head_dim", "attention_head_dim", "kv_channels", "dim_head", "d_head", "swa_head_dim", "attention_head_size",
      "rotary_dim"), HEAD_DIM),
    (("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "dff", "dim_ff", "d_inner", "decoder_ffn_dim",
      "intermediate_size_mlp", "dense_intermediate_size", "feed_forward_size", "prefix_dense_intermediate_size"),
     INTERMEDIATE),
    (("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
      "shared_experts_intermediate_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size"),
     EXPERT_INTERMEDIATE),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length", "seq_length",
      "context_length", "model_max_length", "rel_extent", "position_bias_max_distance"), MAX_POSITIONS),
    (("sliding_window", "sliding_window_size", "window_size", "attention_window_size", "local_attention",
      "attention_chunk_size", "local_attention_window_len"), WINDOW),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    (("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts"), EXPERTS_PER_TOKEN),
    (("n_group", "topk_group", "num_expert_group", "n_groups", "mamba_n_groups", "mamba_ngroups", "o_groups"), 1),
    # MLA (DeepSeek-V2/V3 style): latent ranks and the split of a key into rope and no-rope parts.
    (("kv_lora_rank", "q_lora_rank", "o_lora_rank"), 32),
    # nope + rope = head_dim: some classes (Dots3 Note) require a key to be exactly head_dim wide.
    (("qk_rope_head_dim", "qk_nope_head_dim"), HEAD_DIM // 2),
    (("v_head_dim", "qk_head_dim"), HEAD_DIM),
    # Sparse-attention indexers (DeepSeek-V3.2 style).
    (("index_n_heads", "indexer_n_heads"), 2),
    (("index_head_dim", "indexer_head_dim"), HEAD_DIM),
    (("index_topk", "indexer_budget"), 32),
    # State-space and linear-attention mixers.
    (("state_size", "mamba_d_state", "ssm_state_size"), 16),
    (("mamba_d_head", "mamba_head_dim", "mamba_headdim", "linear_head_dim", "linear_key_head_dim",
      "linear_value_head_dim"), HEAD_DIM),
    (("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "linear_num_heads", "linear_num_key_heads",
      "linear_num_value_heads"), HEADS),
    (("time_step_rank", "mamba_dt_rank"), 8),
    (("mamba_d_ssm",), HIDDEN),
    (("chunk_size", "mamba_chunk_size"), 16),
    (("adapter_rank", "laurel_rank", "gated_norm_rank", "loop_gate_rank", "hc_lowrank"), 8),
    # Extra embedding tables that are not the vocabulary.
    (("vocab_size_per_layer_input", "encoder_hash_byte_group_vocab"), 1024),
    (("num_nextn_predict_layers", "num_mtp_layers"), 0),
):
    for _name in _names:
        _SIZES[_name] = _value

#: Widths and head sizes a config class may derive from the hidden size and heads (when its default is None).
_DERIVABLE = frozenset(n for n, v in _SIZES.items() if v in (HIDDEN, HEAD_DIM)) - {
    "hidden_size", "n_embd", "d_model", "emb_dim", "embedding_dim"}

#: Fields some config classes default to None although their model class needs a number (their
#: defaults do not build); filled only when None.
_FILL_IF_NONE: dict[str, int] = {
    "head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS, "n_routed_experts": EXPERTS,
    "num_experts_per_tok": EXPERTS_PER_TOKEN, "n_shared_experts": 1, "indexer_n_heads": 2,
    "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 32, "indexer_compress_ratio": 4,
}

#: Layer counts and indices that must stay below the (new) number of layers.
_LAYER_INDEX_FIELDS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")

#: Fields that name token ids of the text vocabulary; set to the embedded tokenizer's ids.
_TOKEN_FIELDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

#: What the generic rules cannot know. Each entry: model type -> overrides, with why. Special keys:
#: ``_layers`` (number of layers, before per-layer lists are cut), ``_occurrences`` (each kind of
#: layer in a per-layer list must appear this many times) and ``_mha`` (K/V heads = query heads,
#: everywhere). Nested config dicts are merged.
_EXCEPTIONS: dict[str, dict[str, Any]] = {
    # Jamba puts attention at layer offset+k*period (default 4 of 8) and experts every 2nd layer:
    # with 2 layers there would be no attention layer at all.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # Zamba ties the weights of its shared attention block across its hybrid layers: it needs two.
    "zamba": {"_occurrences": 2},
    # Gemma 3n: the last num_kv_shared_layers layers reuse earlier layers' K/V, and the sharing layers
    # must cover both kinds (sliding and full) of the layers that produce K/V: 10 layers, 5 shared.
    "gemma3n_text": {"_layers": 10, "num_kv_shared_layers": 5},
    # Dory's to_dict() writes every layer twice (attention, then "mlp") and doubles the counts;
    # its constructor halves them again. 8 here = 4 layers: 1 input, 2 recurrent, 1 output.
    "dory": {"_layers": 8, "n_input_layers": 2, "n_recurrent_layers": 4, "n_output_layers": 2},
    # Dots3 Note's attention requires as many K/V heads as query heads (its config validator says so),
    # also in its per-layer overrides.
    "dots3_note_text": {"_mha": True},
    "dots3_note": {"_mha": True},
    # Defaults that do not build in this transformers (the model class needs what the config lacks):
    # Cohere Compass reads RoPE per layer type and its default has none;
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # Moshi derives audio_vocab_size from an audio encoder config given to it; its default has none,
    # so the default's audio_vocab_size is None, which its depth decoder refuses (2048 = the codebook).
    "moshi": {"audio_vocab_size": 2048},
    # DBRX's attention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare, and
    # clamps q/k/v to attn_config.clip_qkv, whose default None makes torch.clamp fail (checkpoints use 8).
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # Hybrids whose default has no attention layer at all (real checkpoints have some): one attention layer.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    # RecurrentGemma cycles block_types (recurrent, recurrent, attention): 3 layers to reach attention.
    "recurrent_gemma": {"_layers": 3},
    # LFM2-MoE's layer_types defaults to None (LFM2's own config derives it): one conv, one attention layer.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
}

#: Passed to the config class before shrinking, where its own defaults are refused by its validators.
_DEFAULT_FIXES: dict[str, dict[str, Any]] = {
    # Gemma 4 assistant: its text sub-config defaults the per-layer-input sizes to 256 / 262144, which
    # the assistant's validator refuses ("must be 0").
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}

#: Flags that ask for CUDA-only kernels; the tiny models run on the CPU.
_CPU_FLAGS = {"use_mamba_kernels": False, "use_mem_eff_path": False}


def _is_per_layer_list(value: Any, n_layers: int) -> bool:
    return isinstance(value, (list, tuple)) and n_layers > 1 and len(value) == n_layers


def _layers_needed(lists: list[list[Any]], occurrences: int = 1) -> int:
    """Fewest leading layers such that each per-layer list shows every distinct entry it has
    (``occurrences`` times, or as often as it has it)."""
    need = LAYERS
    for values in lists:
        keys = [json.dumps(v, sort_keys=True, default=str) for v in values]
        for key in set(keys):
            positions = [i for i, k in enumerate(keys) if k == key]
            need = max(need, positions[min(occurrences, len(positions)) - 1] + 1)
    return need


_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


def _layer_count(d: dict[str, Any]) -> int | None:
    for name in _LAYER_COUNT_FIELDS:
        if isinstance(d.get(name), int):
            return d[name]
    return None


def _is_layer_index_dict(value: Any) -> bool:
    """A dict keyed by layer index (``per_layer_config``: {"3": {...}, "7": {...}})."""
    return isinstance(value, dict) and bool(value) and all(str(k).isdigit() for k in value) \
        and not all(isinstance(v, str) for v in value.values())  # not id2label


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _shrink_dict(d: dict[str, Any], model_type: str, vocab: int, nested: bool = False,
                 derived: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Overrides for one (flat) config dict; nested configs (``*_config`` dicts) recurse.

    ``derived``: fields the config class computes from others when left None (Zamba's attention width
    is 2 x hidden): these are left to the class (passed as None) when they are widths or head sizes."""
    exceptions = {} if nested else _EXCEPTIONS.get(model_type, {})
    mha = _EXCEPTIONS.get(model_type, {}).get("_mha", False)
    out: dict[str, Any] = {}
    n_layers = _layer_count(d)
    per_layer = {k: v for k, v in d.items() if n_layers and _is_per_layer_list(v, n_layers)}
    layers = min(_layers_needed(list(per_layer.values()), exceptions.get("_occurrences", 1)), MAX_LAYERS) \
        if per_layer else LAYERS
    layers = exceptions.get("_layers", layers)
    for name, value in d.items():
        if isinstance(value, bool):
            continue
        if name in _LAYER_COUNT_FIELDS and isinstance(value, int):
            out[name] = layers
        elif name in derived and name in _DERIVABLE and value is not None:
            out[name] = None
        elif name in _SIZES and isinstance(value, int):
            # Never grow a field (a window of 4 stays 4; a top-k of 1 stays 1); zeros stay (no MTP).
            out[name] = min(value, _SIZES[name])
        elif name in _FILL_IF_NONE and value is None:
            out[name] = _FILL_IF_NONE[name]
        elif name in ("vocab_size", "padded_vocab_size", "unpadded_vocab_size") and isinstance(value, int):
            out[name] = vocab
        elif name in _TOKEN_FIELDS and value is not None:
            out[name] = _TOKEN_FIELDS[name]
        elif name == "num_kv_shared_layers" and isinstance(value, int) and n_layers:
            # Layers that reuse earlier layers' K/V: keep the share (all of them for a drafter).
            out[name] = layers if value >= n_layers else min(value, max(layers - 1, 0))
        elif name in _LAYER_INDEX_FIELDS and isinstance(value, int):
            out[name] = min(value, max(layers - 1, 0))
        elif name in _CPU_FLAGS:
            out[name] = _CPU_FLAGS[name]
        elif name in per_layer:
            values = list(per_layer[name][:layers])
            if name in _SIZES and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                values = [min(v, _SIZES[name]) for v in values]  # per-layer widths (Gemma 3n's MLP)
            out[name] = values
        elif _is_layer_index_dict(value):
            # Per-layer overrides: kept for the layers that remain, their sizes shrunk like the rest.
            out[name] = {k: ({**v, **_shrink_dict(v, model_type, vocab, nested=True)} if isinstance(v, dict) else v)
                         for k, v in value.items() if int(k) < layers}
        elif isinstance(value, dict) and (value.get("model_type") or name.endswith("_config")) \
                and not any(w in name for w in _MEDIA_CONFIGS):
            # Only the changed fields: the rest is the sub-config's default, as the parent would build it.
            out[name] = _shrink_dict(value, model_type, vocab, nested=True)
    # Lists of layer indices (moe_layers, mlp_only_layers...) must name existing layers.
    for name in ("mlp_only_layers", "moe_layers", "full_attn_idxs", "hybrid_layer_ids"):
        value = d.get(name)
        if isinstance(value, list) and name not in per_layer and value and all(isinstance(v, int) for v in value):
            out[name] = [v for v in value if v < layers]
    _fit_ssm_heads(d, out)
    # DeepSeek-style MLA configs set head_dim to the rotary part of a key: keep that identity.
    if isinstance(d.get("head_dim"), int) and d.get("head_dim") == d.get("qk_rope_head_dim"):
        out["head_dim"] = out.get("qk_rope_head_dim", d["qk_rope_head_dim"])
    # MLA (a latent expanded per query head): the classes expect as many K/V heads as query heads.
    if d.get("kv_lora_rank") and d.get("num_key_value_heads") == d.get("num_attention_heads"):
        mha = True
    if mha and "num_key_value_heads" in d:
        out["num_key_value_heads"] = out.get("num_attention_heads", d.get("num_attention_heads"))
    for k, v in exceptions.items():
        if not k.startswith("_"):
            out[k] = _merge(out.get(k, d.get(k)) or {}, v) if isinstance(v, dict) else v
    return out


def _fit_ssm_heads(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Mamba-2 style mixers require heads x head_dim == expand x hidden (or the SSM width): recompute the heads."""
    get = lambda k: out.get(k, d.get(k))  # noqa: E731
    for heads, head_dim, expand, width in (("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_ssm"),
                                           ("num_heads", "head_dim", "expand", None),
                                           ("n_mamba_heads", "mamba_headdim", "mamba_expand", None)):
        if all(isinstance(get(k), int) for k in (heads, head_dim, expand)) and "hidden_size" in d:
            inner = get(width) if width and isinstance(get(width), int) else get(expand) * get("hidden_size")
            out[heads] = max(1, inner // get(head_dim))


@functools.lru_cache(maxsize=1)
def embedded_tokenizer_dir() -> Path:
    from kvscope.core.model.embedded import embedded_model_dir

    return embedded_model_dir()


@functools.lru_cache(maxsize=1)
def embedded_vocab_size() -> int:
    return int(json.loads((embedded_tokenizer_dir() / "config.json").read_text())["vocab_size"])


#: Sub-configs of multimodal models that are left at their defaults (the text model is what is built;
#: their validators tie their sizes to each other, and a build that needs them is refused anyway).
_MEDIA_CONFIGS = ("vision", "audio", "vq_", "image")

#: Parameter-path parts that mark a vision or audio encoder inside a built model.
_TOWER_MARKS = ("vision_tower", "vision_model", "image_encoder", "audio_tower", "audio_model", "audio_encoder",
                "embed_tokens_extend", "visual.", "vqmodel")


def _text_only_config(model_type: str, config):
    """The text sub-config when the registry's causal-LM class for a multimodal type is built from it
    (Llama4ForCausalLM takes a Llama4TextConfig): the text-only model, media towers left out."""
    import transformers

    cls = getattr(transformers, _mappings()["causal"][model_type], None)
    text = getattr(config, "text_config", None)
    wanted = getattr(cls, "config_class", None)
    if text is not None and wanted is not None and wanted is not type(config) and isinstance(text, wanted):
        return text
    return None


def _derived_fields(config_class) -> frozenset[str]:
    """Fields whose class default is None (the class fills them in from other fields)."""
    import dataclasses

    if not dataclasses.is_dataclass(config_class):
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(config_class) if f.default is None)


def _declared_fields(config_class) -> frozenset[str]:
    """Names a config class declares (dataclass fields and attribute_map aliases); empty if unknown."""
    import dataclasses

    if not dataclasses.is_dataclass(config_class):
        return frozenset()
    aliases = getattr(config_class, "attribute_map", {}) or {}
    return frozenset(f.name for f in dataclasses.fields(config_class)) | frozenset(aliases) | frozenset(aliases.values())


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def tiny_config(model_type: str):
    """The tiny text-only config of ``model_type`` (see the module docstring). Raises TinyBuildError."""
    from transformers import AutoConfig

    _quiet()
    reason = skip_reason(model_type)
    if reason:
        raise TinyBuildError(f"{model_type}: {reason}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            default = AutoConfig.for_model(model_type, **_DEFAULT_FIXES.get(model_type, {}))
        except Exception as exc:  # noqa: BLE001
            raise TinyBuildError(f"{model_type}: its config class refuses its own defaults "
                                 f"({type(exc).__name__}: {_first_line(exc)})") from exc
        text = _text_only_config(model_type, default)
        base = default if text is None else text
        overrides = _shrink_dict(base.to_dict(), model_type, embedded_vocab_size(), derived=_derived_fields(type(base)))
        fields = _declared_fields(type(base))
        if fields:
            # Widths the class sets itself in __post_init__ without declaring them (Zamba2's attention
            # width): passing them would overwrite what it derives from the shrunk sizes.
            exc = set(_EXCEPTIONS.get(model_type, {}))
            overrides = {k: v for k, v in overrides.items() if k in fields or k in exc or k not in _DERIVABLE}
        overrides.pop("model_type", None)
        overrides["dtype"] = "float32"
        try:
            if text is not None:
                return type(text)(**overrides)
            return AutoConfig.for_model(model_type, **overrides)
        except Exception as exc:  # noqa: BLE001
            raise TinyBuildError(f"{model_type}: the shrunk config is refused ({type(exc).__name__}: "
                                 f"{_first_line(exc)})") from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


# ------------------------------------------------------------------------------------------------
# Building folders


def build_tiny_model(model_type: str, seed: int = 0):
    """A tiny float32 model of ``model_type`` with seeded random weights, in eval mode. Raises TinyBuildError."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    if getattr(config, "auto_map", None):
        raise TinyBuildError(f"{model_type}: needs remote code (auto_map)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):  # shapes only: refuse towers and oversize builds before allocating
                model = _from_config(model_type, config)
            _check_text_only(model_type, config, model)
            torch.manual_seed(seed)
            model = _from_config(model_type, config)
            _check_loadable(model_type, model)
        except TinyBuildError:
            raise
        except ImportError as exc:
            raise TinyBuildError(f"{model_type}: needs a package that is not installed ({_first_line(exc)})") from exc
        except Exception as exc:  # noqa: BLE001
            raise TinyBuildError(f"{model_type}: AutoModelForCausalLM.from_config fails on the tiny config "
                                 f"({type(exc).__name__}: {_first_line(exc)})") from exc
    return model.eval()


def _from_config(model_type: str, config):
    """AutoModelForCausalLM.from_config, or the registry's class itself for a text config the auto class
    does not map (MllamaTextConfig -> MllamaForCausalLM)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        return getattr(transformers, _mappings()["causal"][model_type])._from_config(config, dtype=torch.float32)


def _check_loadable(model_type: str, model) -> None:
    """The saved config.json is the built model's config: AutoModelForCausalLM must know its type."""
    saved = getattr(model.config, "model_type", None)
    if saved not in _mappings()["causal"]:
        raise TinyBuildError(f"{model_type}: the text-only model ({type(model).__name__}) saves model_type {saved!r}, "
                             "which AutoModelForCausalLM does not know: a folder of it cannot be loaded")


def _check_text_only(model_type: str, config, model) -> None:
    towers = sorted({n.split(mark)[0] + mark.rstrip(".") for n, _ in model.named_parameters()
                     for mark in _TOWER_MARKS if mark in n})
    if towers:
        text = getattr(getattr(config, "text_config", None), "model_type", None)
        raise TinyBuildError(f"{model_type}: {type(model).__name__} needs a vision/audio encoder "
                             f"({', '.join(towers[:2])})" + (f"; its text model is {text}" if text else ""))
    n = sum(p.numel() for p in model.parameters())
    if n > 5_000_000:
        raise TinyBuildError(f"{model_type}: not tiny after shrinking ({n:,} parameters); a size field is unknown")


def build_tiny_folder(model_type: str, root: Path, seed: int = 0) -> Path:
    """Write a loadable tiny model folder ``root/model_type`` and return it. Raises TinyBuildError."""
    model = build_tiny_model(model_type, seed)
    folder = Path(root) / model_type
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(folder, safe_serialization=True)
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(folder, ignore_errors=True)
        raise TinyBuildError(f"{model_type}: save_pretrained fails ({type(exc).__name__}: {_first_line(exc)})") from exc
    src = embedded_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)
    return folder


@dataclass(frozen=True)
class BuildResult:
    model_type: str
    ok: bool
    reason: str = ""  # why not, when not ok
    parameters: int = 0
    seconds: float = 0.0
    forward: str = ""  # "" when 8 tokens run through the model with a DynamicCache, else the error


def forward_problem(model, tokens: int = 8) -> str:
    """Run ``tokens`` tokens then one more through ``model`` with a DynamicCache; "" or the error, one line."""
    import torch
    from transformers import DynamicCache

    ids = torch.randint(3, model.config.get_text_config().vocab_size, (1, tokens + 1),
                        generator=torch.Generator().manual_seed(0))
    try:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[:, :tokens], cache=cache, use_cache=True)
            model(input_ids=ids[:, tokens:], cache=cache, use_cache=True)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return ""


def survey(model_types: list[str] | None = None, forward: bool = False) -> list[BuildResult]:
    """Try to build every (or the given) decoder-only model type tiny, in memory. Deterministic.
    With ``forward``, also run a few tokens through each (``BuildResult.forward``: "" when that works)."""
    import time

    out = []
    for model_type in model_types or causal_lm_model_types():
        t = time.perf_counter()
        try:
            model = build_tiny_model(model_type)
        except TinyBuildError as exc:
            out.append(BuildResult(model_type, False, str(exc).removeprefix(f"{model_type}: "),
                                   seconds=time.perf_counter() - t))
            continue
        out.append(BuildResult(model_type, True, parameters=sum(p.numel() for p in model.parameters()),
                               seconds=time.perf_counter() - t, forward=forward_problem(model) if forward else ""))
    return out


if __name__ == "__main__":
    import sys

    results = survey(sys.argv[1:] or None, forward=True)
    for r in results:
        print(f"{r.model_type:28s} {'ok' if r.ok else 'NO':3s} {r.seconds:5.2f}s "
              f"{r.parameters if r.ok else r.reason}" + (f"  FORWARD FAILS: {r.forward}" if r.forward else ""))
    print(f"{sum(r.ok for r in results)} of {len(results)} decoder-only types build; "
          f"{len(registry_model_types())} in the registry")

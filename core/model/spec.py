"""ModelSpec: everything the predictor needs to know about a causal LM, as plain data, and its pure helpers.

A spec describes the architecture facts that decide memory (counts, widths, per-layer kinds, dtype). This module
reads no model source: its sources sit above it and build specs, ``kvscope.core.model.hf_config`` from an HF config (a preset,
a local ``config.json`` or folder, a hub id), ``kvscope.core.model.gguf`` from a GGUF header, and ``kvscope.core.model.sources.load_spec``
chooses between them. Here: ModelSpec and what transformers makes of a config as plain data (``ConfigView``,
``ModelFacts``), every spelling of a config's counts and their checks, the errors a spec or a setting raises,
dtypes, and the parsing and formatting of sizes and token counts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.core.base.errors import BAD_INPUT, REFUSED, KVScopeError
from kvscope.core.model.states import KVShape, LayerState, kv_shapes_from_json, states_from_json

ASSETS = Path(__file__).resolve().parents[2] / "assets"
PRESETS_DIR = ASSETS / "presets"
EMBEDDED_PRESET = "embedded"

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: A full-attention layer that also caches one indexer key per token (DeepSeek-V3.2 / GLM DSA sparse attention).
INDEXED_ATTENTION = "indexed_attention"
#: A layer that caches no K/V per token: linear attention, a state-space or convolution mixer, a layer
#: without attention or one that reuses another layer's K/V (transformers' LinearAttentionLayer and
#: DummyLayer). Its fixed-size states, if any, are in ``ModelSpec.layer_states`` (``kvscope.core.model.states``).
NO_KV = "no_kv"
#: Every kind of layer a spec names, as the cache sees it.
LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, INDEXED_ATTENTION, NO_KV)

#: Bytes per element of the dtypes a user can name. Keys are the spellings we accept; see DTYPE_ALIASES.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8": 1,
    "int8": 1,
    "int4": 0.5,
    "int2": 0.25,
}
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp8": "float8", "f8": "float8", "float8": "float8", "float8_e4m3fn": "float8",
    "int8": "int8", "i8": "int8", "q8": "int8",
    "int4": "int4", "i4": "int4", "q4": "int4",
    "int2": "int2", "i2": "int2", "q2": "int2",
}


class SpecError(KVScopeError, ValueError):
    """A model source or config that cannot be turned into a ModelSpec. The message is for the user."""

    category = BAD_INPUT


class SettingsError(SpecError):
    """A setting that is misspelled or does not fit the model. The message is for the user.

    (Here, below the attention modes and cache strategies that both raise it; ``kvscope.core.model.attention`` imports it.)"""

    category = REFUSED


def is_transformers_refusal(exc: BaseException) -> bool:
    """transformers' own validation of a config failed (huggingface_hub's StrictDataclassError, which is
    no ValueError: hidden size not a multiple of the heads, a field of the wrong type...)."""
    return any(cls.__name__ == "StrictDataclassError" for cls in type(exc).__mro__)


def transformers_refusal(exc: BaseException) -> SpecError:
    """One line for such a refusal, the same for ``calc`` (kvscope.core.model.hf) and ``run`` (kvscope.core.runtimes.transformers.loading); the
    caller puts the model's name first. transformers says it on two lines ("Class validation error for
    validator 'validate_architecture':" then "    ValueError: The hidden size (64) is not a multiple...")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = lines[-1] if lines else type(exc).__name__
    for prefix in ("ValueError: ", "TypeError: "):
        detail = detail.removeprefix(prefix)
    return SpecError(f"transformers refuses this config: {detail[:300]}")


def canonical_dtype(name: str) -> str:
    """Return the canonical dtype name for a user spelling (``fp16`` -> ``float16``); raise SpecError."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in DTYPE_ALIASES:
        raise SpecError(f"unknown dtype {name!r}; use one of fp32, fp16, bf16, fp8, int8, int4, int2")
    return DTYPE_ALIASES[key]


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype, e.g. ``dtype_bytes('bf16') == 2``; int4 is 0.5."""
    return DTYPE_BYTES[canonical_dtype(name)]


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts that decide memory, all integers (counts, dims) except names.

    ``layer_types`` has one entry per decoder layer (``full_attention``, ``sliding_attention``,
    ``indexed_attention`` or ``no_kv``), exactly as transformers' cache classes see it
    (``cache_utils.get_layer_types_and_kwargs``); ``layer_states`` what each layer holds beside K/V
    (None: nothing, as in every attention-only model).
    MLA fields are set only for latent-attention models (DeepSeek-V2/V3).
    """

    name: str
    model_type: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str
    num_parameters: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    display_name: str = ""
    buffer_bytes: int = 0  # the model's buffers (rotary tables...), in the dtype they are built in
    kv_bias: bool = False  # k_proj/v_proj carry a bias (Qwen2, attention_bias=True)
    indexer_head_dim: int | None = None  # DSA indexer keys cached per token in indexed layers
    supports_sdpa: bool = True  # False where transformers runs the model with eager only (Gemma 2)
    layer_states: tuple[LayerState, ...] | None = None  # per layer, beside K/V (kvscope.core.model.states)
    #: Per layer, the K/V transformers' cache really holds (kvscope.core.model.states.KVShape), where the layers differ from
    #: what the counts above give (MiMo-V2-Flash's sliding layers with twice the K/V heads, HY-V4's last layer
    #: without indexer keys); None: every layer as the counts say (kvscope.core.model.caches.kv_layout).
    layer_kv: tuple[KVShape, ...] | None = None
    #: KV Scope's MLA of a model that is not MLA (``kvscope.core.model.attention.MLA``): each full-attention layer caches
    #: a latent of this rank per token plus its basis once (``kvscope.core.runtimes.transformers.latent``); None: no latent.
    latent_rank: int | None = None
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == SLIDING_ATTENTION)

    @property
    def num_full_layers(self) -> int:
        """Layers that cache every token (full and indexed attention)."""
        return sum(1 for t in self.layer_types if t not in (SLIDING_ATTENTION, NO_KV))

    @property
    def num_state_layers(self) -> int:
        """Layers that are not plain K/V attention: no K/V (linear attention, state-space, convolution, shared
        K/V) or fixed-size states beside K/V (hybrid layers). transformers' QuantizedCache refuses them."""
        states = self.layer_states or (None,) * self.num_layers
        return sum(1 for t, st in zip(self.layer_types, states) if t == NO_KV or st and (st.elements or st.fixed_bytes))

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache K/V at all (the layers with K/V projections a head switch changes)."""
        return sum(1 for t in self.layer_types if t != NO_KV)

    @property
    def label(self) -> str:
        return self.display_name or self.name

    @property
    def intermediate_size(self) -> int:
        """The MLP width under every spelling configs use (4 x hidden when a config names none)."""
        value = _first(self.config, "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", "d_ff")
        usable = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and 0 < value <= MAX_COUNT)
        return int(value) if usable else 4 * self.hidden_size

    def kernel_for(self, attn_impl: str) -> str:
        """The attention implementation that would really run for a requested one."""
        return attn_impl if self.supports_sdpa or attn_impl == "eager" else "eager"

    def gqa_group_counts(self) -> list[int]:
        """KV-head counts reachable by GQA on this model: the divisors of the query-head count."""
        return [n for n in range(1, self.num_query_heads + 1) if self.num_query_heads % n == 0]


# --------------------------------------------------------------------------------------------
# Loading configs


def preset_names() -> list[str]:
    """Short, lower-case names of the bundled presets (``assets/presets/*.json``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def path_kind(path: Path, shown: str | None = None) -> str | None:
    """``"dir"``, ``"file"`` (a regular file), ``"other"`` (a FIFO, a device, a socket) or None (nothing
    there). A name the OS cannot even look up (too long, not encodable) is a SpecError, not a crash."""
    try:
        if path.is_dir():
            return "dir"
        if path.is_file():
            return "file"
        return "other" if path.exists() else None
    except (OSError, ValueError) as exc:
        what = getattr(exc, "strerror", None) or str(exc)
        raise SpecError(f"cannot use {shown or str(path)!r} as a model: {what}") from None


EMPTY_MODEL_NAME = ("empty model name; give a preset name, a model folder or config.json, a .gguf file, a hub id "
                    "(org/name), or embedded")


def check_model_name(source: Any) -> str:
    """The model source stripped; an empty one is refused the same way by ``calc``, ``run`` and the window."""
    src = str(source if source is not None else "").strip()
    if not src:
        raise SpecError(EMPTY_MODEL_NAME)
    return src


# --------------------------------------------------------------------------------------------
# Deriving the spec


def _first(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


#: More decoder layers than any published model has by an order of magnitude. A config beyond it is
#: a typo; refusing it matters because the exact parameter count builds every layer (on the meta
#: device, ~4 ms each), so 10**12 layers would hang the calculator instead of answering.
MAX_LAYERS = 4096

#: The largest count or width a config, a setting or a command line may give (heads, hidden size,
#: vocabulary, positions, window, batch...): 2**31 - 1, past every real model by orders of magnitude
#: and still inside what torch and transformers index with. Beyond it a value is a typo or an attack
#: (10**400 overflowed float conversions; 2**70 overflowed torch's int64).
MAX_COUNT = 2**31 - 1
#: The largest memory size a command line may give: 16 EiB, what a 64-bit address space can name.
MAX_SIZE = 2**64

#: Where configs name the model's trained maximum of positions (2,048 assumed when none does).
MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len",
                     "context_length", "model_max_length")

# The spellings of the counts, first the normalised name, then every field the decoder-only config classes
# of transformers 5.24 alias it to (their ``attribute_map``: DBRX and MPT say n_layers/n_heads/d_model,
# XGLM num_layers/attention_heads, TrOCR decoder_layers/decoder_attention_heads...); encoder_* aliases are
# left out (an encoder's count is not the decoder's).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                    "decoder_num_hidden_layers")
#: Per-layer lists whose length is the layer count where a config stores no count (Nemotron-H's
#: ``layers_block_type``, which its attribute_map names ``layer_types``).
LAYER_LIST_KEYS = ("layer_types", "layers_block_type")
HEAD_COUNT_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads",
                   "decoder_attention_heads", "decoder_num_attention_heads")
#: head_dim and the fields config classes alias it to (Zamba: attention_head_dim, JetMoE: kv_channels, T5-style d_kv).
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "kv_channels", "d_kv")
HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd", "d_model", "emb_dim", "embed_dim", "hidden_dim", "dim")


def _layer_count(cfg: dict[str, Any]) -> Any:
    count = _first(cfg, *LAYER_COUNT_KEYS)
    if count is None:
        listed = _first(cfg, *LAYER_LIST_KEYS)
        count = len(listed) if isinstance(listed, list) and listed else None
    return count


def declared_max_positions(spec: "ModelSpec") -> int | None:
    """The model's maximum of positions when its config names one; None when 2,048 was only assumed."""
    return spec.max_position_embeddings if _first(spec.config, *MAX_POSITION_KEYS) is not None else None


def shown_count(n: int) -> str:
    """``1,000,000`` for a count; a number too long to print usefully is described by its length."""
    text = str(n)
    return f"{n:,}" if len(text) <= 24 else f"a {len(text.lstrip('-'))}-digit number"


def _positive_int(value: Any, what: str, name: str, limit: int | None = MAX_COUNT) -> int:
    if value is None:
        raise SpecError(f"{name}: config is missing the {what}")
    # NaN and infinity parse from JSON ("NaN", "Infinity") and cannot become ints: say so, not crash.
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or value != int(value)):
        raise SpecError(f"{name}: {what} must be a whole number, got {value!r:.40}")
    if int(value) <= 0:
        raise SpecError(f"{name}: {what} must be positive, got {shown_count(int(value))}")
    if limit is not None and int(value) > limit:
        raise SpecError(f"{name}: {what} of {shown_count(int(value))} is implausible (more than {limit:,})")
    return int(value)


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Gemma 3, Llava...) keep the language model under ``text_config``."""
    text = raw.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in raw:
        merged = dict(text)
        merged.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
        merged.setdefault("model_type", f"{raw.get('model_type', 'unknown')}_text")
        return merged
    return raw


def _kv_heads_named(cfg: dict[str, Any]) -> Any:
    return _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "kv_n_heads")


def _kv_heads(cfg: dict[str, Any], n_heads: int) -> Any:
    """KV heads under every spelling configs use."""
    explicit = _kv_heads_named(cfg)
    if cfg.get("model_type") == "falcon":
        # Falcon: new_decoder_architecture uses num_kv_heads; otherwise multi_query means one KV head.
        if cfg.get("new_decoder_architecture"):
            return cfg.get("num_kv_heads") or n_heads  # checked by the caller (_positive_int): NaN, "two"...
        return 1 if cfg.get("multi_query", True) else n_heads
    if explicit is not None:
        return explicit
    if cfg.get("multi_query") is True:  # GPT-BigCode/StarCoder
        return 1
    return n_heads


@dataclass(frozen=True)
class ModelFacts:
    """What a meta-device build of a config tells: exact parameter count, the bytes of the model's
    buffers (rotary ``inv_freq`` and the like, which stay in the dtype they are built in: float32
    for rotary tables, also when the weights load in fp16), and whether K/V projections carry a bias."""

    parameters: int
    buffer_bytes: int = 0
    kv_bias: bool = False
    supports_sdpa: bool = True


@dataclass(frozen=True)
class ConfigView:
    """What transformers makes of a config dict, the only part of a spec that needs it: whether it
    knows the model type, the per-layer attention types its cache builds, the sliding window its
    config object fills in, and the facts of a meta-device build (None where it cannot build one).

    Found once per config and transformers version, with torch and transformers; then read without
    them, from the preset (``_kvscope.view``, written by ``scripts/refresh_presets.py``) or from the
    on-disk memo. So ``calc`` of a preset or of a config seen before, and the window, never import
    the ML stack."""

    known: bool
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    facts: ModelFacts | None = None
    states: tuple[LayerState, ...] | None = None  # per layer beside K/V; None: no layer holds any
    #: Whether the model ties its output head to the embeddings, as transformers reads it, for a config.json
    #: that does not say (its class's default, where transformers' tying reads a missing one as False); None
    #: where config.json says.
    tied: bool | None = None
    kv_shapes: tuple[KVShape, ...] | None = None  # per layer, where the counts' formula does not hold (ModelSpec.layer_kv)

    def to_json(self) -> dict[str, Any]:
        f = self.facts
        return {"transformers": transformers_version(), "known": self.known,
                "layer_types": list(self.layer_types) if self.layer_types is not None else None,
                "sliding_window": self.sliding_window,
                "facts": None if f is None else [f.parameters, f.buffer_bytes, int(f.kv_bias), int(f.supports_sdpa)],
                "states": None if self.states is None else [s.to_json() for s in self.states], "tied": self.tied,
                "kv_shapes": None if self.kv_shapes is None else [list(s) for s in self.kv_shapes]}

    @classmethod
    def from_json(cls, data: Any) -> "ConfigView | None":
        """The view stored by ``to_json`` under this transformers version, or None (stale or damaged:
        memo files and presets are read as untrusted input)."""
        if not isinstance(data, dict) or data.get("transformers") != transformers_version():
            return None
        types, window, facts = data.get("layer_types"), data.get("sliding_window"), data.get("facts")
        kinds = LAYER_KINDS
        states = states_from_json(data.get("states"))  # absent (a view stored before states were): none
        if states is False or states is not None and (types is None or len(states) != len(types)) \
                or not (data.get("tied") is None or isinstance(data.get("tied"), bool)):
            return None
        shapes = kv_shapes_from_json(data.get("kv_shapes"))  # absent (a preset's view stored before): none
        if shapes is False or shapes is not None and (types is None or len(shapes) != len(types)):
            return None
        if not isinstance(data.get("known"), bool) \
                or not (types is None or isinstance(types, list) and all(t in kinds for t in types)) \
                or not (window is None or is_plain_int(window) and window > 0) \
                or not (facts is None or isinstance(facts, list) and len(facts) == 4
                        and all(is_plain_int(v) and v >= 0 for v in facts)):
            return None
        return cls(data["known"], None if types is None else tuple(types), window,
                   None if facts is None else ModelFacts(facts[0], facts[1], bool(facts[2]), bool(facts[3])), states,
                   data.get("tied"), shapes)


def is_plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.lru_cache(maxsize=1)
def transformers_version() -> str:
    """The installed transformers' version, read from its metadata (without importing it)."""
    import importlib.util

    # Its dist-info folder's name, beside the package: importlib.metadata alone costs the window 0.1-0.25 s of its
    # start-up (its imports and a walk of every installed distribution).
    found = importlib.util.find_spec("transformers")
    if found is not None and found.origin:
        folders = sorted(Path(found.origin).parent.parent.glob("transformers-*.dist-info"))
        if len(folders) == 1:
            return folders[0].name[len("transformers-"):-len(".dist-info")]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "none"


def _cache_dir() -> Path:
    """Per-user cache folder (``$KVSCOPE_CACHE`` or ``~/.cache/kvscope``)."""
    import os

    return Path(os.environ.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope")


def _require_layer_count(cfg: dict[str, Any], name: str) -> None:
    if not any(k in cfg for k in LAYER_COUNT_KEYS) and _layer_count(cfg) is None:
        raise SpecError(f"{name}: config has no layer count (num_hidden_layers); is it a causal language model?")


def check_config(cfg: dict[str, Any], name: str = "model") -> None:
    """The plausibility checks of ``spec_from_config`` alone (counts and widths: whole, positive, not
    absurd), without transformers and without building anything. ``calc`` refuses a config through them
    (spec_from_config), and ``run`` through the same function before transformers builds or loads
    anything: kvscope.core.runtimes.transformers.loading calls it on a folder's config.json and on the config transformers read."""
    cfg = _text_config(cfg)
    _require_layer_count(cfg, name)
    _checked_counts(cfg, name)


def _checked_counts(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """Every count and width of a (text) config as a checked int; SpecError naming the first bad one.

    A config that names no attention heads at all (Mamba, RWKV: no layer caches K/V) gets 1 head of the
    hidden size as a placeholder and ``heads_missing``; ``spec_from_config`` refuses it unless transformers
    says no layer caches K/V (the view's layer types)."""
    layers = _positive_int(_layer_count(cfg), "number of layers", name, limit=None)
    if layers > MAX_LAYERS:
        raise SpecError(f"{name}: {shown_count(layers)} layers is implausible (more than {MAX_LAYERS:,}); "
                        "check num_hidden_layers")
    heads_raw = _first(cfg, *HEAD_COUNT_KEYS)
    heads_missing = heads_raw is None and _kv_heads_named(cfg) is None
    heads = 1 if heads_missing else _positive_int(heads_raw, "number of attention heads", name)
    hidden = _positive_int(_first(cfg, *HIDDEN_SIZE_KEYS), "hidden size", name)
    kv_heads = _positive_int(_kv_heads(cfg, heads), "number of KV heads", name)
    if heads % kv_heads:
        raise SpecError(f"{name}: {kv_heads} KV heads do not divide {heads} query heads")
    head_dim_raw = _first(cfg, *HEAD_DIM_KEYS)
    head_dim = _positive_int(head_dim_raw, "head_dim", name) if head_dim_raw is not None else hidden // heads
    if heads_missing and head_dim_raw is None:
        head_dim = hidden
    if head_dim <= 0:
        raise SpecError(f"{name}: hidden size {hidden} is smaller than the {heads} heads")
    vocab = _positive_int(_first(cfg, "vocab_size", "padded_vocab_size"), "vocab_size", name)
    max_pos = _first(cfg, *MAX_POSITION_KEYS)
    # None: the config names no maximum (2048 assumed); 0 or false are refused, not read as "none given".
    max_pos = _positive_int(2048 if max_pos is None else max_pos, "max_position_embeddings", name)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2 declares a window but does not use it
        window = None
    window = _positive_int(window, "sliding_window", name) if window else None

    kv_lora_rank = cfg.get("kv_lora_rank")
    mla = {}
    if kv_lora_rank:
        # Expanded per-head keys are nope + rope wide (DeepseekV3 sets config.head_dim to the rope
        # part only, which is not the key width); values are v_head_dim wide.
        q_lora_rank = cfg.get("q_lora_rank")
        mla = dict(
            kv_lora_rank=_positive_int(kv_lora_rank, "kv_lora_rank", name),
            q_lora_rank=_positive_int(q_lora_rank, "q_lora_rank", name) if q_lora_rank else None,
            qk_rope_head_dim=_positive_int(cfg.get("qk_rope_head_dim", 64), "qk_rope_head_dim", name),
            qk_nope_head_dim=_positive_int(cfg.get("qk_nope_head_dim", 128), "qk_nope_head_dim", name),
            v_head_dim=_positive_int(cfg.get("v_head_dim", 128), "v_head_dim", name),
        )
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    indexer = _first(cfg, "index_head_dim", "indexer_head_dim")
    indexer = _positive_int(indexer, "index_head_dim", name) if indexer is not None else None
    return dict(layers=layers, heads=heads, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim, vocab=vocab,
                max_pos=max_pos, window=window, mla=mla, indexer=indexer, heads_missing=heads_missing)



def human_bytes(n: float | None, binary: bool = True) -> str:
    """Format bytes for people: ``536870912 -> '512.0 MiB'``; None -> 'n/a'."""
    if n is None:
        return "n/a"
    step, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else (1000.0, ["B", "kB", "MB", "GB", "TB", "PB"])
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in units:
        if value < step or unit == units[-1]:
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= step
    return f"{n} B"  # pragma: no cover


def parse_size(text: str | int) -> int:
    """Parse a memory size: ``'24GiB'``, ``'1.5 GB'``, ``'64MiB'``, ``'80g'`` or plain bytes. Raises SpecError."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().replace(" ", "").replace("_", "").replace(",", "")
        units = {
            "": 1, "b": 1,
            "k": 1024, "kib": 1024, "kb": 1000,
            "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
            "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
            "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
        }
        i = len(s)
        while i > 0 and s[i - 1].isalpha():
            i -= 1
        number, unit = s[:i], s[i:].lower()
        if unit not in units or not number:
            raise SpecError(f"cannot read size {text!r}; write e.g. 24GiB, 1.5GB, 512MiB or a number of bytes")
        try:
            f = float(number)
        except ValueError as exc:
            raise SpecError(f"cannot read size {text!r}; write e.g. 24GiB, 1.5GB, 512MiB or a number of bytes") from exc
        if not math.isfinite(f):
            raise SpecError(f"size {text!r} is not a finite number")
        value = int(f * units[unit])
    if value <= 0:
        raise SpecError(f"size must be positive, got {text!r}")
    if value > MAX_SIZE:  # 1e307 bytes overflowed the calculator's float arithmetic
        raise SpecError(f"size {str(text)[:40]!r} is implausible (more than 16 EiB)")
    return value


def parse_tokens(text: str) -> int:
    """Parse a token count: ``'4096'``, ``'4k'`` (=4096), ``'128K'``, ``'1m'``. Raises SpecError."""
    s = str(text).strip().lower().replace("_", "").replace(",", "")
    mult = 1
    if s.endswith("k"):
        mult, s = 1024, s[:-1]
    elif s.endswith("m"):
        mult, s = 1024 * 1024, s[:-1]
    try:
        value = float(s) * mult
    except ValueError as exc:
        raise SpecError(f"cannot read token count {text!r}; write e.g. 4096, 4k or 128K") from exc
    if not math.isfinite(value) or value != int(value) or value <= 0:
        raise SpecError(f"token count must be a positive whole number, got {text!r}")
    if value > MAX_COUNT:  # a context of 1e307 tokens overflowed the calculator's float arithmetic
        raise SpecError(f"token count {str(text)[:40]!r} is implausible (more than {MAX_COUNT:,})")
    return int(value)

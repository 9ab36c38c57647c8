"""ModelSpec: everything the predictor needs to know about a causal LM, derived from its HF config.

A spec comes from a preset name (``llama-3-8b``), a local ``config.json`` or model folder, or a hub
id (config only; needs network or a warm Hugging Face cache). Nothing here allocates weights: the
parameter count is taken from a model built on the ``meta`` device.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.hf import ensure_transformers

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PRESETS_DIR = ASSETS / "presets"
EMBEDDED_PRESET = "embedded"

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: A full-attention layer that also caches one indexer key per token (DeepSeek-V3.2 / GLM DSA sparse attention).
INDEXED_ATTENTION = "indexed_attention"

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


class SpecError(ValueError):
    """A model source or config that cannot be turned into a ModelSpec. The message is for the user."""


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

    ``layer_types`` has one entry per decoder layer (``full_attention`` or ``sliding_attention``),
    exactly as transformers' cache classes see it (``cache_utils.get_layer_types_and_kwargs``).
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
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == SLIDING_ATTENTION)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def label(self) -> str:
        return self.display_name or self.name

    @property
    def intermediate_size(self) -> int:
        """The MLP width under every spelling configs use (4 x hidden when a config names none)."""
        value = _first(self.config, "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", "d_ff")
        return int(value) if isinstance(value, (int, float)) and value > 0 else 4 * self.hidden_size

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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def load_config_dict(source: str) -> tuple[str, dict[str, Any]]:
    """Resolve a model source to ``(name, config dict)``.

    ``source`` is a preset name (case-insensitive), a path to a ``config.json`` or to a folder that
    holds one, or a hub id (``org/name``; config only, fetched with huggingface_hub).
    """
    src = str(source).strip()
    if not src:
        raise SpecError("empty model name")
    preset = PRESETS_DIR / f"{src.lower()}.json"
    if "/" not in src and "\\" not in src and preset.is_file():
        return src.lower(), _read_json(preset)
    path = Path(src).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise SpecError(f"{path} has no config.json; a model folder needs one")
        return path.name, _read_json(cfg)
    if path.is_file():
        return path.stem if path.name != "config.json" else path.parent.name, _read_json(path)
    if path.suffix == ".json" or src.startswith((".", "/", "~")):
        raise SpecError(f"no such file: {src}")
    if src.count("/") == 1 and all(src.split("/")):
        return src, _fetch_hub_config(src)
    raise SpecError(
        f"unknown model {src!r}: not a preset ({', '.join(preset_names())}), a local config/folder, or a hub id"
    )


def _fetch_hub_config(repo_id: str) -> dict[str, Any]:
    """Download only config.json of a hub model (uses the local HF cache when offline)."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a dependency
        raise SpecError("huggingface_hub is not installed; cannot fetch hub configs") from exc
    try:
        path = hf_hub_download(repo_id, "config.json")
    except GatedRepoError as exc:
        raise SpecError(f"{repo_id} is gated: accept its licence on the hub and log in (hf auth login)") from exc
    except RepositoryNotFoundError as exc:
        raise SpecError(f"{repo_id}: no such model on the hub (or it is private)") from exc
    except EntryNotFoundError as exc:
        raise SpecError(f"{repo_id} has no config.json") from exc
    except LocalEntryNotFoundError as exc:
        raise SpecError(f"{repo_id}: no network and not in the local Hugging Face cache") from exc
    except Exception as exc:  # network errors of every flavour
        raise SpecError(f"{repo_id}: could not fetch config ({type(exc).__name__}: {exc})") from exc
    return _read_json(Path(path))


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


def _positive_int(value: Any, what: str, name: str) -> int:
    if value is None:
        raise SpecError(f"{name}: config is missing the {what}")
    # NaN and infinity parse from JSON ("NaN", "Infinity") and cannot become ints: say so, not crash.
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or value != int(value)):
        raise SpecError(f"{name}: {what} must be a whole number, got {value!r}")
    if int(value) <= 0:
        raise SpecError(f"{name}: {what} must be positive, got {value!r}")
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


def _kv_heads(cfg: dict[str, Any], n_heads: int) -> int:
    """KV heads under every spelling configs use."""
    explicit = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "kv_n_heads")
    if cfg.get("model_type") == "falcon":
        # Falcon: new_decoder_architecture uses num_kv_heads; otherwise multi_query means one KV head.
        if cfg.get("new_decoder_architecture"):
            return int(cfg.get("num_kv_heads") or n_heads)
        return 1 if cfg.get("multi_query", True) else n_heads
    if explicit is not None:
        return int(explicit)
    if cfg.get("multi_query") is True:  # GPT-BigCode/StarCoder
        return 1
    return n_heads


def _build_hf_config(cfg: dict[str, Any]):
    """A transformers config object for ``cfg``, or None for model types transformers does not know."""
    ensure_transformers()
    from transformers import AutoConfig

    model_type = cfg.get("model_type")
    if not model_type:
        return None
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "_kvscope", "auto_map")}
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class ModelFacts:
    """What a meta-device build of a config tells: exact parameter count, the bytes of the model's
    buffers (rotary ``inv_freq`` and the like, which stay in the dtype they are built in: float32
    for rotary tables, also when the weights load in fp16), and whether K/V projections carry a bias."""

    parameters: int
    buffer_bytes: int = 0
    kv_bias: bool = False
    supports_sdpa: bool = True


@functools.lru_cache(maxsize=64)
def _meta_facts(config_json: str) -> ModelFacts | None:
    """Facts of the model a config describes, built on the meta device (no memory)."""
    import torch

    ensure_transformers()
    from transformers import AutoModelForCausalLM

    hf_config = _build_hf_config(json.loads(config_json))
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


def _cache_dir() -> Path:
    """Per-user cache folder (``$KVSCOPE_CACHE`` or ``~/.cache/kvscope``)."""
    import os

    return Path(os.environ.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope")


def model_facts(cfg: dict[str, Any]) -> ModelFacts | None:
    """Exact facts from a meta-device build; memoised on disk, as DeepSeek-V3 takes seconds."""
    key = json.dumps({k: v for k, v in cfg.items() if k != "_kvscope"}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    store = _cache_dir() / "model_facts.json"
    try:
        known = json.loads(store.read_text()) if store.is_file() else {}
        entry = known.get(digest) if isinstance(known, dict) else None
        if isinstance(entry, list) and len(entry) == 4 and all(isinstance(v, int) for v in entry):
            return ModelFacts(entry[0], entry[1], bool(entry[2]), bool(entry[3]))
    except (OSError, ValueError):
        known = {}
    import os

    facts = _meta_facts(key)
    if facts is not None:
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            known = known if isinstance(known, dict) else {}
            known[digest] = [facts.parameters, facts.buffer_bytes, int(facts.kv_bias), int(facts.supports_sdpa)]
            tmp = store.with_suffix(f".{os.getpid()}.tmp")  # unique: processes may race
            tmp.write_text(json.dumps(known))
            tmp.replace(store)
        except OSError:
            pass
    return facts


def parameter_count(cfg: dict[str, Any]) -> int | None:
    """Exact parameter count from a meta-device build (memoised on disk)."""
    facts = model_facts(cfg)
    return None if facts is None else facts.parameters


def _estimate_parameters(cfg: dict[str, Any], layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                         vocab: int, tied: bool) -> int:
    """Llama-shaped estimate for model types transformers cannot build (used only then)."""
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter
    embed = vocab * hidden * (1 if tied else 2)
    return layers * (attn + mlp + 2 * hidden) + embed + hidden


def _layer_types(cfg: dict[str, Any], hf_config, layers: int, window: int | None) -> tuple[str, ...]:
    """Per-layer attention types exactly as transformers' cache builds them."""
    if hf_config is not None:
        try:
            from transformers.cache_utils import get_layer_types_and_kwargs

            types, _ = get_layer_types_and_kwargs(hf_config.get_text_config(decoder=True))
            return tuple(SLIDING_ATTENTION if t in ("sliding_attention", "chunked_attention")
                         else INDEXED_ATTENTION if t == INDEXED_ATTENTION else FULL_ATTENTION
                         for t in types)
        except Exception:
            pass
    declared = cfg.get("layer_types")
    if isinstance(declared, list) and len(declared) == layers:
        return tuple(SLIDING_ATTENTION if "sliding" in str(t) else FULL_ATTENTION for t in declared)
    return tuple([SLIDING_ATTENTION if window else FULL_ATTENTION] * layers)


def spec_from_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Derive a ModelSpec from a config dict. Raises SpecError with a specific message on bad fields."""
    meta = cfg.get("_kvscope") if isinstance(cfg.get("_kvscope"), dict) else {}
    cfg = _text_config(cfg)
    if "num_hidden_layers" not in cfg and "n_layer" not in cfg and "num_layers" not in cfg:
        raise SpecError(f"{name}: config has no layer count (num_hidden_layers); is it a causal language model?")
    archs = cfg.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        raise SpecError(f"{name}: {', '.join(archs)} is not a causal language model (no KV cache to generate with)")

    layers = _positive_int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers"), "number of layers", name)
    if layers > MAX_LAYERS:
        raise SpecError(f"{name}: {layers:,} layers is implausible (more than {MAX_LAYERS:,}); check num_hidden_layers")
    heads = _positive_int(_first(cfg, "num_attention_heads", "n_head", "num_heads"), "number of attention heads", name)
    hidden = _positive_int(_first(cfg, "hidden_size", "n_embd", "d_model"), "hidden size", name)
    kv_heads = _positive_int(_kv_heads(cfg, heads), "number of KV heads", name)
    if heads % kv_heads:
        raise SpecError(f"{name}: {kv_heads} KV heads do not divide {heads} query heads")
    head_dim_raw = cfg.get("head_dim")
    head_dim = _positive_int(head_dim_raw, "head_dim", name) if head_dim_raw is not None else hidden // heads
    if head_dim <= 0:
        raise SpecError(f"{name}: hidden size {hidden} is smaller than the {heads} heads")
    vocab = _positive_int(_first(cfg, "vocab_size", "padded_vocab_size"), "vocab_size", name)
    max_pos = _first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length") or 2048
    max_pos = _positive_int(max_pos, "max_position_embeddings", name)
    tied = bool(cfg.get("tie_word_embeddings", True))
    dtype_name = str(_first(cfg, "torch_dtype", "dtype") or "float32")
    try:
        dtype = canonical_dtype(dtype_name)
    except SpecError:
        dtype = "float32"

    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2 declares a window but does not use it
        window = None
    window = _positive_int(window, "sliding_window", name) if window else None

    kv_lora_rank = cfg.get("kv_lora_rank")
    mla = {}
    if kv_lora_rank:
        # Expanded per-head keys are nope + rope wide (DeepseekV3 sets config.head_dim to the rope
        # part only, which is not the key width); values are v_head_dim wide.
        head_dim = int(cfg.get("qk_nope_head_dim", 128)) + int(cfg.get("qk_rope_head_dim", 64))
        mla = dict(
            kv_lora_rank=_positive_int(kv_lora_rank, "kv_lora_rank", name),
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_rope_head_dim=_positive_int(cfg.get("qk_rope_head_dim", 64), "qk_rope_head_dim", name),
            qk_nope_head_dim=_positive_int(cfg.get("qk_nope_head_dim", 128), "qk_nope_head_dim", name),
            v_head_dim=_positive_int(cfg.get("v_head_dim", 128), "v_head_dim", name),
        )

    hf_config = _build_hf_config(cfg)
    types = _layer_types(cfg, hf_config, layers, window)
    if SLIDING_ATTENTION in types and window is None and hf_config is not None:
        window = getattr(hf_config, "sliding_window", None)
    if SLIDING_ATTENTION not in types:
        window = None
    facts = model_facts(cfg) if hf_config is not None else None
    if facts is None:
        n_params = _estimate_parameters(cfg, layers, hidden, heads, kv_heads, head_dim, vocab, tied)
        buffer_bytes, kv_bias, supports_sdpa = 0, bool(cfg.get("attention_bias")), True
    else:
        n_params, buffer_bytes, kv_bias = facts.parameters, facts.buffer_bytes, facts.kv_bias
        supports_sdpa = facts.supports_sdpa

    return ModelSpec(
        name=name,
        model_type=str(cfg.get("model_type") or "unknown"),
        num_layers=layers,
        num_query_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=max_pos,
        dtype=dtype,
        num_parameters=int(n_params),
        buffer_bytes=int(buffer_bytes),
        kv_bias=kv_bias,
        supports_sdpa=supports_sdpa,
        indexer_head_dim=_first(cfg, "index_head_dim", "indexer_head_dim") if INDEXED_ATTENTION in types else None,
        layer_types=types,
        sliding_window=window,
        display_name=str(meta.get("display_name", "")) if meta else "",
        config=cfg,
        **mla,
    )


def load_spec(source: str = EMBEDDED_PRESET) -> ModelSpec:
    """ModelSpec for a preset name, local config/folder, or hub id. Raises SpecError."""
    name, cfg = load_config_dict(source)
    return spec_from_config(cfg, name)


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
    return int(value)

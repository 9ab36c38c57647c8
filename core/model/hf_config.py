"""HF configs as a model source: config.json from a preset, a folder, a file or the hub, turned into a ModelSpec.

``read_config_json`` is the one reader of a config file (bounded, untrusted input); ``load_config_dict`` resolves
a source to a config dict; ``config_view`` is what transformers makes of it, shipped with a preset, memoised on
disk, or found once by ``kvscope.core.model.hf.compute_view`` (which alone imports transformers and torch, when called);
``spec_from_config`` builds the ModelSpec from the counts (``kvscope.core.model.spec``) and the view. ``kvscope.core.model.gguf`` is the
other source; ``kvscope.core.model.sources.load_spec`` chooses between them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from kvscope.core.base.regular_file import read_at_most
from kvscope.core.model.hf import compute_view
from kvscope.core.model.spec import (FULL_ATTENTION, INDEXED_ATTENTION, MAX_COUNT, NO_KV, PRESETS_DIR,
                                     SLIDING_ATTENTION, ConfigView, ModelFacts, ModelSpec, SpecError, _cache_dir,
                                     _checked_counts, _first, _require_layer_count, _text_config, canonical_dtype,
                                     check_model_name, human_bytes, is_plain_int, path_kind, preset_names,
                                     transformers_version)

# --------------------------------------------------------------------------------------------
# Reading a config file

#: Deeper than any model config nests (text_config > rope_scaling > ... is 3 or 4). A config nested
#: thousands deep is not a config, and would exhaust Python's recursion in json or in transformers.
MAX_JSON_DEPTH = 64


def _json_depth_exceeds(data: Any, limit: int) -> bool:
    """Whether ``data`` nests containers more than ``limit`` deep (iterative: no recursion to exhaust)."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


#: The largest config.json read: a model's is a few KiB (a vision model's with label maps, a few hundred);
#: one larger is refused by its size, before a byte of it is read.
MAX_CONFIG_BYTES = 8 << 20
#: The longest integer a config may hold (a 64-bit number has 20 digits). Python refuses to convert one
#: of more than 4,300 digits with a ValueError; this says so in one line, whatever the length.
MAX_CONFIG_INT_DIGITS = 100


def _config_int(text: str) -> int:
    if len(text) > MAX_CONFIG_INT_DIGITS:
        raise _HugeInteger(len(text.lstrip("-")))
    return int(text)


class _HugeInteger(Exception):
    pass


def read_config_json(path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """A config file as a dict: the one reader for ``calc``, ``run``, hub configs and the installed-model
    scan. Anything else is a SpecError, in one line: not a regular file (a FIFO or a device is never
    opened), more than ``max_bytes`` bytes (refused by its size, unread), not UTF-8, not JSON, not an
    object, nested absurdly deep, or holding an integer of more than ``MAX_CONFIG_INT_DIGITS`` digits."""
    kind = path_kind(path)
    if kind == "other":  # a FIFO would block the read forever; a device has no end
        raise SpecError(f"{path} is not a regular file")
    if kind == "dir":
        raise SpecError(f"{path} is a folder, not a JSON file")
    try:
        size = os.stat(path).st_size
        if size > max_bytes:
            raise SpecError(f"{path} is {human_bytes(size)} ({size:,} bytes); a config.json is at most "
                            f"{human_bytes(max_bytes)} here, so it was not read")
        # Non-blocking, and checked again once open: a FIFO put there since the look above cannot hold us.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SpecError(f"{path} is not a regular file")
            raw = read_at_most(fd, max_bytes)
        finally:
            os.close(fd)
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) > max_bytes:  # it grew since its size was looked at
        raise SpecError(f"{path} is more than {human_bytes(max_bytes)}; a config.json is at most that here")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                        "a config.json is UTF-8 JSON") from None
    try:
        data = json.loads(text, parse_int=_config_int)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    except _HugeInteger as exc:
        raise SpecError(f"{path} holds an integer of {exc.args[0]:,} digits; a config's numbers have at most "
                        f"{MAX_CONFIG_INT_DIGITS}") from None
    except RecursionError:
        raise SpecError(f"{path} nests JSON more than {MAX_JSON_DEPTH} levels deep; it is not a model config") from None
    except ValueError as exc:  # anything else json's conversions refuse: one line, never an internal error
        raise SpecError(f"{path} is not a usable JSON file ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a JSON object, found {type(data).__name__}")
    if _json_depth_exceeds(data, MAX_JSON_DEPTH):
        raise SpecError(f"{path} nests JSON more than {MAX_JSON_DEPTH} levels deep; it is not a model config")
    return data



def load_config_dict(source: str) -> tuple[str, dict[str, Any]]:
    """Resolve a model source to ``(name, config dict)``.

    ``source`` is a preset name (case-insensitive), a path to a ``config.json`` or to a folder that
    holds one, or a hub id (``org/name``; config only, fetched with huggingface_hub).
    """
    src = check_model_name(source)
    preset = PRESETS_DIR / f"{src.lower()}.json"
    if "/" not in src and "\\" not in src and path_kind(preset, src) == "file":
        return src.lower(), read_config_json(preset)
    path = Path(src).expanduser()
    kind = path_kind(path, src)
    if kind == "dir":
        cfg = path / "config.json"
        if path_kind(cfg) is None:
            raise SpecError(f"{path} has no config.json; a model folder needs one")
        return path.name, read_config_json(cfg)  # refuses a config.json that is a folder, a FIFO...
    if kind == "file":
        return path.stem if path.name != "config.json" else path.parent.name, read_config_json(path)
    if kind == "other":
        raise SpecError(f"{src} is not a regular file")
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
        from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)
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
    return read_config_json(Path(path))



# --------------------------------------------------------------------------------------------
# What transformers makes of a config, memoised

def config_key(cfg: dict[str, Any]) -> str:
    """The canonical JSON of a config (without KV Scope's own ``_kvscope`` notes): what a view is of."""
    return json.dumps({k: v for k, v in cfg.items() if k != "_kvscope"}, sort_keys=True, default=str)


#: What a memoised view means: bumped when ``kvscope.core.model.hf.compute_view`` learns more of a config, so views
#: memoised before (which read linear-attention layers as full attention, say) are found again.
VIEW_SCHEMA = 6


_KNOWN_VIEWS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("kvscope_known_views_only", default=False)


class ViewNotKnown(SpecError):
    """A config's view is neither shipped nor memoised, and finding it now (transformers, torch) is not
    allowed where it was asked (``known_views_only``)."""


@contextlib.contextmanager
def known_views_only():
    """Within it, ``config_view`` never imports transformers: a view not shipped or memoised raises
    ``ViewNotKnown``. The window's process judges switches from the spec alone this way (it never loads torch)."""
    token = _KNOWN_VIEWS_ONLY.set(True)
    try:
        yield
    finally:
        _KNOWN_VIEWS_ONLY.reset(token)


def config_view(cfg: dict[str, Any], shipped: Any = None) -> ConfigView:
    """What transformers makes of ``cfg``: from ``shipped`` (a preset's stored view) when it is for
    this transformers version, else from the on-disk memo, else found now (seconds for DeepSeek-V3,
    and it imports torch) and memoised."""
    view = ConfigView.from_json(shipped) if shipped is not None else None
    if view is not None:
        return view
    key = config_key(cfg)
    digest = hashlib.sha256(f"{transformers_version()}\n{VIEW_SCHEMA}\n{key}".encode()).hexdigest()[:24]
    store = _cache_dir() / "config_views.json"
    try:
        known = json.loads(store.read_text(encoding="utf-8")) if store.is_file() else {}
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    view = ConfigView.from_json(known.get(digest))
    if view is not None:
        return view
    if _KNOWN_VIEWS_ONLY.get():
        raise ViewNotKnown("this config's view is not known yet (transformers would find it)")
    view = compute_view(key)  # imports transformers (and torch): a config seen for the first time
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        known[digest] = view.to_json()
        tmp = store.with_suffix(f".{os.getpid()}.tmp")  # unique: processes may race
        try:
            tmp.write_text(json.dumps(known), encoding="utf-8")
            tmp.replace(store)
        except OSError:  # a full disk: no half-written file left to take the last bytes
            tmp.unlink(missing_ok=True)
            raise
    except OSError:  # the memo is a courtesy: a full or read-only cache only means finding the view again
        pass
    return view


def model_facts(cfg: dict[str, Any]) -> ModelFacts | None:
    """Exact facts from a meta-device build (memoised with the rest of the config's view)."""
    return config_view(cfg).facts



# --------------------------------------------------------------------------------------------
# Deriving the spec

def _estimate_parameters(cfg: dict[str, Any], layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                         vocab: int, tied: bool) -> int:
    """Llama-shaped estimate for model types transformers cannot build (used only then)."""
    inter = cfg.get("intermediate_size")
    inter = inter if is_plain_int(inter) and 0 < inter <= MAX_COUNT else 4 * hidden
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter
    embed = vocab * hidden * (1 if tied else 2)
    return layers * (attn + mlp + 2 * hidden) + embed + hidden


def _declared_layer_types(cfg: dict[str, Any], layers: int, window: int | None) -> tuple[str, ...]:
    """Per-layer attention types of a model type transformers does not know, from the config alone."""
    declared = cfg.get("layer_types")
    if isinstance(declared, list) and len(declared) == layers:
        return tuple(SLIDING_ATTENTION if "sliding" in str(t) else FULL_ATTENTION for t in declared)
    return tuple([SLIDING_ATTENTION if window else FULL_ATTENTION] * layers)

#: The fields that hold a rotary base (RoPE's theta): a config's own, Gemma 3's local one, and each entry of
#: transformers 5's ``rope_parameters`` (one dict, or one per layer type).
ROPE_BASE_KEYS = ("rope_theta", "rope_local_base_freq")


def _rope_bases(cfg: dict[str, Any]):
    """``(where, value)`` of every rotary base ``cfg`` names (top level, ``rope_parameters``, ``rope_scaling``)."""
    for key in ROPE_BASE_KEYS:
        if key in cfg:
            yield key, cfg[key]
    for holder in ("rope_parameters", "rope_scaling"):
        params = cfg.get(holder)
        if not isinstance(params, dict):
            continue
        nested = [(f"{holder}.{k}", v) for k, v in params.items() if isinstance(v, dict)]
        for where, block in [(holder, params), *nested]:
            for key in ROPE_BASE_KEYS:
                if key in block:
                    yield f"{where}.{key}", block[key]


def check_config_values(cfg: dict[str, Any], name: str = "model") -> None:
    """The values of a config that are not counts but still must make sense, checked for ``calc`` and ``run`` alike
    (``spec_from_config``, and the loader before transformers builds anything): every rotary base a finite number
    above 0 (``rope_theta: 0`` or a negative one gave NaN logits and a sampler traceback), and a sliding window
    in use a positive whole number (``sliding_window: 0`` was read as "no window" here and as a window of 0 tokens
    by transformers: a shape mismatch; by MLX, a broadcast error). SpecError naming the field."""
    cfg = _text_config(cfg)
    for where, value in _rope_bases(cfg):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # not a number ("x"): transformers' own refusal, in run's one line
        if not math.isfinite(value) or value <= 0:
            raise SpecError(f"{name}: {where} must be a positive number (the rotary base, e.g. 10000.0), got "
                            f"{value!r:.40}; RoPE with it gives NaN or meaningless positions")
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window") is not False:
        if not isinstance(window, bool) and isinstance(window, (int, float)) and window <= 0:
            raise SpecError(f"{name}: sliding_window must be a positive number of tokens, got {window!r:.40} "
                            "(null, or leaving it out, means no window)")


def _first_key(cfg: dict[str, Any], *keys: str) -> str:
    """The first of ``keys`` that ``cfg`` sets (not null), else the first."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


def _missing_heads(name: str) -> SpecError:
    return SpecError(f"{name}: config is missing the number of attention heads")

def spec_from_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Derive a ModelSpec from a config dict. Raises SpecError with a specific message on bad fields."""
    meta = cfg.get("_kvscope") if isinstance(cfg.get("_kvscope"), dict) else {}
    whole, cfg = cfg, _text_config(cfg)
    _require_layer_count(cfg, name)
    archs = cfg.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        raise SpecError(f"{name}: {', '.join(archs)} is not a causal language model (no KV cache to generate with)")
    counts = _checked_counts(cfg, name)
    check_config_values(cfg, name)
    layers, heads, hidden, kv_heads = counts["layers"], counts["heads"], counts["hidden"], counts["kv_heads"]
    head_dim, vocab, max_pos, window, mla = (counts["head_dim"], counts["vocab"], counts["max_pos"], counts["window"],
                                             counts["mla"])
    tied_named = cfg.get("tie_word_embeddings", True)
    dtype_name = str(_first(cfg, "torch_dtype", "dtype") or "float32")
    try:
        dtype = canonical_dtype(dtype_name)
    except SpecError:
        dtype = "float32"
    if dtype.startswith("int"):  # issue 38: weights "int4" were predicted at half a byte, fractional activation bytes
        raise SpecError(f"{name}: {_first_key(cfg, 'torch_dtype', 'dtype')} {dtype_name!r:.40} is not a dtype weights load "
                        "in (float32, float16 or bfloat16; a quantized model gives its bits in quantization_config)")

    try:
        view = config_view(cfg, shipped=meta.get("view") if meta else None)
    except SpecError as exc:  # transformers refused the config (kvscope.core.model.hf.build_hf_config)
        raise SpecError(f"{name}: {exc}") from None
    tied = view.tied if view.tied is not None else bool(tied_named)
    types = view.layer_types or _declared_layer_types(cfg, layers, window)
    if counts["heads_missing"] and any(t != NO_KV for t in types):
        raise _missing_heads(name)
    if SLIDING_ATTENTION in types and window is None:
        window = view.sliding_window
    if SLIDING_ATTENTION not in types:
        window = None
    facts = view.facts
    towers = [k for k, v in whole.items() if isinstance(v, dict) and k.endswith("_config")
              and k not in ("text_config", "quantization_config")]
    if whole is not cfg and not towers and not meta.get("view"):
        # The text model inside a class of its own and no media tower beside it (Fuyu's image-patch projection,
        # Gemma 4 assistant's projections): run loads that whole class, so the weights are the whole model's.
        # (A vision or audio tower, Gemma 3's, stays out: calc counts the language model.)
        try:
            facts = config_view(whole).facts or facts
        except SpecError:
            pass
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
        indexer_head_dim=counts["indexer"] if INDEXED_ATTENTION in types else None,
        layer_types=types,
        layer_states=view.states if view.states is not None and len(view.states) == len(types) else None,
        layer_kv=view.kv_shapes if view.kv_shapes is not None and len(view.kv_shapes) == len(types) else None,
        sliding_window=window,
        display_name=str(meta.get("display_name", "")) if meta else "",
        config=cfg,
        **mla,
    )


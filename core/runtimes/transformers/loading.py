"""Loading a causal LM and its tokenizer from any source, with user-facing errors.

A source is ``embedded`` (the built-in demo model, see kvscope.core.model.embedded), a local model folder, or a
Hugging Face hub id (network, or a warm local cache). Everything that can go wrong with a source
raises LoadError with a one-line message that says what is wrong and what to do; for every source
but the embedded one the message ends with a reminder that the embedded model always works, and
``offer_embedded`` is True so a front end can offer it.

Safety defaults: code from a model repository (``auto_map`` / ``trust_remote_code``) runs only
when the caller passes ``trust_remote_code=True``; pickle weights (``pytorch_model.bin``), which
can execute code when unpickled, load only with ``allow_pickle=True``.

Devices and dtypes: ``auto`` picks CUDA, then Apple MPS, then CPU. dtype ``auto`` is the model's
own dtype (its config's ``dtype``) on a GPU and fp32 on the CPU (CPU half precision is slow and, for
bf16 on older CPUs, emulated). fp16 and bf16 on the CPU are allowed on request: torch runs them,
only slowly; they are useful to see the memory halve, not for speed.

Why one file of about 680 lines: every source (embedded, folder, hub) ends in the same checks before
any weights load (safetensors only, the header against a meta build, trust_remote_code opt-in) and the
same user-facing errors; one place keeps those rules from drifting apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvscope.core.base.errors import UNAVAILABLE, KVScopeError
from kvscope.core.base.longlived import collector_paused
from kvscope.core.model.embedded import EmbeddedBuildError, embedded_build
from kvscope.core.model.hf import ensure_transformers
from kvscope.core.model.hf_config import check_config_values, read_config_json, spec_from_config
from kvscope.core.model.weights_file import check_folder_files, check_safetensors
from kvscope.core.model.spec import (PRESETS_DIR, ModelSpec, SpecError, canonical_dtype, check_config,
                                     is_transformers_refusal, path_kind, preset_names, transformers_refusal)

# The tokenizers library's Rust thread pool is created by the first encode on whatever thread does it
# (the generation worker), takes that thread's name and outlives it. A prompt needs no pool.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EMBEDDED_SOURCES = ("embedded", "")
EMBEDDED_HINT = "(the embedded demo model is always available: --model embedded)"
LOADABLE_DTYPES = ("float32", "float16", "bfloat16")

# Unexpected checkpoint keys that are harmless: buffers older checkpoints saved alongside weights.
_BENIGN_UNEXPECTED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias|position_ids)$")
_SAFETENSORS_GLOB = "*.safetensors"
_PICKLE_GLOBS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
# Any of these means the folder carries some tokenizer (fast, SentencePiece, BPE, WordPiece, tiktoken).
_TOKENIZER_GLOBS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "*.tiktoken", "vocab.json",
                    "vocab.txt", "spiece.model")


class LoadError(KVScopeError):
    """A model could not be loaded. ``str(err)`` is one line for the user.

    ``offer_embedded`` is True when the problem is the model source (the embedded demo model
    would load instead); False for problems the embedded model shares (device, dtype).
    """

    category = UNAVAILABLE

    def __init__(self, message: str, offer_embedded: bool = False):
        message = " ".join(str(message).split())  # one line, whatever the cause said
        if offer_embedded and not message.endswith(EMBEDDED_HINT):
            message = f"{message} {EMBEDDED_HINT}"
        super().__init__(message)
        self.message = message
        self.offer_embedded = offer_embedded


@dataclass
class LoadedModel:
    """A model ready to generate: in eval mode, on ``device``, in ``dtype``.

    ``dtype`` is canonical (``float32``, ``float16``, ``bfloat16``); ``source`` is what the user
    asked for (``embedded``, a folder, a hub id); ``label`` is what to show them.
    """

    model: Any
    tokenizer: Any
    spec: ModelSpec
    device: str
    dtype: str
    source: str
    label: str
    notes: tuple[str, ...] = ()  # one line each, for the user (the embedded model on random weights says why)


# --------------------------------------------------------------------------------------------
# Devices and dtypes


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(name: str = "auto") -> str:
    """Turn a device name into one torch can use: ``auto`` -> ``cuda``, ``mps`` or ``cpu``.

    Accepts ``auto``, ``cpu``, ``cuda``, ``cuda:N`` and ``mps``; raises LoadError (offer_embedded
    False) when the device is not present, saying why.
    """
    import torch

    dev = str(name or "auto").strip().lower()
    if dev == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if _mps_available() else "cpu"
    if dev == "cpu":
        return "cpu"
    if dev == "mps":
        if _mps_available():
            return "mps"
        if not torch.backends.mps.is_built():
            raise LoadError("device mps is not available: this torch build has no Apple MPS support")
        raise LoadError("device mps is not available: it needs Apple silicon and macOS 12.3 or later")
    match = re.fullmatch(r"cuda(?::(\d+))?", dev)
    if match:
        if torch.version.cuda is None and not torch.cuda.is_available():
            raise LoadError(f"device {dev} is not available: this torch build has no CUDA support "
                            f"(torch {torch.__version__}); install a CUDA build of torch or use --device cpu")
        if not torch.cuda.is_available():
            raise LoadError(f"device {dev} is not available: no CUDA GPU found (is the NVIDIA driver loaded?)")
        if match.group(1) is not None:
            index, count = int(match.group(1)), torch.cuda.device_count()
            if index >= count:
                have = ", ".join(f"cuda:{i}" for i in range(count))
                raise LoadError(f"device {dev} does not exist; this machine has {count} CUDA device(s): {have}")
        return dev
    raise LoadError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps")


def _dtype_from_config(config_dtype: Any) -> str | None:
    if config_dtype is None:
        return None
    try:
        name = canonical_dtype(str(config_dtype))
    except SpecError:
        return None
    return name if name in LOADABLE_DTYPES else None


def _mps_supports_bf16() -> bool:
    import torch

    try:  # bf16 on MPS arrived with macOS 14; older systems raise on the first bf16 tensor
        torch.ones(1, dtype=torch.bfloat16, device="mps") + 1
        return True
    except (RuntimeError, TypeError):
        return False


def resolve_dtype(name: str, device: str, config_dtype: Any = None) -> "torch.dtype":  # noqa: F821
    """The torch dtype to load weights in on ``device``.

    ``name`` is ``auto`` or a spelling of fp32/fp16/bf16 (see kvscope.core.model.spec.DTYPE_ALIASES).
    ``auto`` means the model's own dtype (``config_dtype``, e.g. ``"bfloat16"``) on CUDA/MPS -
    with bf16 replaced by fp16 on GPUs that lack it - and fp32 on the CPU. fp16/bf16 on the CPU
    are allowed (slow). Raises LoadError (offer_embedded False) for unknown names, quantized
    dtypes, and bf16 on a GPU without it.
    """
    import torch

    dev = str(device).split(":")[0]
    key = str(name or "auto").strip().lower()
    if key == "auto":
        wanted = _dtype_from_config(config_dtype) or "float32"
        if dev == "cpu":
            wanted = "float32"
        elif wanted == "bfloat16" and not _bf16_supported(dev, device):
            wanted = "float16"
    else:
        try:
            wanted = canonical_dtype(key)
        except SpecError as exc:
            raise LoadError(f"unknown dtype {name!r}; use auto, fp32, fp16 or bf16") from exc
        if wanted not in LOADABLE_DTYPES:
            raise LoadError(f"dtype {name!r} is for the calculator and the quantized KV cache; model weights "
                            "load as fp32, fp16 or bf16")
        if wanted == "bfloat16" and dev in ("cuda", "mps") and not _bf16_supported(dev, device):
            where = _gpu_name(device) if dev == "cuda" else "this Mac's MPS (bf16 needs macOS 14)"
            raise LoadError(f"bf16 is not supported on {where}; use --dtype fp16 or fp32")
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[wanted]


def _bf16_supported(dev: str, device: str) -> bool:
    import torch

    if dev == "cuda":
        with torch.cuda.device(torch.device(device)):
            # including_emulation=False: pre-Ampere GPUs "support" bf16 only by slow emulation.
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if dev == "mps":
        return _mps_supports_bf16()
    return True


def _gpu_name(device: str) -> str:
    import torch

    dev = torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    return f"{torch.cuda.get_device_name(dev)} (compute capability {major}.{minor}; bf16 needs 8.0)"


# --------------------------------------------------------------------------------------------
# Sources


def _looks_like_path(src: str) -> bool:
    return src.startswith((".", "/", "~", "\\")) or bool(re.match(r"^[A-Za-z]:[\\/]", src)) or src.count("/") > 1


def _check_local_folder(folder: Path, name: str, allow_pickle: bool, trust_remote_code: bool) -> dict[str, Any]:
    """Checks a folder can be loaded before transformers touches it; returns its config dict."""
    cfg_path = folder / "config.json"
    if path_kind(cfg_path) is None:
        raise LoadError(f"{folder} has no config.json; a model folder needs config.json and weights "
                        "(e.g. one saved with save_pretrained)", offer_embedded=True)
    try:
        # The reader and the plausibility checks ``calc`` uses (kvscope.core.model.spec), before transformers reads or
        # builds anything: 100,000 layers used to build for minutes here while memory grew past 5 GB.
        cfg = read_config_json(cfg_path)
        _check_remote_code(cfg, name, trust_remote_code)
        check_config(cfg, name)
        check_config_values(cfg, name)
        check_folder_files(folder, name)  # a FIFO, a device or a link to one is never opened by a loader
    except SpecError as exc:
        raise LoadError(str(exc), offer_embedded=True) from None
    safetensors = sorted(folder.glob(_SAFETENSORS_GLOB))
    pickles = sorted({p for g in _PICKLE_GLOBS for p in folder.glob(g)})
    if not safetensors and not pickles:
        raise LoadError(f"{folder} has no weights (model.safetensors)", offer_embedded=True)
    if not safetensors and not allow_pickle:
        raise LoadError(_pickle_message(name, pickles[0].name), offer_embedded=True)
    if safetensors:
        _check_safetensors_headers(safetensors, name)
    if not any(any(folder.glob(pattern)) for pattern in _TOKENIZER_GLOBS):
        raise LoadError(f"{folder} has no tokenizer (tokenizer.json, tokenizer.model or vocab files); copy the "
                        "tokenizer files of the model next to its weights", offer_embedded=True)
    return cfg


def _pickle_message(name: str, filename: str = "pytorch_model.bin") -> str:
    return (f"{name} has weights only in pickle format ({filename}); unpickling can run arbitrary code, so "
            "KV Scope refuses it unless you opt in with --allow-pickle (only for files you trust)")


def _check_safetensors_headers(files: list[Path], name: str) -> dict[str, tuple[int, ...]]:
    """Read each file's header (cheap: no tensor data) so a corrupt file gets a clear message; returns
    every stored tensor's shape by name."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:  # KV Scope's own reader first (the offsets, dtypes and shapes against the bytes, the file's length)
            check_safetensors(path, name)
        except SpecError as exc:
            raise LoadError(str(exc), offer_embedded=True) from None
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as exc:  # SafetensorError is not exported under a stable name
            raise LoadError(f"{name}: {path.name} is not a valid safetensors file ({_first_line(exc)}); "
                            "it may be truncated or corrupt - download it again", offer_embedded=True) from exc
    return shapes


def _check_weights_fit_config(folder: Path | None, config: Any, name: str, trust_remote_code: bool,
                              offer: bool) -> None:
    """Refuse weights that do not fit the config before transformers builds the model from the config.

    The model transformers builds is the config's, whatever the files hold: tensors the files lack are
    allocated and initialised all the same. So a config.json far larger than its weights (a tiny model's
    files under a config of 4,000 layers) would allocate the config's model before any message. The
    safetensors headers (no tensor data) and a build on the meta device (no memory) tell first:
    a stored tensor whose size differs from the config's, or a config that needs more than 1.25 x the
    values the files hold (renamed or fused checkpoint layouts keep the count; anything short of it
    would be refused after loading as missing tensors anyway). Quantized checkpoints (packed
    weights) and pickle-only folders are left to transformers.
    """
    if folder is None or getattr(config, "quantization_config", None):
        return
    files = sorted(folder.glob(_SAFETENSORS_GLOB))
    if not files:
        return
    stored = _check_safetensors_headers(files, name)
    import math

    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # transformers cannot build it: from_pretrained says why, in its own words
        return
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    for key, shape in stored.items():
        want = expected.get(key)
        if want is not None and math.prod(want) != math.prod(shape):
            raise LoadError(f"{name}: the weights do not match config.json - some tensors have other shapes than "
                            f"the config implies (e.g. {key} is {list(shape)} in the weights, {list(want)} by the "
                            "config)", offer_embedded=offer)
    needed = sum(p.numel() for p in skeleton.parameters())  # tied weights once, as stored
    held = sum(math.prod(shape) for shape in stored.values())
    if needed > held + held // 4:
        raise LoadError(f"{name}: the weights do not match config.json - the config describes {needed:,} parameters, "
                        f"the weights hold {held:,} values; the config and the weights come from different models",
                        offer_embedded=offer)


def _check_remote_code(cfg: dict[str, Any], name: str, trust_remote_code: bool) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    auto_map = cfg.get("auto_map")
    model_type = cfg.get("model_type")
    if auto_map and model_type not in CONFIG_MAPPING and not trust_remote_code:
        raise LoadError(_remote_code_message(name, model_type), offer_embedded=True)


def _remote_code_message(name: str, model_type: Any = None) -> str:
    kind = f"its model type {model_type!r} is not part of transformers, so " if model_type else ""
    return (f"{name} needs Python code from the model's own repository ({kind}the model class comes from "
            "its auto_map); KV Scope runs such code only if you pass --trust-remote-code, and you should "
            "only do that for repositories you trust")


def _preset_message(preset: str) -> str:
    """Presets are configs for the calculator; say where the real weights live if the preset knows."""
    try:
        meta = json.loads((PRESETS_DIR / f"{preset}.json").read_text(encoding="utf-8")).get("_kvscope") or {}
    except (OSError, ValueError, AttributeError):
        meta = {}
    hub_id = next((w for w in str(meta.get("source", "")).split() if w.count("/") == 1), None)
    where = f"; to run it, give its hub id: --model {hub_id}" if hub_id else ""
    return f"{preset} is a calculator preset (config only, no weights){where}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _translate_hub_error(exc: BaseException, name: str) -> LoadError:
    """Map what transformers/huggingface_hub raise for a hub id to a specific message."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    text = str(exc)
    chain = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(e, GatedRepoError) for e in chain) or "gated repo" in text:
        return LoadError(f"{name} is gated: accept its licence on huggingface.co and log in (hf auth login)",
                         offer_embedded=True)
    if any(isinstance(e, RepositoryNotFoundError) for e in chain) or "not a valid model identifier" in text:
        return LoadError(f"{name}: no such model on the Hugging Face hub (or it is private)", offer_embedded=True)
    if "couldn't connect" in text or "offline mode" in text.lower() or "Cannot reach" in text:
        return LoadError(f"{name}: not in the local Hugging Face cache, and the hub cannot be reached "
                         "(no network, or HF_HUB_OFFLINE is set); check the id, or download it once with network",
                         offer_embedded=True)
    if "Repo id must" in text or "HFValidationError" in type(exc).__name__:
        return LoadError(f"{name!r} is neither a local model folder nor a hub id (org/name)", offer_embedded=True)
    if "trust_remote_code" in text:
        return LoadError(_remote_code_message(name), offer_embedded=True)
    if "model.safetensors" in text or "use_safetensors" in text:
        return LoadError(f"{name} has no weights in safetensors format; pickle weights (pytorch_model.bin) can run "
                         "code when loaded, so KV Scope refuses them unless you opt in with --allow-pickle",
                         offer_embedded=True)
    if "does not recognize this architecture" in text or "Unrecognized model" in text:
        return LoadError(f"{name}: transformers {_tf_version()} does not know this model type; it may need a "
                         "newer transformers, or --trust-remote-code if its code lives in the repository",
                         offer_embedded=True)
    return LoadError(f"{name}: cannot load ({type(exc).__name__}: {_first_line(exc)})", offer_embedded=True)


def _tf_version() -> str:
    import transformers

    return transformers.__version__


_ENCODER_HINT = "an encoder (it reads text but has no KV cache to generate with)"


def _check_causal_lm(config: Any, name: str, trust_remote_code: bool) -> None:
    """Refuse configs that transformers could load but that are not decoder-only generators."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    causal_suffixes = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if archs and not any(a.endswith(causal_suffixes) for a in archs):
        raise LoadError(f"{name} is {', '.join(archs)}, not a causal language model: {_ENCODER_HINT}"
                        if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES else
                        f"{name} is {', '.join(archs)}, not a causal language model (no text generation)",
                        offer_embedded=True)
    if getattr(config, "is_encoder_decoder", False):
        raise LoadError(f"{name} ({model_type}) is an encoder-decoder model; KV Scope needs a decoder-only "
                        "causal language model", offer_embedded=True)
    # BERT-like types have a *ForCausalLM class in transformers, but only as a decoder half; a
    # plain BERT config (is_decoder False) describes an encoder.
    if (model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(config, "is_decoder", False)):
        raise LoadError(f"{name} ({model_type}) is {_ENCODER_HINT}, not a causal language model",
                        offer_embedded=True)
    remote_causal = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote_causal:
        raise LoadError(f"{name} ({model_type}) has no causal language model class in transformers "
                        f"{_tf_version()}; KV Scope needs a model that generates text", offer_embedded=True)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' own weight-loading bar and warnings: our messages say it better."""
    from transformers.utils import logging as tf_logging

    bar_was_on = tf_logging.is_progress_bar_enabled()
    verbosity = tf_logging.get_verbosity()
    tf_logging.disable_progress_bar()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(verbosity)
        if bar_was_on:
            tf_logging.enable_progress_bar()


def _mismatch_details(folder: Path | None, config: Any) -> str:
    """First weight whose stored shape differs from the shape the config implies, if we can tell."""
    if folder is None:
        return ""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        for path in sorted(folder.glob(_SAFETENSORS_GLOB)):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    shape = tuple(handle.get_slice(key).get_shape())
                    if key in expected and expected[key] != shape:
                        return f" (e.g. {key} is {list(shape)} in the weights, {list(expected[key])} by the config)"
    except Exception:  # details are a courtesy; the main message stands without them
        return ""
    return ""


def _unpickling_message(name: str, folder: Path | None, exc: BaseException) -> str:
    """torch.load(weights_only=True) refused a pickle: one line instead of torch's paragraph. A
    pickle that asks for a callable (``GLOBAL posix.system``) is code, not weights."""
    files = sorted({p.name for g in _PICKLE_GLOBS for p in folder.glob(g)}) if folder is not None else []
    which = files[0] if len(files) == 1 else "its pickle weights"
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if found:
        return (f"{name}: {which} was refused by torch's safe loader: it asks to call {found.group(1)}, which "
                "plain weights never do; KV Scope does not load it (it may be malicious)")
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    reasons = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.strip().startswith(boilerplate)]
    return (f"{name}: {which} is not a readable weights pickle (torch's safe loader: "
            f"{reasons[0] if reasons else _first_line(exc)}); it may be corrupt")


def nonfinite_weights(model: Any) -> str | None:
    """What is wrong when a loaded model's floating-point parameters hold NaN or infinity (None when none does):
    ``"hold NaN: model.norm.weight is all NaN (576 of 576 values)"``. One sum per parameter finds them (NaN and
    either infinity make it non-finite); only a parameter whose sum is not finite is counted element by element
    (a sum of large finite fp16 values can overflow). Buffers are left out: masks hold -inf by design."""
    import torch

    for pname, param in model.named_parameters():
        if not param.is_floating_point() or param.numel() == 0:
            continue
        with torch.no_grad():
            if bool(torch.isfinite(param.sum())):
                continue
            nan, inf = int(torch.isnan(param).sum()), int(torch.isinf(param).sum())
        if not nan and not inf:
            continue
        kind = "NaN" if nan else "infinity"
        count = nan or inf
        share = "all" if count == param.numel() else f"{count:,} of {param.numel():,} values"
        what = f"is all {kind} ({count:,} of {param.numel():,} values)" if share == "all" else f"holds {kind} in {share}"
        return f"hold {kind}: {pname} {what}"
    return None


def _check_loading_info(info: dict[str, Any], name: str) -> None:
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(k for k in (info.get("unexpected_keys") or []) if not _BENIGN_UNEXPECTED.search(k))
    if missing:
        raise LoadError(f"{name}: the weights do not match config.json - {len(missing)} tensor(s) the config needs "
                        f"are missing (e.g. {missing[0]}); the config and the weights come from different models",
                        offer_embedded=True)
    if unexpected:
        raise LoadError(f"{name}: the weights do not match config.json - {len(unexpected)} stored tensor(s) have no "
                        f"place in the model the config describes (e.g. {unexpected[0]})", offer_embedded=True)


# --------------------------------------------------------------------------------------------
# load_model


def load_model(
    source: str = "embedded",
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    progress: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, ready to generate (eval mode, on device, in dtype).

    ``source``: ``embedded`` (built on first use, offline), a local model folder, or a hub id.
    ``device``/``dtype``: see resolve_device / resolve_dtype. The attention implementation is
    ``sdpa`` (switch it with set_attn_impl). ``progress`` receives short status lines.
    Raises LoadError with a one-line message for every failure it can name.
    """
    ensure_transformers()
    say = progress or (lambda _msg: None)
    src = str(source if source is not None else "embedded").strip()
    dev = resolve_device(device)
    is_embedded = src.lower() in EMBEDDED_SOURCES

    folder: Path | None = None
    fallback_note: str | None = None  # the embedded model on random weights: why, said once loaded
    if is_embedded:
        try:
            build = embedded_build(progress=say)
        except EmbeddedBuildError as exc:
            raise LoadError(str(exc)) from exc
        folder, fallback_note = build.folder, build.note
        name, label, load_from, offer = "embedded", build.label, str(folder), False
    else:
        path = Path(src).expanduser()
        offer = True
        try:
            kind = path_kind(path, src)
        except SpecError as exc:  # a name too long for the OS to look up
            raise LoadError(str(exc), offer_embedded=True) from None
        if kind == "dir":
            folder = path.resolve()
            name = label = folder.name
            _check_local_folder(folder, name, allow_pickle, trust_remote_code)
            load_from = str(folder)
        elif kind is not None:
            raise LoadError(f"{src} is a file; give the model folder that holds config.json and the weights",
                            offer_embedded=True)
        elif _looks_like_path(src):
            raise LoadError(f"no such folder: {src}", offer_embedded=True)
        elif src.lower() in preset_names():
            raise LoadError(_preset_message(src.lower()), offer_embedded=True)
        else:
            name = label = load_from = src

    try:
        loaded = _load(load_from, name, label, src if not is_embedded else "embedded", folder, dev, dtype,
                       trust_remote_code, allow_pickle, say, offer)
        if fallback_note:
            say(fallback_note)  # the last status line, so it stays on screen (the label says "random weights" too)
            loaded.notes = (*loaded.notes, fallback_note)
        return loaded
    except LoadError:
        raise
    except (MemoryError, RuntimeError) as exc:
        if _is_oom(exc):
            raise LoadError(f"not enough memory on {dev} to load {name} in {dtype} "
                            f"({_first_line(exc)}); try a smaller model, --dtype fp16, or another device",
                            offer_embedded=offer and not is_embedded) from exc
        raise LoadError(f"{name}: cannot load ({type(exc).__name__}: {_first_line(exc)})", offer_embedded=offer) from exc
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
        if is_embedded or isinstance(exc, SpecError):  # ours: a bug to see, or a message already for the user
            raise
        # transformers could not build what a folder's or a hub model's config describes (a rope_theta of "x")
        raise LoadError(f"{name}: transformers cannot build the model its config.json describes "
                        f"({type(exc).__name__}: {_first_line(exc)})", offer_embedded=True) from exc


def _free_device_memory(dev: str) -> None:
    import gc

    import torch

    gc.collect()
    if dev.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif dev == "mps" and _mps_available():
        torch.mps.empty_cache()


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(exc).lower()


def _model_class(config: Any, trust_remote_code: bool) -> Any:
    """The class AutoModelForCausalLM would build for ``config`` (None when it cannot tell)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def _load(load_from: str, name: str, label: str, source: str, folder: Path | None, dev: str, dtype: str,
          trust_remote_code: bool, allow_pickle: bool, say: Callable[[str], None], offer: bool) -> LoadedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        say("reading config…")
        try:
            config = AutoConfig.from_pretrained(load_from, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            raise _translate_hub_error(exc, name) from exc
        except Exception as exc:
            if is_transformers_refusal(exc):  # the line calc says for the same config (kvscope.core.model.hf)
                raise LoadError(f"{name}: {transformers_refusal(exc)}", offer_embedded=offer) from None
            raise
        _check_causal_lm(config, name, trust_remote_code)
        try:  # calc's plausibility checks, also for a hub model's config (a folder's were checked already)
            check_config(config.to_dict(), name)
            check_config_values(config.to_dict(), name)
        except SpecError as exc:
            raise LoadError(str(exc), offer_embedded=offer) from None
        _check_weights_fit_config(folder, config, name, trust_remote_code, offer)
        torch_dtype = resolve_dtype(dtype, dev, getattr(config, "dtype", None))
        dtype_name = str(torch_dtype).removeprefix("torch.")

        say(f"loading weights ({dtype_name})…")
        # sdpa where transformers runs the class with it; eager where it refuses (Gemma 2 cannot softcap in sdpa).
        model_class = _model_class(config, trust_remote_code)
        attn = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
        try:
            with collector_paused():  # other threads' collections never walk the half-built model
                model, info = AutoModelForCausalLM.from_pretrained(
                    load_from,
                    config=config,
                    dtype=torch_dtype,
                    attn_implementation=attn,
                    # None = prefer safetensors, fall back to pickle; True = safetensors or fail.
                    use_safetensors=None if allow_pickle else True,
                    trust_remote_code=trust_remote_code,
                    output_loading_info=True,
                )
        except (OSError, ValueError) as exc:
            raise _translate_hub_error(exc, name) from exc
        except pickle.UnpicklingError as exc:  # --allow-pickle, and torch's safe loader refused the file
            raise LoadError(_unpickling_message(name, folder, exc), offer_embedded=offer) from None
        except RuntimeError as exc:
            if "mismatch" in str(exc):
                detail = _mismatch_details(folder, config)
                raise LoadError(f"{name}: the weights do not match config.json - some tensors have other shapes than "
                                f"the config implies{detail}", offer_embedded=offer) from exc
            if "deserializ" in str(exc) or "safetensor" in type(exc).__name__.lower():
                raise LoadError(f"{name}: a weights file is not valid safetensors ({_first_line(exc)}); it may be "
                                "truncated or corrupt - download it again", offer_embedded=offer) from exc
            raise
        except Exception as exc:
            if "safetensor" in type(exc).__name__.lower():
                raise LoadError(f"{name}: a weights file is not valid safetensors ({_first_line(exc)}); it may be "
                                "truncated or corrupt - download it again", offer_embedded=offer) from exc
            raise
        _check_loading_info(info, name)
        model.eval()
        if dev != "cpu":
            say(f"moving to {dev}…")
            try:
                model.to(dev)
            except (RuntimeError, MemoryError) as exc:
                if not _is_oom(exc):
                    raise
                # Drop the half-moved model before raising: the traceback would keep it (and its
                # device memory) alive for as long as the caller holds the error.
                n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
                del model
                _free_device_memory(dev)
                raise LoadError(f"not enough memory on {dev} for the weights of {name} ({n_bytes / 2**30:.1f} GiB in "
                                f"{dtype_name}); try a smaller model, --dtype fp16, or another device",
                                offer_embedded=offer) from None

        problem = nonfinite_weights(model)  # on the device: one pass over the weights, a sum each
        if problem:
            del model
            _free_device_memory(dev)
            raise LoadError(f"{name}: the model's weights {problem}; every token would come out of NaN logits - the "
                            "file is corrupt, or was saved from a diverged run", offer_embedded=offer)

        say("loading tokenizer…")
        try:
            tokenizer = AutoTokenizer.from_pretrained(load_from, trust_remote_code=trust_remote_code)
        except Exception as exc:  # missing files, sentencepiece/tiktoken not installed, bad JSON...
            raise LoadError(f"{name}: cannot load its tokenizer ({_first_line(exc)}); a model folder needs "
                            "tokenizer.json or the tokenizer files of its family", offer_embedded=offer) from exc
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # padding is never used for one sequence, but generate() asks

    try:
        spec = spec_from_config(model.config.to_dict(), name)
    except SpecError as exc:
        raise LoadError(str(exc), offer_embedded=offer) from exc
    say(f"ready: {label} on {dev} ({dtype_name})")
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec, device=dev, dtype=dtype_name, source=source,
                       label=label)

"""The model folder an MLX run loads, checked before mlx-lm sees it. No MLX import here.

mlx-lm loads a folder holding ``config.json`` and ``model*.safetensors`` (``mlx_lm.utils.load_model``): the
embedded model's build (a Llama in safetensors), a folder converted with ``mlx_lm.convert`` (LM Studio keeps
those beside its GGUFs; the Hugging Face cache holds ``mlx-community`` repos), or any transformers folder of an
architecture mlx-lm implements. Pickle weights are never loaded (mlx-lm reads safetensors only), and a config
that names its own Python file (``model_file``) is refused unless the user passed ``--trust-remote-code``; so is
a ``tokenizer_config.json`` whose ``chat_template_type`` or ``tool_parser_type`` (module names mlx-lm imports)
names a module the installed mlx-lm does not ship.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Callable

from kvscope.core.base.safe_text import safe_text
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.embedded import embedded_model_dir
from kvscope.core.model.hf_config import read_config_json
from kvscope.core.model.spec import SpecError
from kvscope.core.model.weights_file import check_weights


def resolve_model(source: str, progress: Callable[[str], None] | None = None, trust_remote_code: bool = False) -> Path:
    """The folder an MLX run loads: ``embedded`` (or empty) is the embedded model's build; anything else must be a
    folder with config.json and safetensors weights. SettingsError, one line, otherwise."""
    if source in ("", "embedded", None):
        return embedded_model_dir(progress)
    path = Path(str(source)).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_file():
        kind = "a GGUF file (run it with --runtime llama.cpp)" if path.suffix.lower() == ".gguf" else "a file"
        raise SettingsError(f"--runtime mlx loads a model folder (config.json + safetensors); {source} is {kind}")
    if not path.is_dir():
        raise SettingsError(f"--runtime mlx loads a local model folder; {source} is not one (no download: fetch it "
                            "with huggingface-cli or LM Studio first, or leave --model out for the embedded model)")
    if not (path / "config.json").is_file():
        raise SettingsError(f"{source} has no config.json: not a model folder mlx-lm can load")
    if not sorted(path.glob("model*.safetensors")):
        pickles = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
        why = " (only pickle weights, which mlx-lm does not read)" if pickles else ""
        raise SettingsError(f"{source} has no model*.safetensors{why}: mlx-lm loads safetensors weights only")

    try:
        config = read_config_json(path / "config.json")
    except SpecError as exc:
        raise SettingsError(str(exc)) from None
    if config.get("model_file") is not None and not trust_remote_code:
        raise SettingsError(f"{source}'s config names its own Python file ({config.get('model_file')!r}) to build "
                            "the model; pass --trust-remote-code if you trust it")
    if not trust_remote_code:
        check_imported_names(path, source)
    if config.get("model_file") is None:  # a model file of its own builds the model whatever model_type says
        check_model_type(config, source)
    check_array_sizes(config, source)
    try:  # a FIFO or a device in the folder, a header that lies: one line before mlx-lm opens anything
        check_weights(path, str(source), "model*.safetensors")
    except SpecError as exc:
        raise SettingsError(str(exc)) from None
    return path


def model_modules() -> dict[str, bool]:
    """The modules of the installed mlx-lm's ``mlx_lm.models``, found on disk without importing mlx-lm, each with
    whether it is a model architecture (it defines or imports ``Model``, as ``mlx_lm.utils._get_classes`` takes it)
    or one of mlx-lm's helpers (``cache``, ``base``, ``switch_layers``...)."""
    try:
        spec = importlib.util.find_spec("mlx_lm")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    found: dict[str, bool] = {}
    for module in shipped_modules("models"):
        for root in roots:
            try:
                text = (Path(root) / "models" / f"{module}.py").read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            found[module] = bool(re.search(r"^(class Model\b|from \S+ import .*\bModel\b|Model\s*=)", text, re.M))
    return found


def check_model_type(config: dict, source: str) -> None:
    """Refuse a ``model_type`` that mlx-lm would import as ``mlx_lm.models.<model_type>`` and that names no model:
    not a plain name (``'../utils'``, a list), or one of mlx-lm's helper modules (``'cache'``: mlx-lm then failed with
    ``AttributeError: module 'mlx_lm.models.cache' has no attribute 'Model'``). A name mlx-lm does not ship is left
    to mlx-lm (its ``Model type ... not supported``, or a remapping such as mistral -> llama)."""
    model_type = config.get("model_type")
    shown = safe_text(repr(model_type), limit=60)
    if not isinstance(model_type, str) or not model_type.isidentifier():
        raise SettingsError(f"{source}'s config.json has model_type {shown}; mlx-lm takes the name of a model "
                            "architecture, e.g. 'llama'")
    if model_modules().get(model_type) is False:
        raise SettingsError(f"{source}'s config.json has model_type {shown}, which is mlx-lm's helper module "
                            f"mlx_lm.models.{model_type}, not a model architecture; mlx-lm "
                            f"{_mlx_lm_version()} has no such model type")


#: The largest size MLX takes for an array's dimension (its shapes are 32-bit ints).
MLX_MAX_DIM = 2**31 - 1
#: The config fields mlx-lm builds arrays of (a size, a dimension, a count), by how their names end or begin.
_SIZE_SUFFIXES, _SIZE_PREFIXES = ("_size", "_dim", "_rank", "_layers", "_heads", "_experts"), ("num_", "n_")


def check_array_sizes(config: dict, source: str) -> None:
    """Refuse a config whose sizes MLX cannot build: a size, dimension or count (``intermediate_size``,
    ``num_attention_heads``..., in the config or its ``text_config``) beyond ``MLX_MAX_DIM``. mlx-lm answered
    ``intermediate_size: 1e12`` with ``OverflowError: Integer value ... is outside the supported range`` (issue 38).
    SettingsError, one line, naming the field."""
    blocks = [("", config)] + [(f"{k}.", v) for k, v in config.items() if k.endswith("_config") and isinstance(v, dict)]
    for where, block in blocks:
        for key, value in block.items():
            if (type(value) is int and value > MLX_MAX_DIM
                    and (key.endswith(_SIZE_SUFFIXES) or key.startswith(_SIZE_PREFIXES))):
                raise SettingsError(f"{source}'s config.json has {where}{key} {value:,}, more than MLX's arrays take "
                                    f"(at most {MLX_MAX_DIM:,} along a dimension)")


def _mlx_lm_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:  # not installed as a distribution: the message stands without it
        return ""


#: The fields of ``tokenizer_config.json`` that mlx-lm imports as module names (``mlx_lm.tokenizer_utils.load``,
#: mlx-lm 0.32.2: ``importlib.import_module(f"mlx_lm.chat_templates.{chat_template_type}")`` and
#: ``f"mlx_lm.tool_parsers.{tool_parser_type}"``, read from ``AutoTokenizer``'s ``init_kwargs``, i.e. that file), with
#: the sub-package each names a module of.
IMPORTED_FIELDS = {"chat_template_type": "chat_templates", "tool_parser_type": "tool_parsers"}
#: A tokenizer_config.json is read up to this size here (a vocabulary's added tokens and a chat template fit).
MAX_TOKENIZER_CONFIG_BYTES = 64 << 20


def shipped_modules(package: str) -> frozenset[str]:
    """The modules the installed mlx-lm ships in its sub-package ``package`` (``chat_templates``,
    ``tool_parsers``), found on disk without importing mlx-lm: plain names, no private ones."""
    try:
        spec = importlib.util.find_spec("mlx_lm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    names = set()
    for root in spec.submodule_search_locations:
        folder = Path(root) / package
        if (folder / "__init__.py").is_file():
            names |= {p.stem for p in folder.glob("*.py") if p.stem.isidentifier() and not p.stem.startswith("_")}
    return frozenset(names)


def check_imported_names(path: Path, source: str) -> None:
    """Refuse a folder whose ``tokenizer_config.json`` names a module for mlx-lm to import that the installed
    mlx-lm does not ship (``'nosuch'``, ``'../../utils'``, a list...): a file from anywhere would choose what is
    imported. SettingsError, one line; ``--trust-remote-code`` leaves the names to mlx-lm. mlx-lm's own tests
    decide what is looked at: ``chat_template_type`` when truthy, ``tool_parser_type`` when not None."""
    file = path / "tokenizer_config.json"
    if not file.exists():
        return
    try:
        config = read_config_json(file, max_bytes=MAX_TOKENIZER_CONFIG_BYTES)
    except SpecError as exc:
        raise SettingsError(str(exc)) from None
    for field, package in IMPORTED_FIELDS.items():
        value = config.get(field)
        looked_at = bool(value) if field == "chat_template_type" else value is not None
        if not looked_at:
            continue
        if isinstance(value, str) and value in shipped_modules(package):
            continue
        shown = safe_text(repr(value), limit=80)
        raise SettingsError(f"{source}'s tokenizer_config.json names {field}={shown}, which mlx-lm would import as "
                            f"mlx_lm.{package}.<name>, and mlx-lm ships no such module; pass --trust-remote-code if "
                            "you trust the folder")

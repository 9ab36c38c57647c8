"""The model folder an MLX run loads, checked before mlx-lm sees it. No MLX import here.

mlx-lm loads a folder holding ``config.json`` and ``model*.safetensors`` (``mlx_lm.utils.load_model``): the
embedded model's build (a Llama in safetensors), a folder converted with ``mlx_lm.convert`` (LM Studio keeps
those beside its GGUFs; the Hugging Face cache holds ``mlx-community`` repos), or any transformers folder of an
architecture mlx-lm implements. Pickle weights are never loaded (mlx-lm reads safetensors only), and a config
that names its own Python file (``model_file``) is refused unless the user passed ``--trust-remote-code``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.embedded import embedded_model_dir
from kvscope.core.model.hf_config import read_config_json
from kvscope.core.model.spec import SpecError


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
    return path

"""Any model source as a ModelSpec: a GGUF file (``kvscope.core.model.gguf``), else an HF config (``kvscope.core.model.hf_config``): a preset
name, a local ``config.json`` or model folder, or a hub id.

The one dispatcher above the sources: ``calc``, ``run``, the window's calculator and controls, replay's labels and
``watch`` all name a model the same way and get the same spec, or the same one-line ``SpecError``.
"""

from __future__ import annotations

from kvscope.core.model.gguf import is_gguf_source, load_gguf_spec
from kvscope.core.model.hf_config import load_config_dict, spec_from_config
from kvscope.core.model.spec import EMBEDDED_PRESET, ModelSpec, check_model_name


def load_spec(source: str = EMBEDDED_PRESET) -> ModelSpec:
    """ModelSpec for a preset name, local config/folder, a GGUF file (``kvscope.core.model.gguf``) or hub id. Raises SpecError."""
    if is_gguf_source(check_model_name(source)):
        return load_gguf_spec(str(source).strip())
    name, cfg = load_config_dict(source)
    return spec_from_config(cfg, name)

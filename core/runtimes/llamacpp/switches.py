"""The llama.cpp runtime's light half: the switches a llama.cpp run takes and whether llama.cpp is installed, both
answered without importing llama.cpp (the command line and the window's process ask them through the registry)."""

from __future__ import annotations

from typing import Any

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.spec import parse_tokens
from kvscope.core.prediction.llamacpp import QUANTIZED, cache_type

#: What a llama.cpp run can switch: its cache types (each a reload of the context; ``context`` too), and the
#: attention keys it takes here and refuses in the run (llama.cpp fixes the attention layout at load).
LLAMACPP_CACHE_KEYS = ("cache", "cache-type", "cache-type-k", "cache-type-v")
LLAMACPP_ATTENTION_KEYS = ("attention", "attn-impl", "attn", "impl", "flash")


def parse_llamacpp_switch_value(key: str, value: str) -> tuple[str, Any]:
    """A llama.cpp run's switch ``KEY=VALUE``: a cache type (``cache``/``cache-type``: K and V;
    ``cache-type-k``/``-v``: one), ``context`` (tokens, e.g. 8192 or 8k), or an attention key (accepted here,
    refused by the run: llama.cpp fixes the attention layout when the model loads)."""
    k = key.strip().lower().replace("_", "-")
    if k in LLAMACPP_CACHE_KEYS:
        return k, cache_type(value)
    if k == "context":
        try:
            n = parse_tokens(value)
        except Exception as exc:  # noqa: BLE001 - SpecError or ValueError: said as one line
            raise SettingsError(f"context={value!r}: give tokens, e.g. 8192 or 8k ({exc})") from None
        if n <= 0:
            raise SettingsError(f"context={value!r}: give a positive number of tokens")
        return k, n
    if k in LLAMACPP_ATTENTION_KEYS:
        return k, value.strip().lower()
    raise SettingsError(f"unknown setting {key!r} for a llama.cpp run; use cache-type (cache-type-k, cache-type-v) "
                        "or context")


def llamacpp_switch_problem(spec: Any, device: str | None, now: dict[str, str], key: str, value: str,
                            **_: Any) -> str | None:
    """Why llama.cpp would refuse the live switch ``key=value`` from the settings ``now`` (the window greys it and C
    passes over it), or None: a quantized V cache needs flash attention (llama.cpp refuses it with -fa off), so
    under fa-off C offered q8_0 and got refused (issue 37), and F to fa-off under a quantized V is refused too.
    Everything else llama.cpp judges when it reloads the context."""
    k = key.strip().lower().replace("_", "-")
    if k in ("cache", "cache-type", "cache-type-v"):
        v_type = str(value).split("/")[-1]
        if v_type in QUANTIZED and now.get("attn-impl") == "fa-off":
            return f"a quantized V cache ({v_type}) needs flash attention, off in this run (press F first)"
    elif k in ("attn-impl", "impl", "flash") and str(value).strip().lower() == "fa-off":
        v_type = str(now.get("cache", "")).split("/")[-1]
        if v_type in QUANTIZED:
            return f"llama.cpp needs flash attention for the quantized V cache ({v_type}): switch the cache first"
    return None


def llamacpp_missing() -> str | None:
    """None when llama-cpp-python is installed, else why not, without importing it (the window's process
    never loads llama.cpp; a broken build is found, and said, by the engine process when a run loads)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return ("llama-cpp-python is not installed: pip install 'llama-cpp-python==0.3.36' (it builds llama.cpp "
            "from source, a few minutes)")

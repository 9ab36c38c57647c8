"""The runtimes KV Scope can drive, by name: the one place that lists them.

Each entry is a ``RuntimeInfo`` (``kvscope.core.runtimes.base``): the name, where its ``open`` lives (imported only
when a run starts, so the window's process never imports torch, llama_cpp or mlx) and what it can do.
Nothing outside a runtime's own module compares a runtime's name: the command line, the engine process and
the window ask this registry (``get``, ``runtime_for_source``, ``check_switch``) and read the answers.

Adding a runtime is one module (or package) implementing ``kvscope.core.runtimes.base.Runtime`` and one
``register(RuntimeInfo(...))`` line below (a test registers its own the same way, at run time).
"""

from __future__ import annotations

import re
from typing import Any

from kvscope.core.model.attention import SettingsError
from kvscope.core.runtimes.base import OPTIONS, Runtime, RuntimeInfo, resolve

__all__ = ["OPTIONS", "Runtime", "RuntimeInfo", "DEFAULT", "register", "unregister", "get", "find", "names",
           "reloads_cache", "open_runtime",
           "runtime_for_source", "claimed_by", "check_switch", "parse_switch", "missing", "resolve",
           "calculators", "switch_problem", "source_entry"]

#: The runtime of a run that names none (and of every recording made before runtimes had names).
DEFAULT = "transformers"

_REGISTRY: dict[str, RuntimeInfo] = {}


def register(info: RuntimeInfo, *, replace: bool = False) -> RuntimeInfo:
    """Add a runtime; ValueError if the name is taken (unless ``replace``) or empty. Returns ``info``."""
    if not info.name or not isinstance(info.name, str):
        raise ValueError("a runtime needs a name")
    if info.name in _REGISTRY and not replace and _REGISTRY[info.name] != info:
        raise ValueError(f"a runtime named {info.name!r} is already registered")
    _REGISTRY[info.name] = info
    return info


def unregister(name: str) -> None:
    """Remove a runtime (a test's own, after the test)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered runtimes' names, in registration order (``--runtime``'s choices)."""
    return tuple(_REGISTRY)


def get(name: str | None) -> RuntimeInfo:
    """The runtime called ``name`` (None: the default); SettingsError names the choices."""
    info = _REGISTRY.get(name or DEFAULT)
    if info is None:
        raise SettingsError(f"unknown runtime {name!r}; choose one of {', '.join(_REGISTRY)}")
    return info


def find(name: str | None) -> RuntimeInfo | None:
    """The runtime called ``name``, or None (a recording's runtime this build does not have)."""
    return _REGISTRY.get(name or DEFAULT)


def reloads_cache(name: str | None) -> bool:
    """Whether a cache switch reloads the runtime's whole context (the window says "reload with q8_0 KV")."""
    info = find(name)
    return bool(info and info.cache_switch_reloads)


def open_runtime(request: Any, progress: Any = lambda text: None) -> Runtime:
    """The Runtime for ``request.runtime``, checked and ready to ``load()`` (this imports the runtime)."""
    info = get(getattr(request, "runtime", None))
    problem = missing(info.name)
    if problem:
        raise SettingsError(problem)
    return info.hook("open")(request, progress)


def missing(name: str) -> str | None:
    """Why the runtime ``name`` cannot run here (not installed), else None; never imports it."""
    hook = get(name).hook("missing")
    return hook() if hook is not None else None


def runtime_for_source(source: str | None) -> str:
    """The runtime a model source runs in when none is named: the first that claims it, else the default."""
    return claimed_by(source) or DEFAULT


def claimed_by(source: str | None) -> str | None:
    """The runtime that claims a model source as its own (llama.cpp: a GGUF), or None when none does."""
    text = str(source or "").strip()
    for info in _REGISTRY.values():
        claims = info.hook("claims")
        if claims is not None and text and claims(text):
            return info.name
    return None


def calculators() -> dict[str, Any]:
    """The Calculator tab's rules per runtime that has some (``RuntimeInfo.calculator``), in registration order."""
    return {info.name: info.hook("calculator") for info in _REGISTRY.values() if info.calculator is not None}


def switch_problem(name: str | None, *args: Any, **kwargs: Any) -> str | None:
    """Why a live switch cannot run under the runtime ``name`` (its ``switch_problem`` hook), or None: also where the
    runtime judges none ahead (its own choices say what it reloads) or is not registered here."""
    info = find(name)
    hook = info.hook("switch_problem") if info is not None else None
    return hook(*args, **kwargs) if hook is not None else None


def source_entry(name: str | None) -> str | None:
    """The window's Source list entry of the runtime ``name`` (``RuntimeInfo.source_entry``), or None."""
    info = find(name)
    return info.source_entry if info is not None else None


def check_switch(name: str | None, key: str, value: str) -> tuple[str, Any]:
    """A switch ``key=value`` checked for the runtime ``name`` before the run (SettingsError: why not)."""
    parse = get(name).hook("parse_switch")
    if parse is None:
        return key, value
    return parse(key, value)


def parse_switch(text: str, runtime: str = DEFAULT) -> tuple[int, str, str]:
    """Parse ``T:KEY=VALUE`` (e.g. ``32:attention=mqa``); the value is validated now, not at token T.
    Each runtime checks its own keys (``check_switch``): llama.cpp's are ``32:cache-type=q8_0``,
    ``64:context=8192``."""
    spelled = str(text).strip()
    at, sep, rest = spelled.partition(":")
    key, eq, value = rest.partition("=")
    # ASCII digits only: str.isdigit() also accepts "²" and "٣", which int() then refuses or reads.
    if not sep or not eq or not re.fullmatch(r"[0-9]+", at.strip()):
        raise SettingsError(f"--switch {spelled!r}: write T:KEY=VALUE, e.g. 32:attention=mqa or 64:attn-impl=eager")
    check_switch(runtime, key, value)  # each runtime's own keys (llama.cpp: cache-type, context)
    return int(at), key.strip().lower().replace("_", "-"), value.strip().lower()


# ------------------------------------------------------------------------------------------------ the entries

register(RuntimeInfo(
    name="transformers", open="kvscope.core.runtimes.transformers.runtime:open_runtime",
    label="transformers (the model in torch)", parse_switch="kvscope.core.model.settings:parse_switch_value",
    supports=frozenset(OPTIONS), calculator="kvscope.core.runtimes.transformers.calc:RULES",
    switch_problem="kvscope.core.model.settings:switch_problem"))
register(RuntimeInfo(
    name="llama.cpp", open="kvscope.core.runtimes.llamacpp.runtime:open_runtime",
    label="llama.cpp (a GGUF in the real llama.cpp, in its own process)",
    parse_switch="kvscope.core.runtimes.llamacpp.switches:parse_llamacpp_switch_value", claims="kvscope.core.model.gguf:is_gguf_source",
    missing="kvscope.core.runtimes.llamacpp.switches:llamacpp_missing", cli_options="kvscope.core.runtimes.llamacpp.runtime:cli_options",
    calc="kvscope.core.runtimes.llamacpp.calc:calc_text", calculator="kvscope.core.runtimes.llamacpp.calc:RULES",
    source_entry="llamacpp", cache_switch_reloads=True, reserves_at_load=True,
    switch_problem="kvscope.core.runtimes.llamacpp.switches:llamacpp_switch_problem"))
register(RuntimeInfo(
    name="mlx", open="kvscope.core.runtimes.mlx.runtime:open_runtime",
    label="MLX (mlx-lm: Metal on a Mac, the CPU elsewhere)",
    parse_switch="kvscope.core.runtimes.mlx.switches:parse_switch", missing="kvscope.core.runtimes.mlx.switches:mlx_missing",
    cli_options="kvscope.core.runtimes.mlx.switches:cli_options", calc="kvscope.core.runtimes.mlx.calc:calc_text",
    source_entry="mlx", reserves_at_load=False))

"""The runtimes KV Scope can drive, by name: the one place that lists them.

Each entry is a ``RuntimeInfo`` (``kvscope.core.runtimes.base``): the name, where its ``open`` lives (imported only
when a run starts, so the window's process never imports torch, llama_cpp or mlx) and what it can do.
Nothing outside a runtime's own module compares a runtime's name: the command line, the engine process and
the window ask this registry (``get``, ``runtime_for_source``, ``check_switch``) and read the answers. A runtime
brings everything a user touches through its entry: its options (a frozen dataclass, ``options_of``), its
command-line flags (``add_flags``, parsed by its ``cli_options``), its Source list entries (``source_entries``) and
how the window's form becomes its request (``form_request``), and the engine host's hooks (``host_start``,
``preload``, ``prepare_switch``).

Adding a runtime is one module (or package) implementing ``kvscope.core.runtimes.base.Runtime`` and one
``register(RuntimeInfo(...))`` line below (a test registers its own the same way, at run time).
"""

from __future__ import annotations

import re
from typing import Any

from kvscope.core.model.attention import SettingsError
from kvscope.core.runtimes.base import OPTIONS, Runtime, RuntimeInfo, SourceEntry, resolve

__all__ = ["OPTIONS", "Runtime", "RuntimeInfo", "DEFAULT", "register", "unregister", "get", "find", "names",
           "reloads_cache", "open_runtime",
           "runtime_for_source", "claimed_by", "check_switch", "parse_switch", "missing", "resolve",
           "calculators", "switch_problem", "SourceEntry", "source_entries", "entry_runtime", "runs_kind",
           "options_of", "add_flags", "form_request", "host_start", "preload", "prepare_switch", "auto_device"]

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


def source_entries(name: str | None = None) -> list[tuple[str, SourceEntry]]:
    """(runtime, entry) for each Source list entry the runtimes bring (``RuntimeInfo.source_entries``), in
    registration order; only ``name``'s where given."""
    out = []
    for info in _REGISTRY.values():
        hook = info.hook("source_entries")
        if hook is not None and (name is None or info.name == (name or DEFAULT)):
            out.extend((info.name, entry) for entry in hook())
    return out


def entry_runtime(key: str | None) -> str | None:
    """The runtime the Source entry ``key`` runs, or None (an entry of the window's own: embedded, a folder...)."""
    return next((name for name, entry in source_entries() if entry.key == key), None) if key else None


def runs_kind(kind: str | None) -> SourceEntry | None:
    """The Source entry whose runtime runs an installed model of ``kind`` (``InstalledModel.kind``: a GGUF, an MLX
    folder), or None where the default runtime does."""
    return next((entry for _, entry in source_entries() if kind and kind in entry.installed_kinds), None)


def options_of(request: Any, name: str | None = None) -> Any:
    """The options of the runtime ``name`` (default: the request's) in ``request``, else that runtime's defaults
    (its ``options`` called with no argument); None for a runtime that takes none."""
    name = name or getattr(request, "runtime", None) or DEFAULT
    given = request.options_for(name) if hasattr(request, "options_for") else None
    if given is not None:
        return given
    make = get(name).hook("options")
    return make() if make is not None else None


def add_flags(parser: Any, command: str) -> dict[str, tuple[float, float, str]]:
    """Every runtime's own flags on ``parser`` (``run``'s or ``calc``'s: ``command``); the ranges of their whole
    numbers, by dest."""
    ranges: dict[str, tuple[float, float, str]] = {}
    for info in _REGISTRY.values():
        hook = info.hook("add_flags")
        if hook is not None:
            ranges.update(hook(parser, command) or {})
    return ranges


def form_request(name: str | None, form: Any) -> Any:
    """The request the window's form (``kvscope.core.model.request.RunForm``) makes for the runtime ``name``
    (its ``form_request``, else the default runtime's); SpecError where the runtime is not installed."""
    info = get(name)
    problem = missing(info.name)
    if problem:
        from kvscope.core.model.spec import SpecError

        raise SpecError(problem)
    hook = info.hook("form_request") or get(DEFAULT).hook("form_request")
    return hook(form)


def host_start() -> None:
    """Every runtime's ``host_start`` hook, once, in the engine's process before its first command."""
    for info in _REGISTRY.values():
        hook = info.hook("host_start")
        if hook is not None:
            hook()


def preload(request: Any) -> None:
    """The request's runtime loads its model ahead, where it has a ``preload`` hook; nothing otherwise."""
    info = find(getattr(request, "runtime", None))
    hook = info.hook("preload") if info is not None else None
    if hook is not None:
        hook(request)


def prepare_switch(name: str | None, key: str, value: str) -> str | None:
    """None when the live switch ``key=value`` of a ``name`` run can apply now; else what it waits for (the
    runtime's ``prepare_switch`` hook has started preparing it: ask again at the next token)."""
    info = find(name)
    hook = info.hook("prepare_switch") if info is not None else None
    return hook(key, value) if hook is not None else None


def auto_device() -> str:
    """What ``--device auto`` means in this process, by the default runtime (``cpu`` where it cannot tell)."""
    hook = get(DEFAULT).hook("auto_device")
    try:
        return hook() if hook is not None else "cpu"
    except Exception:  # noqa: BLE001 - a runtime that cannot tell: host memory is what there is
        return "cpu"


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
    label="transformers (the model in torch)", parse_switch="kvscope.core.runtimes.transformers.switches:parse_switch_value",
    supports=frozenset(OPTIONS), calculator="kvscope.core.runtimes.transformers.calc:RULES",
    switch_problem="kvscope.core.runtimes.transformers.switches:switch_problem", form_request="kvscope.core.runtimes.transformers.form:form_request",
    host_start="kvscope.core.runtimes.transformers.host:host_start", preload="kvscope.core.runtimes.transformers.runtime:preload_model",
    prepare_switch="kvscope.core.runtimes.transformers.host:prepare_switch", auto_device="kvscope.core.runtimes.transformers.host:auto_device"))
register(RuntimeInfo(
    name="llama.cpp", open="kvscope.core.runtimes.llamacpp.runtime:open_runtime",
    label="llama.cpp (a GGUF in the real llama.cpp, in its own process)",
    parse_switch="kvscope.core.runtimes.llamacpp.switches:parse_llamacpp_switch_value", claims="kvscope.core.model.gguf:is_gguf_source",
    missing="kvscope.core.runtimes.llamacpp.switches:llamacpp_missing", options="kvscope.core.prediction.llamacpp:LlamaCppOptions",
    add_flags="kvscope.core.runtimes.llamacpp.cli:add_flags", cli_options="kvscope.core.runtimes.llamacpp.cli:cli_options",
    source_entries="kvscope.core.runtimes.llamacpp.cli:source_entries", form_request="kvscope.core.runtimes.llamacpp.cli:form_request",
    self_test="kvscope.core.runtimes.llamacpp.cli:self_test",
    calc="kvscope.core.runtimes.llamacpp.calc:calc_text", calculator="kvscope.core.runtimes.llamacpp.calc:RULES",
    cache_switch_reloads=True, reserves_at_load=True,
    switch_problem="kvscope.core.runtimes.llamacpp.switches:llamacpp_switch_problem"))
register(RuntimeInfo(
    name="mlx", open="kvscope.core.runtimes.mlx.runtime:open_runtime",
    label="MLX (mlx-lm: Metal on a Mac, the CPU elsewhere)",
    parse_switch="kvscope.core.runtimes.mlx.switches:parse_switch", missing="kvscope.core.runtimes.mlx.switches:mlx_missing",
    options="kvscope.core.runtimes.mlx.switches:MlxOptions", add_flags="kvscope.core.runtimes.mlx.switches:add_flags",
    cli_options="kvscope.core.runtimes.mlx.switches:cli_options", source_entries="kvscope.core.runtimes.mlx.switches:source_entries",
    form_request="kvscope.core.runtimes.mlx.switches:form_request", calc="kvscope.core.runtimes.mlx.calc:calc_text",
    reserves_at_load=False))

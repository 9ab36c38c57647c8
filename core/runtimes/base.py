"""The seam every runtime implements: ``Runtime`` (the live model) and ``RuntimeInfo`` (what is known without it).

A runtime is something that generates tokens and can say what its KV cache costs: transformers (the model in
torch, ``kvscope.core.runtimes.transformers.runtime``), llama.cpp (a GGUF in the real llama.cpp, ``kvscope.core.runtimes.llamacpp.runtime``),
MLX, or a tiny one written in the tests. One run loop (``kvscope.core.live.run.run_generation``) drives every runtime:
the recording, the events, scripted and live switches, pause/stop, the memory budget, the end of the run.
A runtime only answers the loop's questions; it never opens a recording, polls a command or formats an error.

The loop calls, in order::

    runtime = info.open(request, progress)   # checks before anything loads; SettingsError etc. to refuse
    runtime.load()                           # the heavy part (weights, a native context)
    info = runtime.model_info()              # -> hooks.loaded; runtime.settings(request) -> recording header
    for s in runtime.start_events(request): emit(s)      # "load", "note"...
    for s in runtime.prefill(request): emit(s)           # the prefill Sample first, then notes
    while runtime.generated < request.max_new_tokens:
        ... runtime.apply(key, value) -> one event Sample: "switch", "refused" or "note" (never raises to refuse)
        ... runtime.room() -> None, or the note that ends the run (a full context)
        ... runtime.budget_need(1) (only where ``info.supports`` has "memory_budget")
        sample = runtime.step()
    runtime.close()                          # always, in a finally

Every Sample a runtime makes carries ``runtime=<its name>``, the settings in force, and both KV figures:
``kv_bytes_held`` (the bytes of the tokens' K/V) and ``kv_bytes_reserved`` (what the runtime set aside for
the cache: equal to held where it reserves nothing ahead), with ``kv_bytes_predicted`` the predictor's figure
for ``kv_bytes_reserved``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:  # plain types only: this module is imported by the window's process
    from kvscope.core.base.sample import Sample
    from kvscope.core.model.request import ModelInfo, RunRequest
    from kvscope.core.model.spec import ModelSpec

#: Request options beyond the common ones (model, prompt, tokens, switches, record, seed) that a runtime may take.
OPTIONS = ("memory_budget", "snapshot", "quality_probe", "max_context")


@runtime_checkable
class Runtime(Protocol):
    """A loaded (or loading) model in one runtime, driven by ``kvscope.core.live.run.run_generation`` on one thread."""

    #: The registry name, also every Sample's ``runtime``.
    name: str
    #: The model's description (None until known: a hub model's comes with its weights).
    spec: "ModelSpec | None"
    #: Tokens generated so far (0 after the prefill); the loop runs while it is below ``max_new_tokens``.
    generated: int

    def load(self) -> None:
        """Load the weights / create the context. Raises a ``KVScopeError`` to refuse (one line)."""

    def model_info(self) -> "ModelInfo":
        """What the window shows and can switch (``ModelInfo``: choices, device, memory, max context)."""

    def settings(self, request: "RunRequest") -> dict[str, Any]:
        """The recording header's ``settings``: plain JSON, ``runtime`` included."""

    def start_events(self, request: "RunRequest") -> list["Sample"]:
        """Events after loading, before the prefill: at least ``load``; notes about settings adjusted."""

    def prefill(self, request: "RunRequest") -> list["Sample"]:
        """Run the prompt; the prefill Sample first, then any notes it leads to."""

    def step(self) -> "Sample":
        """Generate one token and measure: a ``decode`` Sample."""

    def apply(self, key: str, value: str) -> "Sample":
        """A switch between two tokens, as one event Sample: ``switch`` (done), ``refused`` (nothing changed,
        the reason in ``text``) or ``note`` (nothing to do). Never raises to refuse."""

    def event(self, kind: str, text: str, **fields: Any) -> "Sample":
        """An event Sample (``load``, ``note``, ``error``, ``stop``...) carrying the current measurements."""

    def room(self) -> str | None:
        """None while another token fits; else the note that ends the run (llama.cpp: the context is full)."""

    def plan(self, tokens: int) -> int | None:
        """The predicted KV bytes (``kv_bytes_reserved``) at ``tokens`` tokens under the settings in force."""

    def budget_need(self, ahead: int) -> int | None:
        """Bytes the memory budget counts once ``ahead`` more tokens are in the context (1: the next token),
        by ``kvscope.core.prediction.forecast.budget_used`` (weights + KV + activations); None where it takes no budget."""

    def out_of_memory(self, exc: BaseException, where: str) -> str | None:
        """If ``exc`` is running out of memory: free the cache and return the ``oom`` event's text; else None."""

    def error_context(self) -> str:
        """Where a failure happened, for an ``error`` event: '(at token 12; attention mha, cache dynamic)'."""

    def close(self) -> None:
        """Free everything (idempotent); the loop calls it in a ``finally``."""


Opener = Callable[["RunRequest", Callable[[str], None]], Runtime]


@dataclass(frozen=True)
class RuntimeInfo:
    """A runtime as the registry knows it, without importing it: its name, how to open one, and what it can do.

    ``open`` and the hooks are ``"module:attribute"`` strings (imported only when used, so the window's
    process never imports torch, llama_cpp or mlx) or callables (a runtime written in a test)."""

    #: The registry name (``--runtime NAME``, ``Sample.runtime``, the recording's ``settings.runtime``).
    name: str
    #: ``open(request, progress) -> Runtime``: checks, then a Runtime to ``load()`` (the engine's side).
    open: "str | Opener"
    #: One line for menus and help.
    label: str = ""
    #: ``parse_switch(key, value) -> (key, parsed)``: a ``--switch``/window switch checked before the run
    #: (SettingsError says why not). Must not import the ML stack.
    parse_switch: "str | Callable[[str, str], tuple[str, Any]] | None" = None
    #: ``claims(source) -> bool``: a model source this runtime runs when ``--runtime`` is not given (a .gguf).
    claims: "str | Callable[[str], bool] | None" = None
    #: ``missing() -> str | None``: why this runtime cannot run here (a package not installed), else None.
    missing: "str | Callable[[], str | None] | None" = None
    #: ``options``: the runtime's options, a frozen dataclass it owns (called with no argument: the defaults); a run's
    #: are ``RunRequest.options[name]`` (``kvscope.core.runtimes.options_of``). None: it takes none.
    options: "str | type | None" = None
    #: ``add_flags(parser, command) -> ranges``: its own command-line flags on ``run``'s or ``calc``'s parser
    #: (``command``), in an argument group of its own; returns ``{dest: (lowest, highest, what it counts)}`` for
    #: the whole-number flags, which the command line checks as it parses (``main.NUMBER_RANGES``'s rule).
    add_flags: "str | Callable[[Any, str], dict[str, tuple[float, float, str]] | None] | None" = None
    #: ``cli_options(args) -> options``: its options from its flags (SettingsError to refuse, e.g. another runtime's
    #: flag given to it). None: it has no flags of its own.
    cli_options: "str | Callable[[Any], Any] | None" = None
    #: ``calc(args, spec, contexts, gpu_memory) -> str``: ``calc --runtime NAME``'s answer (a table, or JSON with
    #: ``args.json``) from the predictor alone, with the runtime's own flags. None: calc answers for transformers.
    calc: "str | Callable[[Any, Any, list[int], int | None], str] | None" = None
    #: The request options (``OPTIONS``) it takes; the command line refuses the others in one line.
    supports: frozenset[str] = field(default_factory=frozenset)
    #: The cache switch reloads the whole context (llama.cpp): the window says "reload with q8_0 KV".
    cache_switch_reloads: bool = False
    #: The KV cache is reserved for the whole context at load (the window's numbers panel says "prepaid").
    reserves_at_load: bool = False
    #: ``calculator``: the Calculator tab's rules for this runtime (``kvscope.core.runtimes.calculator.CalcRules``: its rows, caches,
    #: the inputs it reads); None: the tab does not offer it. Must not import the ML stack.
    calculator: "str | Any | None" = None
    #: ``switch_problem(spec, device, now, key, value, tokens) -> str | None``: why a live switch cannot run from the
    #: settings ``now``, judged before it is sent (the window greys what it cannot apply); None: not judged ahead.
    switch_problem: "str | Callable[..., str | None] | None" = None
    #: ``source_entries() -> tuple[SourceEntry, ...]``: the window's Source list entries that run this runtime.
    source_entries: "str | Callable[[], tuple[SourceEntry, ...]] | None" = None
    #: ``form_request(form) -> RunRequest``: the request the window's controls (a ``RunForm``) make for this
    #: runtime; SettingsError / SpecError (one line) to refuse. None: the default runtime's.
    form_request: "str | Callable[[Any], Any] | None" = None
    #: ``host_start()``: once in the engine's process before any command (its slow imports, its threads).
    host_start: "str | Callable[[], None] | None" = None
    #: ``preload(request)``: load the model of the run the window is about to ask for, before it asks.
    preload: "str | Callable[[Any], None] | None" = None
    #: ``prepare_switch(key, value) -> str | None``: None when the live switch ``key=value`` can apply at the next
    #: token; else what it waits for (its progress line: the engine host asks again each token while it builds).
    prepare_switch: "str | Callable[[str, str], str | None] | None" = None
    #: ``self_test() -> (request, check)``: ``kvscope --self-test``'s part for this runtime: a short run and the check
    #: of its decoded Samples (``check(decoded) -> str``, the summary; ValueError: the one line why it failed).
    self_test: "str | Callable[[], tuple[Any, Callable[[list], str]]] | None" = None
    #: ``auto_device() -> str``: what ``--device auto`` means in this process (the engine host asks the default
    #: runtime's).
    auto_device: "str | Callable[[], str] | None" = None

    def hook(self, name: str) -> Any:
        """The hook ``name`` (``open``, ``parse_switch``, ``options``, ``add_flags``, ``source_entries``...) resolved,
        or None."""
        return resolve(getattr(self, name))


@dataclass(frozen=True)
class SourceEntry:
    """One entry of the window's Source list that runs a runtime of its own (plain data: the window draws it).

    ``key`` is the entry's data (and its saved name); ``file_field`` gives it a path field with a browse button
    (``placeholder``, ``file_filter``: the dialog's filter); ``installed_kinds``: the installed models'
    ``InstalledModel.kind`` it runs (an Ollama GGUF, an MLX folder), each with its tooltip word in
    ``kind_labels``; ``saved_as``: the window's settings key of its file field (default ``file_<key>``)."""

    key: str
    label: str
    tooltip: str = ""
    file_field: bool = False
    placeholder: str = ""
    file_filter: str = "All files (*)"
    installed_kinds: tuple[str, ...] = ()
    kind_labels: tuple[tuple[str, str], ...] = ()
    saved_as: str = ""


def resolve(ref: Any) -> Any:
    """A ``"module:attribute"`` string imported and looked up; a callable (or None) as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    target = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target

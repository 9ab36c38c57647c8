"""What a run is asked to do and what it reports about its model: plain data, no torch.

The window, the replay and the command line build ``RunRequest``s and read ``ModelInfo``s without
loading the ML stack; only the engine (``kvscope.core.runtimes.transformers.engine`` and ``kvscope.core.live.run``, in the engine process) imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from kvscope.core.base.sample import Sample
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.spec import ModelSpec

DEFAULT_PROMPT = "Every token keeps a key and a value in every layer, so the cache grows: "


@dataclass(frozen=True)
class RunRequest:
    """Everything a run needs, from the command line or the window."""

    source: str = "embedded"
    device: str = "auto"
    dtype: str = "auto"
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 128
    settings: RunSettings = field(default_factory=RunSettings)
    switches: tuple[tuple[int, str, str], ...] = ()  # (after N generated tokens, key, value)
    record_path: str | None = None
    overwrite: bool = False  # --force: an existing record_path / snapshot_path may be replaced (regular files only)
    trust_remote_code: bool = False
    allow_pickle: bool = False
    memory_budget: int | None = None  # bytes the model may use: weights + KV + activations
    snapshot_path: str | None = None
    seed: int = 0
    #: Also run every token through the model as loaded (teacher-forced, whatever was switched) and report top-1
    #: agreement and the KL divergence of the next-token distributions; costs a second forward pass and a second cache.
    quality_probe: bool = False
    #: A name in ``kvscope.core.runtimes``' registry (``kvscope.core.runtimes.names()``).
    runtime: str = "transformers"
    #: Each runtime's own options, keyed by its registry name: a frozen dataclass the runtime owns (its command-line
    #: flags and its Source entry make it; ``kvscope.core.runtimes.options_of`` gives the run's, or its default).
    #: Given as a dict or pairs; kept as sorted (name, options) pairs so that the request stays hashable.
    options: Any = ()
    #: What the user calls the model, where the source's own name says less (an installed model's repo id for a
    #: Hugging Face cache snapshot named by its hash, the Ollama tag for a blob named by its digest): shown as the
    #: model's label in the title, the badge and the events. None: the runtime's own label.
    label: str | None = None


    def __post_init__(self) -> None:
        pairs = self.options.items() if isinstance(self.options, Mapping) else (self.options or ())
        object.__setattr__(self, "options", tuple(sorted(((str(k), v) for k, v in dict(pairs).items()),
                                                          key=lambda kv: kv[0])))

    def options_for(self, runtime: str) -> Any:
        """The options given for ``runtime`` (its own frozen dataclass), or None where none were given."""
        return dict(self.options).get(runtime)

    def with_options(self, runtime: str, value: Any) -> "RunRequest":
        """This request with ``value`` as the options of ``runtime`` (the others kept)."""
        return replace(self, options={**dict(self.options), runtime: value})


@dataclass(frozen=True)
class RunForm:
    """What the window's controls hold when Start is pressed, as plain data: a runtime's ``form_request`` hook
    (``kvscope.core.runtimes.form_request``) turns it into that runtime's RunRequest."""

    source: str = "embedded"
    #: The Source entry chosen that runs the model in a runtime of its own (its ``SourceEntry.key``), or None.
    entry: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    attention: str = ""  # the Attention combo ("": as built)
    attn_impl: str = "sdpa"  # the Kernel combo
    cache: str = "dynamic"  # the Cache combo: a key of the runtime shown last (it may be another runtime's)
    max_context: int | None = None  # the Max context spin (None: the model's maximum)
    #: The context the model's store sets (Ollama's num_ctx), used where Max context is left at the model's.
    store_context: int | None = None
    max_new_tokens: int = 128
    prompt: str = ""  # "": the default prompt
    memory_budget: int | None = None
    quality_probe: bool = False

    def common(self) -> dict[str, Any]:
        """The RunRequest fields every runtime's request takes from the form: source, tokens and the prompt."""
        out: dict[str, Any] = dict(source=self.source, max_new_tokens=self.max_new_tokens)
        if self.prompt:
            out["prompt"] = self.prompt
        return out


@dataclass(frozen=True)
class ModelInfo:
    """What the window shows about the loaded model and what it can switch to."""

    label: str
    source: str
    device: str
    device_name: str
    dtype: str
    spec: ModelSpec
    total_memory: int | None
    attention_choices: tuple[str, ...]
    cache_choices: tuple[tuple[str, str | None], ...]
    attn_impl_choices: tuple[str, ...]
    max_context: int | None = None  # the run's context limit (the model's maximum unless set lower)
    runtime: str = "transformers"  # the registry name of the runtime that loaded it (``kvscope.core.runtimes``)


@dataclass
class RunHooks:
    """How the run loop (``kvscope.core.live.run.run_generation``, every runtime's) talks to its host (terminal or Qt worker).
    All optional."""

    emit: Callable[[Sample], None] = lambda s: None
    loaded: Callable[[ModelInfo], None] = lambda info: None
    progress: Callable[[str], None] = lambda text: None
    # Returns pending (key, value) switches; may block while paused. Called between tokens.
    poll: Callable[[], list[tuple[str, str]]] = lambda: []
    should_stop: Callable[[], bool] = lambda: False


#: The seeds torch's generator takes (``torch.Generator.manual_seed``): 0 to 2**64 - 1.
MAX_SEED = 2**64 - 1


def check_seed(seed: int) -> int:
    """A sampling seed, or SettingsError (``--seed 2**70`` used to end in torch's "Overflow when unpacking long")."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SettingsError(f"--seed {seed}: a seed is a whole number from 0 to 2**64 - 1 ({MAX_SEED:,})")
    return seed

"""What a run is asked to do and what it reports about its model: plain data, no torch.

The window, the replay and the command line build ``RunRequest``s and read ``ModelInfo``s without
loading the ML stack; only the engine (``kvscope.core.runtimes.transformers.engine`` and ``kvscope.core.live.run``, in the engine process) imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    #: A name in ``kvscope.core.runtimes``' registry: "transformers" (the model in torch), "llama.cpp" (a GGUF in the
    #: real llama.cpp, in a child process)...
    runtime: str = "transformers"
    #: llama.cpp's context options (``kvscope.core.prediction.llamacpp.LlamaCppOptions``) for a llama.cpp run.
    llamacpp: Any = None
    #: MLX's cache options (``kvscope.core.runtimes.mlx.switches.MlxOptions``: mlx-lm's flags) for an MLX run.
    mlx: Any = None
    #: What the user calls the model, where the source's own name says less (an installed model's repo id for a
    #: Hugging Face cache snapshot named by its hash, the Ollama tag for a blob named by its digest): shown as the
    #: model's label in the title, the badge and the events. None: the runtime's own label.
    label: str | None = None


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

"""What a run is asked to do and what it reports about its model: plain data, no torch.

The window, the replay and the command line build ``RunRequest``s and read ``ModelInfo``s without
loading the ML stack; only the engine (``core.engine`` and ``core.run``, in the engine process) imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from core.attention import SettingsError
from core.llamacpp import cache_type
from core.sample import Sample
from core.settings import RunSettings
from core.spec import ModelSpec, parse_tokens

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
    #: Also run every token through a full-cache twin (teacher-forced) and report top-1 agreement and the KL
    #: divergence of the next-token distributions; costs a second forward pass and a second cache.
    quality_probe: bool = False
    #: A name in ``core.runtimes``' registry: "transformers" (the model in torch), "llama.cpp" (a GGUF in the
    #: real llama.cpp, in a child process)...
    runtime: str = "transformers"
    #: llama.cpp's context options (``core.llamacpp.LlamaCppOptions``) for ``runtime == "llama.cpp"``.
    llamacpp: Any = None
    #: MLX's cache options (``core.runtimes.mlx.switches.MlxOptions``: mlx-lm's flags) for ``runtime == "mlx"``.
    mlx: Any = None


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
    runtime: str = "transformers"  # the registry name of the runtime that loaded it (``core.runtimes``)


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


@dataclass
class RunHooks:
    """How the run loop (``core.run.run_generation``, every runtime's) talks to its host (terminal or Qt worker).
    All optional."""

    emit: Callable[[Sample], None] = lambda s: None
    loaded: Callable[[ModelInfo], None] = lambda info: None
    progress: Callable[[str], None] = lambda text: None
    # Returns pending (key, value) switches; may block while paused. Called between tokens.
    poll: Callable[[], list[tuple[str, str]]] = lambda: []
    should_stop: Callable[[], bool] = lambda: False


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


#: The seeds torch's generator takes (``torch.Generator.manual_seed``): 0 to 2**64 - 1.
MAX_SEED = 2**64 - 1


def check_seed(seed: int) -> int:
    """A sampling seed, or SettingsError (``--seed 2**70`` used to end in torch's "Overflow when unpacking long")."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SettingsError(f"--seed {seed}: a seed is a whole number from 0 to 2**64 - 1 ({MAX_SEED:,})")
    return seed

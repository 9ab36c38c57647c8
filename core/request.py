"""What a run is asked to do and what it reports about its model: plain data, no torch.

The window, the replay and the command line build ``RunRequest``s and read ``ModelInfo``s without
loading the ML stack; only the engine (``core.engine`` and ``core.run``, in the engine process) imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from core.attention import SettingsError
from core.settings import RunSettings, parse_switch_value
from core.spec import ModelSpec

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


def parse_switch(text: str) -> tuple[int, str, str]:
    """Parse ``T:KEY=VALUE`` (e.g. ``32:attention=mqa``); the value is validated now, not at token T."""
    spelled = str(text).strip()
    at, sep, rest = spelled.partition(":")
    key, eq, value = rest.partition("=")
    # ASCII digits only: str.isdigit() also accepts "²" and "٣", which int() then refuses or reads.
    if not sep or not eq or not re.fullmatch(r"[0-9]+", at.strip()):
        raise SettingsError(f"--switch {spelled!r}: write T:KEY=VALUE, e.g. 32:attention=mqa or 64:attn-impl=eager")
    parse_switch_value(key, value)
    return int(at), key.strip().lower().replace("_", "-"), value.strip().lower()


#: The seeds torch's generator takes (``torch.Generator.manual_seed``): 0 to 2**64 - 1.
MAX_SEED = 2**64 - 1


def check_seed(seed: int) -> int:
    """A sampling seed, or SettingsError (``--seed 2**70`` used to end in torch's "Overflow when unpacking long")."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SettingsError(f"--seed {seed}: a seed is a whole number from 0 to 2**64 - 1 ({MAX_SEED:,})")
    return seed

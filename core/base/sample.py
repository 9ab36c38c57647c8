"""Sample: one immutable observation of memory at one token (or one event), with its prediction.

Samples flow from the generation loop to the CLI table, the window's plots and recordings.
They carry their own settings, so a consumer never asks the worker what mode was active.
Memory the hardware cannot report is None ("not available"), never 0.

A Sample from an untrusted dict (a recording's line, ``Sample.from_dict``) goes through the one validator here,
``sample_from_json``: every field checked for type and range (the bounds below). ``kvscope.core.records.recording`` reads and
writes Samples through it; this module imports nothing of the project.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

PHASE_PREFILL = "prefill"
PHASE_DECODE = "decode"
PHASE_EVENT = "event"  # a switch, a load, an error: no token was generated

#: Counts and bytes are integers from 0 to this (what a signed 64-bit integer holds): a negative
#: byte count or a 400-digit token number is damage, not data.
MAX_INT = 2**63 - 1
#: The latest ``time_s`` a sample may carry (seconds since its run started; ~31 years).
MAX_TIME_S = 1e9
#: The highest ``tokens_per_s`` a sample may carry.
MAX_TOKENS_PER_S = 1e9
#: The longest setting or name a sample or header field may hold (attention, cache, device, event,
#: model name...): they are labels, shown in badges and tables. ``text`` is bounded by the line only.
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class Sample:
    """One row of the stream. Bytes are integers; times are seconds since the run started."""

    token: int  # generated tokens so far: 0 for the prefill, 1 for the first decoded token
    phase: str  # prefill | decode | event
    time_s: float
    text: str  # the token's text (prefill: the prompt); for events, what happened
    # settings in force, spelled as on the command line
    attention: str
    attn_impl: str
    cache: str
    kernel: str  # attention kernel a decode step dispatched, measured with the profiler (core/runtimes/transformers/kernels.py): eager, sdpa-math, sdpa-flash, sdpa-flash-cpu, sdpa-mem-efficient, sdpa-cudnn, flash_attention_2
    device: str
    dtype: str
    # observed
    kv_bytes_storage: int | None  # bytes of the storage blocks the cache tensors keep alive
    weights_bytes: int | None
    # The KV cache, two figures that each mean one thing for every runtime:
    kv_bytes_held: int | None = None  # the bytes of the tokens' K/V (what the cache holds now)
    #: What the runtime set aside for the cache: llama.cpp's allocation for the whole context at load (flat:
    #: the prepayment), a chunked cache's whole chunks; equal to ``kv_bytes_held`` where a runtime reserves
    #: nothing ahead (transformers: the cache's tensors). ``kv_bytes_predicted`` predicts this figure.
    kv_bytes_reserved: int | None = None
    allocator_allocated: int | None = None
    allocator_reserved: int | None = None
    allocator_peak: int | None = None
    device_used: int | None = None  # NVML (whole device)
    device_total: int | None = None
    process_gpu: int | None = None  # NVML, this process
    process_rss: int | None = None
    # predicted for the same instant
    kv_bytes_predicted: int | None = None
    weights_predicted: int | None = None
    activations_predicted: int | None = None
    #: A runtime's own measure of what it holds for activations, where it has one: llama.cpp's compute buffer
    #: (exact bytes, ``llama_get_memory_breakdown``), predicted by ``activations_predicted``.
    activations_observed: int | None = None
    total_predicted: int | None = None
    tokens_per_s: float | None = None
    event: str | None = None  # for phase == event: "switch", "load", "error", "oom", "budget"...
    context_tokens: int = 0  # tokens in the sequence (prompt + generated) at this instant
    # A switch, refused switch or no-op ("note") as data; ``text`` is the same said in words.
    switch_key: str | None = None  # attention | attn-impl | cache (the command line's spelling)
    switch_before: str | None = None  # the setting before
    switch_after: str | None = None  # the setting asked for (applied, unless the event is "refused")
    tokens_rerun: int | None = None  # tokens the switch ran through the model again (MLA, leaving a window...)
    # The quality probe (``--quality-probe``, off by default): the same tokens, teacher-forced, through the model as
    # loaded (its own K/V projections, attention and layer pattern, a full dynamic cache, its default kernel),
    # whatever the run switched (recording version 2; version 1's figures were against a full-cache twin of the
    # running model). Sequence 0, the distribution of the token after this one.
    quality_top1: int | None = None  # 1 when the run's most likely next token is the loaded model's, else 0
    quality_kl: float | None = None  # KL(loaded model || the run) of the next-token distributions, nats
    quality_token: int | None = None  # the loaded model's most likely next token (its id)
    quality_token_text: str | None = None  # that token's text (for the window, which has no tokenizer)
    #: Bytes the probe's own cache holds (the loaded model's full dynamic cache): KV Scope's memory, never part of
    #: ``kv_bytes_held`` / ``kv_bytes_reserved`` (the run's cache alone).
    quality_kv_bytes: int | None = None
    # The forward pass's peak beyond what was held before it (the allocator's high-water mark, kvscope.core.runtimes.transformers.peak), on the
    # prefill and on a switch's re-run only: measured, and as kvscope.core.prediction.predict.prefill_peak replays it.
    peak_bytes_observed: int | None = None
    peak_bytes_predicted: int | None = None
    # The host process's own figures where the runtime runs in the run loop's process (kvscope.core.base.host_memory):
    # ``runtime_baseline`` the process without its model (torch, transformers, the tokenizer, the engine), measured at
    # the load: the resident set less the weights and malloc's free pages then; ``host_retained`` the free pages
    # glibc's malloc keeps now (resident, held by no tensor: what freed transients and a switch's copies leave).
    runtime_baseline: int | None = None
    host_retained: int | None = None
    # The runtime that made the sample (a name in kvscope.core.runtimes' registry): data to show, never a branch.
    runtime: str = "transformers"

    @property
    def is_event(self) -> bool:
        return self.phase == PHASE_EVENT

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """Build a Sample from a (possibly untrusted) dict: unknown keys are dropped, every field's
        type and range checked, ValueError naming the first problem. The checks are the recording
        reader's (``sample_from_json``): one validator for every untrusted sample."""
        return sample_from_json(data)

    def replace(self, **changes: Any) -> "Sample":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------------- old names
# Before kv_bytes_held / kv_bytes_reserved, a recording's ``kv_bytes_observed`` was held under transformers and
# reserved under llama.cpp, and ``kv_bytes_used`` llama.cpp's held. They are no fields (never in a new recording or
# CSV): the recording reader maps an old line's onto the two (``sample_from_json``), so old recordings replay.


def legacy_kv_fields(fields: dict[str, Any], observed: int | None = None, used: int | None = None) -> dict[str, Any]:
    """``fields`` with an old line's ``kv_bytes_observed`` / ``kv_bytes_used`` mapped onto held and reserved:
    observed was the figure the prediction is of (reserved), and held too unless ``used`` (llama.cpp's cells that
    hold tokens) says otherwise."""
    if observed is not None:
        fields["kv_bytes_reserved"] = observed
    held = used if used is not None else observed
    if held is not None:
        fields["kv_bytes_held"] = held
    return fields


def is_plain_text(value: Any) -> bool:
    """A str that is valid Unicode (no lone surrogate, which ``json`` lets ``\\ud800`` make and no
    UTF-8 writer can write)."""
    if type(value) is not str:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for one-line messages about untrusted values."""
    if type(value) is int and value.bit_length() > 200:  # repr of a huge int is slow and useless
        return f"an integer of ~{int(value.bit_length() * 0.30103):,} digits"
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    text = repr(value[: limit + 1] if isinstance(value, str) else value)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


# ------------------------------------------------------------------------------------------------
# The one validator of untrusted samples (Sample.from_dict, and the recording reader and writer)


_PHASES = (PHASE_PREFILL, PHASE_DECODE, PHASE_EVENT)
_SAMPLE_FIELDS = dataclasses.fields(Sample)


def _field_kinds() -> dict[str, tuple[str, bool]]:
    """(kind, nullable) per Sample field, from its annotation: "int", "float", "str" or "any"."""
    kinds = {}
    for f in _SAMPLE_FIELDS:
        t = str(f.type)
        kind = ("int" if t.startswith("int") else "float" if t.startswith("float")
                else "str" if t.startswith("str") else "any")
        kinds[f.name] = (kind, "None" in t)
    return kinds


_KINDS = _field_kinds()
# The old names of the KV figures (``kvscope.core.base.sample.legacy_kv_fields`` maps them): checked like any int field, so
# that recordings made before kv_bytes_held / kv_bytes_reserved (the shipped demo) read, and damaged ones say so.
_KINDS.update({"kv_bytes_observed": ("int", True), "kv_bytes_used": ("int", True)})
_REQUIRED = tuple(f.name for f in _SAMPLE_FIELDS
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
#: The upper bound of each float field (the lower bound of every number is 0).
_FLOAT_MAX = {"time_s": MAX_TIME_S, "tokens_per_s": MAX_TOKENS_PER_S}
#: The upper bound of each int field not bounded by ``MAX_INT``: the quality probe's top-1 agreement is 0 or 1.
_INT_MAX = {"quality_top1": 1}
#: The longest each str field may be (fields not named: MAX_NAME_CHARS); None: bounded by the line.
_STR_MAX: dict[str, int | None] = {"text": None}


def sample_from_json(data: Any, *, check_unicode: bool = True) -> Sample:
    """A Sample from one parsed JSON line of a recording (or any untrusted dict); ValueError says what
    is wrong, in one line.

    Unknown keys are dropped (a newer writer's extra fields); every field the Sample has is checked:
    required fields present and not null; counts and bytes (the int fields) ints from 0 to
    ``MAX_INT``, never bools; numbers finite, from 0 to their bound (``MAX_TIME_S`` for ``time_s``);
    text valid Unicode (no lone surrogate) and settings and names at most ``MAX_NAME_CHARS`` long;
    a known phase. ``check_unicode=False`` skips the surrogate scan, for callers that know the
    source had no ``\\uD8xx`` escape (it is the one check that costs a pass over every text).
    """
    fields = checked_fields(data, check_unicode=check_unicode)
    if "kv_bytes_observed" in fields or "kv_bytes_used" in fields:
        fields = dict(fields)
        legacy_kv_fields(fields, fields.pop("kv_bytes_observed", None), fields.pop("kv_bytes_used", None))
    held, reserved = fields.get("kv_bytes_held"), fields.get("kv_bytes_reserved")
    if held is not None and reserved is not None and held > reserved:
        # The bytes the tokens hold are part of what the runtime set aside: more is a damaged or forged line
        raise ValueError(f"sample kv_bytes_held {held} is more than kv_bytes_reserved {reserved}")
    if fields.get("event") == "switch" and fields.get("switch_key") is None:
        fields.update(_legacy_switch_fields(str(fields.get("text", ""))))
    return Sample(**fields)


_LEGACY_SWITCH = re.compile(r"\s*(attention|attn-impl|cache): (\S+) -> (\S+)")


def _legacy_switch_fields(text: str) -> dict[str, Any]:
    """What a switch event of a recording made before switches were data said in words: the one place
    the prose is read back, so that old recordings (the shipped demo) show like new ones."""
    match = _LEGACY_SWITCH.match(text)
    if match is None:
        return {}
    rerun = re.search(r"re-ran (\d+) tokens", text)
    return {"switch_key": match[1], "switch_before": match[2], "switch_after": match[3],
            "tokens_rerun": int(rerun[1]) if rerun and len(rerun[1]) < 12 else None}


def _tables() -> tuple[dict[str, frozenset[type]], dict[str, float | int | None]]:
    """Per Sample field: the JSON value types it accepts (json makes exactly int, float, str, bool,
    list, dict, None) and its bound (numbers: the largest value; text: the longest, None for none).
    Fields of a kind not checked (none today) accept any scalar."""
    types: dict[str, frozenset[type]] = {}
    bounds: dict[str, float | int | None] = {}
    for name, (kind, nullable) in _KINDS.items():
        allowed = {"int": {int}, "float": {int, float}, "str": {str}}.get(kind, {int, float, str, bool})
        types[name] = frozenset(allowed | ({type(None)} if nullable else set()))
        bounds[name] = (_INT_MAX.get(name, MAX_INT) if kind == "int" else _FLOAT_MAX.get(name, float(MAX_INT)) if kind == "float"
                        else _STR_MAX.get(name, MAX_NAME_CHARS) if kind == "str" else MAX_INT)
    return types, bounds


_TYPES, _BOUNDS = _tables()


def checked_fields(data: Any, *, check_unicode: bool = True) -> dict[str, Any]:
    """The Sample keyword arguments in ``data`` (unknown keys dropped), checked; ValueError if bad.

    Runs once per line of files with millions of lines: one pass with a precomputed table of
    types and bounds; the slower field-by-field pass (``_explain``) runs only to name a problem."""
    if type(data) is not dict:
        raise ValueError(f"a sample must be a JSON object, got {type(data).__name__}")
    types, bounds = _TYPES, _BOUNDS
    unknown = False
    for key, value in data.items():
        allowed = types.get(key)
        if allowed is None:
            unknown = True
            continue
        t = type(value)
        if t not in allowed:
            _explain(data)
        if t is int or t is float:
            if not 0 <= value <= bounds[key]:  # NaN fails every comparison
                _explain(data)
        elif t is str:
            limit = bounds[key]
            if (limit is not None and len(value) > limit) or (check_unicode and not is_plain_text(value)):
                _explain(data, check_unicode)
    kwargs = {k: v for k, v in data.items() if k in types} if unknown else data
    if len(kwargs) < len(_REQUIRED) or not all(name in kwargs for name in _REQUIRED):
        _explain(data)
    phase = kwargs["phase"]
    if phase not in _PHASES:
        raise ValueError(f"sample phase must be one of {', '.join(_PHASES)}, got {short_repr(phase)}")
    return kwargs


def _explain(data: dict[str, Any], check_unicode: bool = True) -> None:
    """Raise ValueError naming the first problem of a sample dict (the fast pass found one)."""
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise ValueError(f"sample is missing {', '.join(missing)}")
    for key, (kind, nullable) in _KINDS.items():
        if key not in data:
            continue
        value = data[key]
        t = type(value)
        if value is None:
            if not nullable:
                raise ValueError(f"sample field {key} must not be null")
        elif kind == "int":
            if t is not int:
                raise ValueError(f"sample field {key} must be an integer, got {short_repr(value)}")
            if not 0 <= value <= _BOUNDS[key]:
                limit = "2**63-1" if _BOUNDS[key] == MAX_INT else str(_BOUNDS[key])
                raise ValueError(f"sample field {key} must be from 0 to {limit}, got {short_repr(value)}")
        elif kind == "float":
            if t is not float and t is not int:
                raise ValueError(f"sample field {key} must be a number, got {short_repr(value)}")
            limit = _BOUNDS[key]
            if not 0 <= value <= limit:
                if t is float and not math.isfinite(value):
                    if key == "time_s":
                        raise ValueError(f"sample time must be a finite number, got {value!r}")
                    raise ValueError(f"sample field {key} must be a finite number, got {value!r}")
                raise ValueError(f"sample field {key} must be from 0 to {limit:g}, got {short_repr(value)}")
        elif kind == "str":
            if t is not str:
                raise ValueError(f"sample field {key} must be text, got {short_repr(value)}")
            limit = _BOUNDS[key]
            if limit is not None and len(value) > limit:
                raise ValueError(f"sample field {key} is longer than {limit} characters")
            if check_unicode and not is_plain_text(value):
                raise ValueError(f"sample field {key} is not valid Unicode (it holds a lone surrogate)")
        elif t not in (int, float, str, bool):
            raise ValueError(f"sample field {key} must be a plain value, got {short_repr(value)}")
    raise ValueError("sample is not valid")  # unreachable while _TYPES, _BOUNDS and _explain agree

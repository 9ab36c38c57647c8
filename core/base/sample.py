"""Sample: one immutable observation of memory at one token (or one event), with its prediction.

Samples flow from the generation loop to the CLI table, the window's plots and recordings.
They carry their own settings, so a consumer never asks the worker what mode was active.
Memory the hardware cannot report is None ("not available"), never 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

PHASE_PREFILL = "prefill"
PHASE_DECODE = "decode"
PHASE_EVENT = "event"  # a switch, a load, an error: no token was generated


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
    # The quality probe (``--quality-probe``, off by default): the same tokens through a full-cache twin.
    quality_top1: int | None = None  # 1 when this cache's most likely next token is the twin's, else 0
    quality_kl: float | None = None  # KL(twin || this cache) of the next-token distributions, nats
    # The forward pass's peak beyond what was held before it (the allocator's high-water mark, kvscope.core.runtimes.transformers.peak), on the
    # prefill and on a switch's re-run only: measured, and as kvscope.core.prediction.predict.prefill_peak replays it.
    peak_bytes_observed: int | None = None
    peak_bytes_predicted: int | None = None
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
        reader's (``kvscope.core.records.recording.sample_from_json``): one validator for every untrusted sample."""
        from kvscope.core.records.recording import sample_from_json  # recording imports this module

        return sample_from_json(data)

    def replace(self, **changes: Any) -> "Sample":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------------- old names
# Before kv_bytes_held / kv_bytes_reserved, ``kv_bytes_observed`` was held under transformers and reserved under
# llama.cpp, and ``kv_bytes_used`` llama.cpp's held. They are no fields (never stored, never in a new recording
# or CSV): read-only aliases, and keywords the constructor maps (code and tests written before the split;
# the recording reader maps old lines the same way: ``legacy_kv_fields``).

Sample.kv_bytes_observed = property(  # type: ignore[attr-defined]
    lambda self: self.kv_bytes_reserved,
    doc="``kv_bytes_reserved``: the measured counterpart of ``kv_bytes_predicted`` (its name before the split).")
Sample.kv_bytes_used = property(  # type: ignore[attr-defined]
    lambda self: self.kv_bytes_held, doc="``kv_bytes_held`` (llama.cpp's name for it before the split).")

_MISSING: Any = object()


def legacy_kv_fields(fields: dict[str, Any], observed: Any = _MISSING, used: Any = _MISSING) -> dict[str, Any]:
    """``fields`` with the old ``kv_bytes_observed`` / ``kv_bytes_used`` mapped onto held and reserved: observed
    was the figure the prediction is of (reserved), and held too unless ``used`` (llama.cpp's cells that hold
    tokens) says otherwise."""
    if observed is _MISSING and used is _MISSING:
        return fields
    observed = None if observed is _MISSING else observed
    used = None if used is _MISSING else used
    if observed is not None:
        fields["kv_bytes_reserved"] = observed
    held = used if used is not None else observed
    if held is not None:
        fields["kv_bytes_held"] = held
    return fields


_dataclass_init = Sample.__init__


def _init(self: Sample, *args: Any, kv_bytes_observed: Any = _MISSING, kv_bytes_used: Any = _MISSING,
          **fields: Any) -> None:
    _dataclass_init(self, *args, **legacy_kv_fields(fields, kv_bytes_observed, kv_bytes_used))


_init.__doc__ = _dataclass_init.__doc__
Sample.__init__ = _init  # type: ignore[method-assign]

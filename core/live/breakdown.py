"""Where the memory went: one Sample's observed total split into parts, each measured, predicted or n/a.

The parts, in the order a stacked view draws them (bottom up)::

    weights           the model's parameter and buffer tensors (walked: measured)
    kv_held           the K/V of the tokens so far (walked: measured)
    kv_reserved_free  what the runtime set aside for the cache beyond that (llama.cpp's prepayment): measured
    activations       what the allocator holds beyond weights and KV (logits, temporaries): measured with a
                      device allocator; llama.cpp's compute buffer, measured (``activations_observed``: its
                      own memory breakdown); else predicted (the CPU allocator keeps no counters)
    allocator_cache   reserved by torch's caching allocator but not allocated: measured (CUDA/MPS); on the CPU the
                      free pages glibc's malloc keeps (``Sample.host_retained``: freed transients, a switch's
                      copies), measured where the runtime runs in the run loop's process; else n/a
    runtime           the rest of this process: CUDA context, kernels, Python, libraries (NVML's process
                      figure less the allocator's reserve); on the CPU the runtime baseline measured at the load
                      (``Sample.runtime_baseline``: the resident set then, less the weights and malloc's free pages:
                      torch, transformers, the tokenizer, the engine), else the resident set less the parts above
    other_processes   the device's other users (NVML's device used less this process); n/a without NVML

``total`` is the observed figure the parts add up to: NVML's device used with a GPU, the MPS driver's
allocation on Apple, the process RSS on the CPU. A part the device does not report is None ("n/a"),
never 0, and no part is ever negative; ``unattributed`` is what the known parts leave of the total: the rest
(on the CPU with a measured baseline: what grew since the load that no part names, Python's objects, the
profiler's buffers, the arenas' fragmentation), or, negative, what the parts count that is not resident (weights
mapped from their file, llama.cpp's mmap).

Plain Python (no Qt, no torch): the numbers panel, the stacked view and the Prometheus exporter render it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.core.base.sample import PHASE_DECODE, Sample
from kvscope.core.live.compare import observed_and_predicted_total

MEASURED = "measured"
PREDICTED = "predicted"
REMAINDER = "measured remainder"  # a measured total less the parts above it
NA = "n/a"

PARTS = ("weights", "kv_held", "kv_reserved_free", "activations", "allocator_cache", "runtime", "other_processes")
LABELS = {
    "weights": "weights",
    "kv_held": "KV held",
    "kv_reserved_free": "KV reserved, free",
    "activations": "activations / compute",
    "allocator_cache": "allocator cache",
    "runtime": "runtime baseline",
    "other_processes": "other processes",
}


@dataclass(frozen=True)
class Part:
    """One slice of the total: ``name`` (one of PARTS), bytes (None: n/a) and where the figure comes from."""

    name: str
    bytes: int | None
    source: str

    @property
    def label(self) -> str:
        return LABELS[self.name]


@dataclass(frozen=True)
class Breakdown:
    """The observed ``total`` (None when nothing was observed), what it is (``total_source``), the parts in
    PARTS order, and the bytes of the total no known part accounts for (0 when every part is known)."""

    total: int | None
    total_source: str
    parts: tuple[Part, ...]

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    @property
    def unattributed(self) -> int | None:
        if self.total is None:
            return None
        return self.total - sum(p.bytes for p in self.parts if p.bytes is not None)


def _minus(a: int | None, *b: int | None) -> int | None:
    """a - sum(b), None when any is unknown; a negative difference (figures read at different instants) is
    None too: a part is never negative."""
    if a is None or any(x is None for x in b):
        return None
    value = a - sum(x for x in b if x is not None)
    return value if value >= 0 else None


def memory_breakdown(s: Sample) -> Breakdown:
    """``s``'s observed total split into PARTS (see the module docstring for each rule)."""
    weights = s.weights_bytes
    held = s.kv_bytes_held
    reserved = s.kv_bytes_reserved if s.kv_bytes_reserved is not None else held
    kv_free = _minus(reserved, held) if held is not None else None
    allocated, pool = s.allocator_allocated, s.allocator_reserved

    def part(name: str, value: int | None, source: str) -> Part:
        return Part(name, value, source if value is not None else NA)

    if allocated is not None:  # a device allocator (CUDA, MPS): activations measured, the pool's cache too
        activations = part("activations", _minus(allocated, weights, reserved), MEASURED)
        cache = part("allocator_cache", _minus(pool, allocated), MEASURED)
    elif s.activations_observed is not None:  # the runtime measured its own (llama.cpp's compute buffer)
        activations = part("activations", s.activations_observed, MEASURED)
        cache = Part("allocator_cache", None, NA)
    else:  # the CPU: no allocator counters, so what transients hold is the prediction's
        activations = part("activations", s.activations_predicted, PREDICTED)
        cache = part("allocator_cache", s.host_retained, MEASURED)  # glibc malloc's free pages (host_memory)
    head = (part("weights", weights, MEASURED), part("kv_held", held, MEASURED),
            part("kv_reserved_free", kv_free, MEASURED), activations, cache)

    if s.device_used is not None:  # NVML: the whole device
        total, total_source = s.device_used, "device used (NVML)"
        runtime = part("runtime", _minus(s.process_gpu, pool if pool is not None else allocated), MEASURED)
        others = part("other_processes", _minus(s.device_used, s.process_gpu), MEASURED)
    elif pool is not None:  # MPS: the driver's allocation for this process, no view of the others
        total, total_source = pool, "allocator reserved (driver)"
        runtime, others = Part("runtime", None, NA), Part("other_processes", None, NA)
    else:  # the CPU: this process's resident set; the runtime its baseline at the load, else what the parts leave
        total, total_source = s.process_rss, "process RSS"
        if s.runtime_baseline is not None and total is not None:
            runtime = part("runtime", s.runtime_baseline, MEASURED)
        else:
            known = [p.bytes for p in head]
            rest = _minus(total, *[b or 0 for b in known]) if total is not None else None
            runtime = part("runtime", rest, REMAINDER)
        others = Part("other_processes", None, NA)
    return Breakdown(total=total, total_source=total_source if total is not None else NA,
                     parts=head + (runtime, others))


def comparable_totals(s: Sample) -> tuple[int | None, int | None]:
    """An observed total and the prediction of the same quantity (like with like), for the Total plot's curves:
    ``kvscope.core.live.compare.observed_and_predicted_total`` (the rules are written there, once)."""
    return observed_and_predicted_total(s)


def forward_peak_totals(s: Sample) -> tuple[int, int] | None:
    """For a prefill or a switch's re-run: weights + the forward pass's peak above them, observed (the allocator,
    kvscope.core.runtimes.transformers.peak) and predicted (weights + kvscope.core.prediction.predict.prefill_peak); None for other samples (a decode step's peak,
    measured now and then, is above the weights and the cache it started from: the Sample carries it, the Total
    plot's markers do not)."""
    if s.phase == PHASE_DECODE or s.peak_bytes_observed is None or s.peak_bytes_predicted is None:
        return None
    if s.weights_bytes is None or s.weights_predicted is None:
        return None
    return s.weights_bytes + s.peak_bytes_observed, s.weights_predicted + s.peak_bytes_predicted

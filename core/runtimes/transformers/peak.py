"""The allocator's peak during one call, in bytes above what was held when the call began.

CUDA: torch's own counters (``reset_peak_memory_stats`` before, ``max_memory_allocated`` after, less the
bytes allocated at the start). The CPU allocator keeps no counter, so on the CPU the call runs under the
PyTorch profiler with ``profile_memory=True``: every allocation and free of the CPU allocator comes as a
``[memory]`` event with its signed size, and replaying them in order gives the high-water mark (a call that
frees tensors made before the session, a decode step's cache, has them copied in first: ``adopt_dynamic_cache``;
what the profiler prints of its own stays off the terminal: ``kernels.quiet_profiler``).
Other devices (MPS): not measured (None). ``matmul_scratch`` asks oneDNN what a bf16/fp16 matmul of a shape takes
from the allocator inside the call, for ``kvscope.core.prediction.predict.prefill_peak``'s replay.

Engine side only (imports torch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvscope.core.runtimes.transformers.kernels import PROFILER, quiet_profiler


@dataclass(frozen=True)
class PeakReading:
    """``peak``: the most bytes held at once during the call beyond those held before it; ``end``: the bytes
    the call left allocated (what it returned and kept, e.g. the KV it wrote and the logits)."""

    peak: int
    end: int


#: An allocation of an odd size made and freed inside the profiler's session just before the call: the replay starts
#: at its free (what ``adopt`` re-allocated before it stays counted as held, not as the call's).
_MARKER_BYTES = 7_777_777


def measure_peak(call: Callable[[], Any], device: str, adopt: Callable[[], None] | None = None,
                 wait: bool = True) -> tuple[Any, PeakReading | None]:
    """Run ``call()`` once and return its result with the allocator's peak above the start (None on a device whose
    allocator cannot be followed, or, with ``wait`` False, while another thread holds the profiler: ``PROFILER``).

    On the CPU the profiler reports the free of a block only if it saw the block allocated (c10's
    ``ProfiledCPUMemoryReporter`` keeps the sizes of blocks allocated while profiling). A call that frees tensors
    made before it (a decode step's ``torch.cat`` replaces the cache's K/V) would look as if it kept them, so
    ``adopt`` (run inside the session, before the call) re-allocates those tensors first: ``adopt_dynamic_cache``."""
    if device.startswith("cuda"):
        dev = torch.device(device)
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result = call()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        return result, PeakReading(peak=int(peak - start), end=int(torch.cuda.memory_allocated(dev) - start))
    if device != "cpu":
        return call(), None
    from torch.profiler import ProfilerActivity, profile

    if not PROFILER.acquire(blocking=wait):
        return call(), None
    try:
        with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            if adopt is not None:
                adopt()
            marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
            del marker
            result = call()
    finally:
        PROFILER.release()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda e: e.start_ns())  # stable: same-instant events keep the allocator's order
    started = False
    now = peak = 0
    for event in events:
        if not started:
            started = int(event.nbytes()) == -_MARKER_BYTES
            continue
        now += int(event.nbytes())
        peak = max(peak, now)
    return result, PeakReading(peak=peak, end=now)


#: The cache layers whose K/V ``adopt_dynamic_cache`` copies: transformers' dynamic layer and KV Scope's sink layer
#: (``kvscope.core.runtimes.transformers.sparse_caches.SinkWindowLayer``), whose steps the replay follows exactly. Not
#: yet the sliding-window layer: the replay follows its step past the window in eager only.
ADOPTED_LAYERS = ("DynamicLayer", "SinkWindowLayer")


def adopt_dynamic_cache(cache: Any) -> Callable[[], None] | None:
    """For ``measure_peak``'s ``adopt``: a function that replaces every layer's K/V of a transformers dynamic cache by
    a copy (so the profiler sees the step free them), or None when the cache has layers of another kind (sliding,
    quantized, offloaded, h2o: not measured on the CPU); a sink cache's layers are copied the same way. Costs one
    copy of the cache, one layer at a time."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ not in ADOPTED_LAYERS for layer in layers):
        return None

    def adopt() -> None:
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    setattr(layer, name, tensor.clone())

    return adopt


def matmul_scratch(dtype: torch.dtype, threads: int | None = None) -> Callable[..., int]:
    """The CPU's per-call scratch of a matmul, asked of the library that allocates it: a function of
    (batch, m, k, n, transposed) giving the bytes a ``[batch, m, k] @ [batch, k, n]`` product in ``dtype`` allocates
    and frees inside the call beyond its output (0 where none); ``transposed``: B is the transpose of a contiguous
    [n, k] (nn.Linear's weight, eager's keys), else contiguous [k, n] (eager's values).

    Why asked, not computed: in bf16/fp16 on a CPU with oneDNN, PyTorch runs ``mm``/``bmm`` through oneDNN's
    brgemm matmul (``aten/src/ATen/native/mkldnn/Matmul.cpp``, for m*k*n > 16**3), whose scratchpad (a bf16 copy
    of B blocked 64 columns wide and an fp32 accumulator for C, per thread) is sized by a blocking heuristic that
    reads the thread count, the ISA (AVX512-BF16, AMX) and the L2 cache size. The product runs once per shape
    (memoised), on zeros of that shape, under the profiler (``measure_peak``); the answer is this machine's own."""
    threads = threads or torch.get_num_threads()
    return functools.partial(_matmul_scratch, dtype, threads)


@functools.lru_cache(maxsize=4096)
def _matmul_scratch(dtype: torch.dtype, threads: int, batch: int, m: int, k: int, n: int, transposed: bool = True) -> int:
    if dtype == torch.float32 or m * k * n == 0:
        return 0  # fp32 matmuls go to MKL's sgemm on the CPU, which takes no memory from PyTorch's allocator
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.zeros(batch, m, k, dtype=dtype) if batch > 1 else torch.zeros(m, k, dtype=dtype)
        if transposed:  # nn.Linear's weight layout: [out, in], used transposed
            b = torch.zeros(batch, n, k, dtype=dtype).transpose(1, 2)
        else:
            b = torch.zeros(batch, k, n, dtype=dtype)
        if batch == 1:
            b = b[0]
        with torch.inference_mode():
            torch.matmul(a, b)  # oneDNN builds (and caches) the primitive on its first call; measure the second
            _, reading = measure_peak(lambda: torch.matmul(a, b), "cpu")
    finally:
        torch.set_num_threads(before)
    return max(0, reading.peak - reading.end) if reading else 0

"""Memory probes: what the hardware and the allocators say right now, read in well under a millisecond.

One ``MemoryProbe`` answers ``read()`` with a ``MemoryReading``: the torch allocator (CUDA, or MPS
where torch exposes it), NVML's view of the whole device and of this process, and the process RSS.
The generation loop calls it after every token; the fixed-rate sampler calls it 20 times a second.

Anything that cannot be read is ``None`` ("not available"), never 0, and ``notes`` says why in one
line each. NVML missing, no GPU, an N/A per-process figure (WSL, Windows WDDM), a container that
hides our PID, or an NVML call that starts failing mid-run all degrade; ``read()`` never raises.

NVML is reached only through the ``pynvml`` module (nvidia-ml-py), which is injectable so tests
can fake it at exactly that boundary. torch is imported only by a probe of a GPU (cuda, mps: the
engine process): the window's own probes (its GPU-process table, host memory) never load it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kvscope.core.base.errors import UNAVAILABLE, KVScopeError
from kvscope.core.records.outputs import OutputError, check_output_path, display_path, replacing

#: NVML reports "not available" as the all-ones 64-bit value (``NVML_VALUE_NOT_AVAILABLE_ulonglong``).
#: Recent pynvml already maps it to None in process lists; older ones pass the raw value through.
_NVML_NOT_AVAILABLE_ULL = (1 << 64) - 1

NOTE_NO_NVML = "no NVIDIA driver (NVML not found): showing host memory"
NOTE_CPU = "running on CPU: no GPU memory to read; showing host memory (process RSS)"
NOTE_PROCESS_NA = "per-process GPU memory is N/A on this driver (WSL?)"
NOTE_NOT_LISTED = ("this process is not in NVML's process list (no CUDA context yet, "
                   "or a container hides its PID): per-process GPU memory not available")
NOTE_V1_MEMORY = "NVML memory v2 not available on this driver: device used includes reserved memory"


class ProbeError(KVScopeError, RuntimeError):
    """A probe request that cannot be honoured (bad device name, snapshot off CUDA). Message is for the user."""

    category = UNAVAILABLE


@dataclass(frozen=True)
class MemoryReading:
    """Memory at one instant. Bytes are ints; None means not available (see ``notes``).

    ``time_s`` is ``time.monotonic()`` seconds. Allocator figures are torch's caching allocator for
    the probed device (CUDA; on MPS ``allocator_allocated`` is ``current_allocated_memory`` and
    ``allocator_reserved`` is ``driver_allocated_memory``). Device figures are NVML's for the whole
    GPU; ``device_reserved`` is memory the driver keeps back (NVML memory v2 only). ``process_gpu``
    is NVML's figure for this PID, ``process_rss`` the resident host memory of this process.
    """

    time_s: float
    allocator_allocated: int | None = None
    allocator_reserved: int | None = None
    allocator_peak: int | None = None
    allocator_reserved_unallocated: int | None = None
    allocator_inactive_split: int | None = None
    device_used: int | None = None
    device_total: int | None = None
    device_reserved: int | None = None
    process_gpu: int | None = None
    process_rss: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def device_free(self) -> int | None:
        """Bytes NVML reports neither used nor reserved, or None."""
        if self.device_total is None or self.device_used is None:
            return None
        return self.device_total - self.device_used - (self.device_reserved or 0)


@dataclass(frozen=True)
class GpuProcess:
    """One process on one GPU, as NVML lists it. ``used_bytes`` None means NVML says N/A."""

    gpu_index: int
    pid: int
    name: str
    used_bytes: int | None
    is_self: bool
    kind: str = "compute"  # compute | graphics | compute+graphics


def _torch() -> Any:
    """torch, imported on first use (by a probe of a cuda or mps device, or an allocator snapshot)."""
    import torch

    return torch


def _parse_device(device: str) -> tuple[str, int | None]:
    """('cuda', 0) for 'cuda:0', ('cpu', None) for 'cpu'. Raises ProbeError for anything else."""
    match = re.fullmatch(r"([a-z_]+)(?::(\d{1,4}))?", str(device).strip().lower())
    if match is None:
        raise ProbeError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps")
    if match[1] not in ("cpu", "cuda", "mps") or (match[2] is not None and match[1] != "cuda"):
        raise ProbeError(f"cannot probe memory of device {device!r}; use cpu, cuda, cuda:N or mps")
    if match[1] == "cuda":
        return "cuda", int(match[2] or 0)
    return match[1], None


def _nvml_bytes(value: Any) -> int | None:
    """An NVML byte count, with N/A (None or the all-ones sentinel) mapped to None."""
    if value is None:
        return None
    value = int(value)
    if value == _NVML_NOT_AVAILABLE_ULL or value < 0:
        return None
    return value


class MemoryProbe:
    """Reads allocator, NVML and host memory for one device; cheap enough to call after every token.

    ``device`` is a torch device string (``cpu``, ``cuda``, ``cuda:1``, ``mps``). ``nvml`` is the
    pynvml module; by default ``import pynvml`` (nvidia-ml-py) happens lazily, the first time NVML
    is needed. Not thread-safe across threads for one instance: give each thread its own probe.
    """

    def __init__(self, device: str = "cpu", nvml: Any = None) -> None:
        self.device = str(device)
        self.device_type, self.device_index = _parse_device(device)
        self._nvml = nvml
        self._nvml_state = "untried"  # untried | ready | failed
        self._nvml_note: str | None = None
        self._handle: Any = None
        self._handle_note: str | None = None  # a lasting reason there is no handle (no such GPU)
        self._last_handle_error: str | None = None
        self._mem_v2 = True
        self._mem_v2_seen = False
        try:
            self._process: psutil.Process | None = psutil.Process(os.getpid())
        except (psutil.Error, OSError):  # no /proc (a chroot, issue 38): this process's RSS is not available
            self._process = None
        self._pid = os.getpid()
        torch = _torch() if self.device_type in ("cuda", "mps") else None
        self._cuda_ok = self.device_type == "cuda" and torch.cuda.is_available()
        self._mps_ok = (self.device_type == "mps" and hasattr(torch, "mps")
                        and torch.backends.mps.is_available())
        self._mps_peak: int | None = None
        self.last_notes: tuple[str, ...] = ()

    # -- NVML setup ---------------------------------------------------------------------------

    def _nvml_ready(self) -> bool:
        """Import and initialise NVML once; remember a failure (and why) instead of retrying."""
        if self._nvml_state == "ready":
            return True
        if self._nvml_state == "failed":
            return False
        self._nvml_state = "failed"
        if self._nvml is None:
            try:
                import pynvml  # nvidia-ml-py
            except ImportError:
                self._nvml_note = NOTE_NO_NVML
                return False
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self._nvml_note = f"{NOTE_NO_NVML} ({exc})" if str(exc) else NOTE_NO_NVML
            return False
        except OSError as exc:  # a broken libnvidia-ml can fail below pynvml's own error mapping
            self._nvml_note = f"{NOTE_NO_NVML} ({exc})"
            return False
        self._nvml_state = "ready"
        return True

    def _device_handle(self) -> Any:
        """NVML handle of the probed CUDA device, or None (with ``_handle_note`` set)."""
        if self._handle is not None or self._handle_note is not None:
            return self._handle
        nvml = self._nvml
        index = self.device_index or 0
        try:
            count = nvml.nvmlDeviceGetCount()
            if count == 0:
                self._handle_note = "NVML found no GPU: showing host memory"
                return None
            # torch numbers devices after CUDA_VISIBLE_DEVICES; NVML numbers all GPUs. The UUID
            # is the same in both, so match on it when torch can tell us.
            uuid = self._torch_uuid()
            if uuid is not None and hasattr(nvml, "nvmlDeviceGetHandleByUUID"):
                try:
                    self._handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                    return self._handle
                except nvml.NVMLError:
                    pass
            if index >= count:
                self._handle_note = f"NVML sees {count} GPU(s); {self.device} is not one of them"
                return None
            self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            # Possibly transient (a GPU being reset): say so now, try again at the next reading.
            self._last_handle_error = f"NVML could not open {self.device}: {exc}"
            return None
        return self._handle

    def _torch_uuid(self) -> str | None:
        if not self._cuda_ok:
            return None
        try:
            uuid = str(_torch().cuda.get_device_properties(self.device_index or 0).uuid)
        except Exception:  # noqa: BLE001 - an old torch or a MIG slice; fall back to the index
            return None
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"

    # -- reading ------------------------------------------------------------------------------

    def read(self) -> MemoryReading:
        """One reading of every figure available for this device. Never raises."""
        notes: list[str] = []
        values: dict[str, int | None] = {}
        now = time.monotonic()

        try:
            if self._process is None:
                raise OSError("no /proc to read it from")
            values["process_rss"] = int(self._process.memory_info().rss)
        except (psutil.Error, OSError) as exc:
            notes.append(f"process RSS not available: {exc}")

        if self.device_type == "cuda":
            self._read_cuda_allocator(values, notes)
            self._read_nvml(values, notes)
        elif self.device_type == "mps":
            self._read_mps_allocator(values, notes)
            notes.append("Apple GPU shares host memory: device figures not available; allocator from torch.mps")
        else:
            notes.append(NOTE_CPU)

        reading = MemoryReading(time_s=now, notes=tuple(notes), **values)
        self.last_notes = reading.notes
        return reading

    def _read_cuda_allocator(self, values: dict[str, int | None], notes: list[str]) -> None:
        if not self._cuda_ok:
            notes.append(f"torch cannot use CUDA here: allocator figures for {self.device} not available")
            return
        try:
            # One call: the per-figure helpers (memory_allocated, ...) each rebuild this whole dict.
            stats = _torch().cuda.memory_stats(self.device_index)
        except Exception as exc:  # noqa: BLE001 - a CUDA error must not stop the sampler
            notes.append(f"torch allocator statistics failed: {exc}")
            return
        # An empty dict means CUDA is not initialised yet: the allocator truly holds nothing.
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        values["allocator_allocated"] = allocated
        values["allocator_reserved"] = reserved
        values["allocator_peak"] = int(stats.get("allocated_bytes.all.peak", 0))
        values["allocator_reserved_unallocated"] = reserved - allocated
        values["allocator_inactive_split"] = int(stats.get("inactive_split_bytes.all.current", 0))

    def _read_mps_allocator(self, values: dict[str, int | None], notes: list[str]) -> None:
        if not self._mps_ok:
            notes.append("torch cannot use MPS here: allocator figures not available")
            return
        try:
            allocated = int(_torch().mps.current_allocated_memory())
            driver = int(_torch().mps.driver_allocated_memory())
        except Exception as exc:  # noqa: BLE001
            notes.append(f"torch.mps memory figures failed: {exc}")
            return
        # torch.mps keeps no peak counter: this is the highest value this probe has seen.
        self._mps_peak = allocated if self._mps_peak is None else max(self._mps_peak, allocated)
        values["allocator_allocated"] = allocated
        values["allocator_reserved"] = driver
        values["allocator_peak"] = self._mps_peak
        values["allocator_reserved_unallocated"] = max(driver - allocated, 0)
        notes.append("MPS: peak is the highest value sampled; inactive split bytes not reported")

    def _read_nvml(self, values: dict[str, int | None], notes: list[str]) -> None:
        if not self._nvml_ready():
            notes.append(self._nvml_note or NOTE_NO_NVML)
            return
        self._last_handle_error = None
        handle = self._device_handle()
        if handle is None:
            notes.append(self._handle_note or self._last_handle_error or "NVML: no handle for this device")
            return
        nvml = self._nvml
        try:
            mem = self._memory_info(handle)
            values["device_total"] = _nvml_bytes(mem.total)
            values["device_used"] = _nvml_bytes(mem.used)
            reserved = getattr(mem, "reserved", None) if self._mem_v2 else None
            values["device_reserved"] = _nvml_bytes(reserved)
        except nvml.NVMLError as exc:
            notes.append(f"NVML device memory failed: {exc}")
        if not self._mem_v2:
            notes.append(NOTE_V1_MEMORY)
        try:
            procs = self._running_processes(handle, graphics=False)
        except (nvml.NVMLError, _LibraryMismatch(nvml)) as exc:
            notes.append(f"NVML process list failed: {exc}")
            return
        mine = [p for p in procs if int(p.pid) == self._pid]
        if not mine:
            notes.append(NOTE_NOT_LISTED)
            return
        used = [_nvml_bytes(getattr(p, "usedGpuMemory", None)) for p in mine]
        if any(u is None for u in used):
            notes.append(NOTE_PROCESS_NA)
            return
        values["process_gpu"] = sum(u for u in used if u is not None)

    def _memory_info(self, handle: Any) -> Any:
        """NVML memory info, v2 (reserved separate from used) where the driver has it, else v1."""
        nvml = self._nvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is None:
            self._mem_v2 = False
        if not self._mem_v2:
            return nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except nvml.NVMLError as exc:
            # An older driver lacks the v2 call: use v1 from now on rather than paying for a
            # failing call at every reading. Any other error (or any error once v2 has worked,
            # e.g. a GPU falling off the bus) is a real failure and is reported as such.
            if self._mem_v2_seen or getattr(exc, "value", None) not in _version_errors(nvml):
                raise
            self._mem_v2 = False
            return nvml.nvmlDeviceGetMemoryInfo(handle)
        self._mem_v2_seen = True
        return info

    def _running_processes(self, handle: Any, graphics: bool) -> list[Any]:
        nvml = self._nvml
        name = "nvmlDeviceGetGraphicsRunningProcesses" if graphics else "nvmlDeviceGetComputeRunningProcesses"
        try:
            return list(getattr(nvml, name)(handle))
        except _LibraryMismatch(nvml):
            # pynvml newer than the driver: the unversioned call maps to a _v3 the driver lacks.
            fallback = getattr(nvml, name + "_v2", None)
            if fallback is None:
                raise
            return list(fallback(handle))

    # -- process table ------------------------------------------------------------------------

    def gpu_processes(self, app_pids: frozenset[int] = frozenset()) -> list[GpuProcess]:
        """Every compute and graphics process on every GPU NVML sees, with its memory.

        ``is_self`` marks this process and ``app_pids`` (the window marks its engine process).

        Empty when NVML is unavailable (``last_notes`` says why). Names come from psutil and read
        ``pid N`` where the process is not visible (another user, another PID namespace).
        """
        if not self._nvml_ready():
            self.last_notes = (self._nvml_note or NOTE_NO_NVML,)
            return []
        nvml = self._nvml
        rows: list[GpuProcess] = []
        notes: list[str] = []
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            self.last_notes = (f"NVML device count failed: {exc}",)
            return []
        for index in range(count):
            merged: dict[int, tuple[int | None, str]] = {}
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for graphics in (False, True):
                    kind = "graphics" if graphics else "compute"
                    for p in self._running_processes(handle, graphics):
                        pid = int(p.pid)
                        used = _nvml_bytes(getattr(p, "usedGpuMemory", None))
                        if pid in merged:
                            # The same context can be listed as both; its memory is counted once.
                            old_used, old_kind = merged[pid]
                            best = old_used if used is None else (used if old_used is None else max(used, old_used))
                            merged[pid] = (best, f"{old_kind}+{kind}" if kind not in old_kind else old_kind)
                        else:
                            merged[pid] = (used, kind)
            except (nvml.NVMLError, _LibraryMismatch(nvml)) as exc:
                notes.append(f"GPU {index}: NVML process list failed: {exc}")
            for pid, (used, kind) in sorted(merged.items()):
                rows.append(GpuProcess(index, pid, _process_name(pid), used, pid == self._pid or pid in app_pids,
                                       kind))
        if any(r.used_bytes is None for r in rows):
            notes.append(NOTE_PROCESS_NA)
        self.last_notes = tuple(notes)
        return rows

    # -- control ------------------------------------------------------------------------------

    def reset_peak(self) -> None:
        """Start the allocator peak afresh (CUDA: torch's counter; MPS: this probe's sampled peak)."""
        if self._cuda_ok:
            try:
                _torch().cuda.reset_peak_memory_stats(self.device_index)
            except Exception:  # noqa: BLE001 - nothing allocated yet is not an error worth raising
                pass
        self._mps_peak = None

    def close(self) -> None:
        """Release NVML (nvmlShutdown). Safe to call twice; a later read() initialises again."""
        if self._nvml_state == "ready":
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
        if self._nvml_state != "untried":
            self._nvml_state = "untried"
            self._nvml_note = None
        self._handle = None
        self._handle_note = None

    def __enter__(self) -> "MemoryProbe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _LibraryMismatch(nvml: Any) -> type[BaseException]:  # noqa: N802 - used like an exception class
    """pynvml's NVMLLibraryMismatchError (not an NVMLError subclass), or a class nothing raises."""
    return getattr(nvml, "NVMLLibraryMismatchError", _NeverRaised)


class _NeverRaised(Exception):
    pass


def _version_errors(nvml: Any) -> set[int]:
    """NVML return codes that mean "this driver does not have that call or struct version"."""
    names = ("NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED",
             "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", "NVML_ERROR_INVALID_ARGUMENT")
    return {getattr(nvml, n) for n in names if hasattr(nvml, n)}


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return f"pid {pid}"


# -- allocator snapshot (CUDA) ----------------------------------------------------------------


def allocator_snapshot_start(max_entries: int = 100_000) -> None:
    """Start recording CUDA allocator history (every alloc/free with its Python stack).

    Keeps at most ``max_entries`` events (a ring buffer; each is a few KB). Raises ProbeError
    off CUDA. Follow with ``allocator_snapshot_save``.
    """
    if max_entries <= 0:
        raise ProbeError(f"max_entries must be positive, got {max_entries}")
    torch = _torch()
    if not torch.cuda.is_available():
        raise ProbeError("allocator snapshots need CUDA; this machine has no CUDA device torch can use")
    # Python stacks only: C++ frames make saving the snapshot take minutes to symbolise.
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=int(max_entries))


def allocator_snapshot_save(path: str | os.PathLike[str], stop: bool = True) -> Path:
    """Save the recorded allocator history as a pickle that https://pytorch.org/memory_viz opens.

    Stops recording afterwards unless ``stop`` is False. Returns the path written. Raises
    ProbeError off CUDA or when the file cannot be written. The path follows ``kvscope.core.records.outputs``'
    rule (the run checked it, with its --force, before loading): never a device or a folder, no
    folder created, written to a temporary file and renamed into place.
    """
    torch = _torch()
    if not torch.cuda.is_available():
        raise ProbeError("allocator snapshots need CUDA; this machine has no CUDA device torch can use")
    try:
        out = check_output_path(path, force=True, allow_stdout=False)
        with replacing(out) as tmp:
            torch.cuda.memory._dump_snapshot(str(tmp))
        target = out.path
    except OutputError as exc:
        raise ProbeError(f"cannot write allocator snapshot: {exc}") from None
    except OSError as exc:
        raise ProbeError(f"cannot write allocator snapshot to {display_path(path)}: {exc.strerror or exc}") from exc
    finally:
        if stop:
            torch.cuda.memory._record_memory_history(enabled=None)
    return target

"""A stand-in for the ``pynvml`` module (nvidia-ml-py 13.x), faking NVML at its Python boundary.

It implements exactly the names ``kvscope.core.runtimes.probes`` uses, with the real signatures, constants and
return shapes (checked against the installed ``pynvml.py``): memory info v1 has total/free/used,
v2 adds version/reserved; process entries have pid/usedGpuMemory; errors are ``NVMLError(code)``
with ``.value``; the unversioned process call raises ``NVMLLibraryMismatchError`` (not an
NVMLError) when the driver lacks the _v3 symbol.
"""

from __future__ import annotations

from ctypes import c_ulonglong
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

NVML_VALUE_NOT_AVAILABLE_ulonglong = c_ulonglong(-1)
nvmlMemory_v2 = 0x02000028

_MESSAGES = {
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


class NVMLLibraryMismatchError(Exception):
    pass


class FakeGpu:
    def __init__(self, total: int, used: int, reserved: int, compute=(), graphics=()) -> None:
        self.total, self.used, self.reserved = total, used, reserved
        self.compute = list(compute)  # (pid, usedGpuMemory) pairs; usedGpuMemory may be None/sentinel
        self.graphics = list(graphics)


class FakeNvml:
    """The module object. Knobs: ``gpus``, ``init_error``, ``v2_supported``, ``fail`` (an error code
    every device call raises, to fail mid-run), ``v3_processes`` (False: unversioned call mismatches)."""

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_VALUE_NOT_AVAILABLE_ulonglong = NVML_VALUE_NOT_AVAILABLE_ulonglong
    nvmlMemory_v2 = nvmlMemory_v2

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None, v2_supported: bool = True,
                 v3_processes: bool = True) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.v2_supported = v2_supported
        self.v3_processes = v3_processes
        self.fail: int | None = None
        self.initialised = 0
        self.calls: list[str] = []

    def _check(self, name: str) -> None:
        self.calls.append(name)
        if self.initialised <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if self.fail is not None:
            raise NVMLError(self.fail)

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version=None):
        self._check("nvmlDeviceGetMemoryInfo" + ("_v2" if version else ""))
        free = handle.total - handle.used - handle.reserved
        if not version:
            # v1: reserved memory is counted as used
            return SimpleNamespace(total=handle.total, free=free, used=handle.used + handle.reserved)
        if not self.v2_supported:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        assert version == nvmlMemory_v2
        return SimpleNamespace(version=version, total=handle.total, reserved=handle.reserved,
                               free=free, used=handle.used)

    def _procs(self, pairs):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, used in pairs]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu):
        self._check("nvmlDeviceGetComputeRunningProcesses")
        if not self.v3_processes:
            raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")
        return self._procs(handle.compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeGpu):
        self._check("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._procs(handle.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeGpu):
        self._check("nvmlDeviceGetGraphicsRunningProcesses")
        if not self.v3_processes:
            raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")
        return self._procs(handle.graphics)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: FakeGpu):
        self._check("nvmlDeviceGetGraphicsRunningProcesses_v2")
        return self._procs(handle.graphics)

"""MemoryProbe: NVML faked at the pynvml boundary (normal, N/A, no driver, failing mid-run), and the
real CPU path with no fake at all."""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time

import psutil
import pytest
import torch

from kvscope.core.runtimes import probes
from kvscope.core.runtimes.probes import (NOTE_CPU, NOTE_NOT_LISTED, NOTE_PROCESS_NA, NOTE_V1_MEMORY, MemoryProbe,
                                          ProbeError, allocator_snapshot_save, allocator_snapshot_start)
from tests import fake_pynvml
from tests.fake_pynvml import FakeGpu, FakeNvml

GiB = 1 << 30
MiB = 1 << 20
ME = os.getpid()
NO_SUCH_PID = 4_194_400  # above Linux's PID_MAX_LIMIT (2**22): no process can have it
ON_CUDA = torch.cuda.is_available()


def two_gpus(self_used=3 * GiB) -> FakeNvml:
    return FakeNvml([
        FakeGpu(total=80 * GiB, used=10 * GiB, reserved=512 * MiB,
                compute=[(ME, self_used), (NO_SUCH_PID, 7 * GiB)]),
        FakeGpu(total=24 * GiB, used=1 * GiB, reserved=256 * MiB,
                compute=[(NO_SUCH_PID + 1, 900 * MiB)], graphics=[(NO_SUCH_PID + 1, 900 * MiB), (NO_SUCH_PID + 2, 64 * MiB)]),
    ])


@pytest.mark.skipif(ON_CUDA, reason="fakes NVML for a machine where torch cannot see CUDA")
def test_normal_driver_reports_v2_device_memory_and_this_process():
    nvml = two_gpus()
    probe = MemoryProbe("cuda:0", nvml=nvml)
    r = probe.read()
    assert r.device_total == 80 * GiB
    assert r.device_used == 10 * GiB  # v2: reserved is not counted as used
    assert r.device_reserved == 512 * MiB
    assert r.device_free == 80 * GiB - 10 * GiB - 512 * MiB
    assert r.process_gpu == 3 * GiB
    assert r.process_rss is not None and r.process_rss > 0
    assert "nvmlDeviceGetMemoryInfo_v2" in nvml.calls
    # torch has no CUDA here, so the allocator part is not available, and says so
    assert r.allocator_allocated is None and r.allocator_reserved is None
    assert any("allocator" in n for n in r.notes)
    assert NOTE_PROCESS_NA not in r.notes and NOTE_NOT_LISTED not in r.notes


def test_second_device_is_read_by_its_index():
    probe = MemoryProbe("cuda:1", nvml=two_gpus())
    r = probe.read()
    assert r.device_total == 24 * GiB and r.device_used == 1 * GiB
    assert r.process_gpu is None and NOTE_NOT_LISTED in r.notes  # we run on GPU 0 only


def test_gpu_processes_lists_every_gpu_with_self_highlighted():
    probe = MemoryProbe("cpu", nvml=two_gpus())
    rows = probe.gpu_processes()
    by_key = {(p.gpu_index, p.pid): p for p in rows}
    assert set(by_key) == {(0, ME), (0, NO_SUCH_PID), (1, NO_SUCH_PID + 1), (1, NO_SUCH_PID + 2)}
    me = by_key[(0, ME)]
    assert me.is_self and me.used_bytes == 3 * GiB
    assert me.name == psutil.Process(ME).name()
    other = by_key[(0, NO_SUCH_PID)]
    assert not other.is_self and other.used_bytes == 7 * GiB and other.name == f"pid {NO_SUCH_PID}"
    both = by_key[(1, NO_SUCH_PID + 1)]
    assert both.kind == "compute+graphics" and both.used_bytes == 900 * MiB  # counted once
    assert by_key[(1, NO_SUCH_PID + 2)].kind == "graphics"


@pytest.mark.parametrize("na_value", [None, fake_pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value],
                         ids=["pynvml-maps-to-None", "raw-sentinel"])
def test_per_process_na_is_none_never_zero(na_value):
    nvml = two_gpus(self_used=na_value)
    probe = MemoryProbe("cuda:0", nvml=nvml)
    r = probe.read()
    assert r.process_gpu is None
    assert NOTE_PROCESS_NA in r.notes
    assert r.device_used == 10 * GiB  # the rest is still read
    mine = [p for p in probe.gpu_processes() if p.is_self]
    assert len(mine) == 1 and mine[0].used_bytes is None
    assert NOTE_PROCESS_NA in probe.last_notes


def test_driver_without_memory_v2_falls_back_to_v1_once():
    nvml = FakeNvml([FakeGpu(total=16 * GiB, used=2 * GiB, reserved=300 * MiB, compute=[(ME, GiB)])],
                    v2_supported=False)
    probe = MemoryProbe("cuda:0", nvml=nvml)
    first, second = probe.read(), probe.read()
    assert first.device_used == 2 * GiB + 300 * MiB  # v1 counts reserved as used
    assert first.device_reserved is None
    assert NOTE_V1_MEMORY in first.notes and NOTE_V1_MEMORY in second.notes
    assert second.device_used == first.device_used
    assert nvml.calls.count("nvmlDeviceGetMemoryInfo_v2") == 1  # not retried at every reading


def test_old_driver_process_call_falls_back_to_v2_symbol():
    nvml = two_gpus()
    nvml.v3_processes = False
    probe = MemoryProbe("cuda:0", nvml=nvml)
    assert probe.read().process_gpu == 3 * GiB
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in nvml.calls
    assert len(probe.gpu_processes()) == 4


def test_missing_driver_degrades_to_host_memory():
    nvml = FakeNvml([], init_error=fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    probe = MemoryProbe("cuda:0", nvml=nvml)
    r = probe.read()
    assert (r.device_used, r.device_total, r.device_reserved, r.process_gpu) == (None, None, None, None)
    assert r.process_rss > 0
    assert any(n.startswith("no NVIDIA driver (NVML not found)") and "Library Not Found" in n for n in r.notes)
    assert probe.gpu_processes() == []
    assert probe.last_notes and probe.last_notes[0].startswith("no NVIDIA driver")
    probe.read()
    assert nvml.calls.count("nvmlInit") == 1  # a failed init is remembered, not retried per reading
    probe.close()  # nothing to shut down; must not raise


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    probe = MemoryProbe("cuda:0")
    r = probe.read()
    assert r.device_used is None and r.process_gpu is None
    assert probes.NOTE_NO_NVML in r.notes
    assert probe.gpu_processes() == []


def test_driver_with_no_gpu():
    probe = MemoryProbe("cuda:0", nvml=FakeNvml([]))
    r = probe.read()
    assert r.device_total is None
    assert any("no GPU" in n for n in r.notes)


def test_device_index_beyond_what_nvml_sees():
    probe = MemoryProbe("cuda:3", nvml=two_gpus())
    r = probe.read()
    assert r.device_total is None
    assert any("sees 2 GPU(s)" in n and "cuda:3" in n for n in r.notes)


def test_call_failing_mid_run_degrades_then_recovers():
    nvml = two_gpus()
    probe = MemoryProbe("cuda:0", nvml=nvml)
    assert probe.read().device_used == 10 * GiB
    nvml.fail = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    r = probe.read()  # must not raise
    assert (r.device_used, r.device_total, r.device_reserved, r.process_gpu) == (None, None, None, None)
    assert r.process_rss > 0
    assert "NVML device memory failed: GPU is lost" in r.notes
    assert "NVML process list failed: GPU is lost" in r.notes
    assert probe.gpu_processes() == []
    assert any("GPU is lost" in n for n in probe.last_notes)
    nvml.fail = None
    again = probe.read()
    # a failure after v2 has worked is a failure, not a reason to drop to v1 for good
    assert again.device_reserved == 512 * MiB and again.process_gpu == 3 * GiB
    assert NOTE_V1_MEMORY not in again.notes


def test_close_shuts_nvml_down_once_and_read_reinitialises():
    nvml = two_gpus()
    probe = MemoryProbe("cuda:0", nvml=nvml)
    probe.read()
    assert nvml.initialised == 1
    probe.close()
    probe.close()
    assert nvml.initialised == 0 and nvml.calls.count("nvmlShutdown") == 1
    assert probe.read().device_used == 10 * GiB
    with probe:
        pass
    assert nvml.initialised == 0


def test_real_cpu_path_reads_rss_and_says_why_no_gpu():
    probe = MemoryProbe("cpu")  # no fake: the real psutil, and NVML is not even consulted
    r = probe.read()
    assert r.process_rss is not None and r.process_rss > 10 * MiB  # a Python process with torch loaded
    gpu_fields = (r.allocator_allocated, r.allocator_reserved, r.allocator_peak, r.allocator_reserved_unallocated,
                  r.allocator_inactive_split, r.device_used, r.device_total, r.device_reserved, r.process_gpu)
    assert all(v is None for v in gpu_fields)
    assert r.notes == (NOTE_CPU,)
    assert abs(r.time_s - time.monotonic()) < 1.0
    later = probe.read()
    assert later.time_s > r.time_s


def test_cpu_read_takes_well_under_a_millisecond():
    probe = MemoryProbe("cpu")
    durations = []
    for _ in range(300):
        t0 = time.perf_counter()
        probe.read()
        durations.append(time.perf_counter() - t0)
    # median, not max: the machine is shared and a single read can be descheduled
    assert statistics.median(durations) < 1e-3


def test_rss_follows_a_real_allocation():
    probe = MemoryProbe("cpu")
    before = probe.read().process_rss
    # Fresh anonymous pages, each written once: resident for sure. (A Python allocation could reuse heap
    # memory freed earlier in a long test session, which is already resident and would not move RSS.)
    block = mmap.mmap(-1, 64 * MiB)
    for offset in range(0, 64 * MiB, mmap.PAGESIZE):
        block[offset] = 1
    after = probe.read().process_rss
    assert after - before > 48 * MiB
    block.close()


def test_bad_device_is_a_clear_error():
    with pytest.raises(ProbeError, match="unknown device 'gpu0'"):
        MemoryProbe("gpu0")
    with pytest.raises(ProbeError, match="cannot probe memory of device 'meta'"):
        MemoryProbe("meta")


@pytest.mark.skipif(ON_CUDA, reason="checks the message given off CUDA")
def test_snapshot_needs_cuda(tmp_path):
    with pytest.raises(ProbeError, match="need CUDA"):
        allocator_snapshot_start()
    with pytest.raises(ProbeError, match="need CUDA"):
        allocator_snapshot_save(tmp_path / "snap.pickle")
    assert not (tmp_path / "snap.pickle").exists()
    with pytest.raises(ProbeError, match="max_entries must be positive"):
        allocator_snapshot_start(max_entries=0)


def test_failure_before_the_first_handle_is_retried():
    nvml = two_gpus()
    nvml.fail = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    probe = MemoryProbe("cuda:0", nvml=nvml)
    r = probe.read()
    assert r.device_used is None and "NVML could not open cuda:0: GPU is lost" in r.notes
    nvml.fail = None
    assert probe.read().device_used == 10 * GiB

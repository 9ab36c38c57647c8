#!/usr/bin/env python
"""Exercise the GPU memory path on a real CUDA machine and print the figures.

Checks, each reported PASS/FAIL with its numbers (one failing check does not hide the others):
  1. MemoryProbe on cuda:0: NVML v2 device memory, this process's GPU memory, allocator stats,
     RSS; how long one read() takes.
  2. A 512 MiB allocation moves allocator allocated/peak, NVML device used and process GPU memory
     by about 512 MiB; reset_peak() resets the peak.
  3. gpu_processes(): every process on every GPU, this one highlighted.
  4. Allocator snapshot: record around some allocations, save a pickle memory_viz can open.
  5. Spikes: a 1 GiB allocation while sampling at 50 Hz is one spike of ~1 GiB, attributed to
     this process; a second process allocating 1 GiB is a device spike attributed to "another
     process", and shows up in gpu_processes().
  6. MemorySampler (Qt, offscreen) on cuda:0 for ~2 s: the achieved rate.

Usage: python scripts/gpu_probe_check.py [--out DIR]   (DIR receives snapshot.pickle)
Without CUDA it prints one "no CUDA" line and exits 0. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
RESULTS: list[tuple[str, bool, str]] = []


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:,.1f} MiB"


def check(name: str):
    """Decorator: run a check, record PASS/FAIL, never let one exception stop the others."""
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"\n== {name}", flush=True)
            try:
                ok, detail = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a diagnostics script reports, it does not crash
                import traceback
                traceback.print_exc()
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            RESULTS.append((name, ok, detail))
            print(f"-> {'PASS' if ok else 'FAIL'}: {detail}", flush=True)
            return ok
        return run
    return wrap


def show(reading) -> None:
    for field in ("allocator_allocated", "allocator_reserved", "allocator_peak", "allocator_reserved_unallocated",
                  "allocator_inactive_split", "device_used", "device_total", "device_reserved", "process_gpu",
                  "process_rss"):
        print(f"   {field:32s} {mib(getattr(reading, field))}")
    for note in reading.notes:
        print(f"   note: {note}")


@check("1. probe on cuda:0: fields, NVML v2, read time")
def check_probe(probe):
    import pynvml
    torch.zeros(1, device="cuda")  # create the CUDA context so NVML lists this process
    torch.cuda.synchronize()
    r = probe.read()
    show(r)
    handle = probe._device_handle()  # noqa: SLF001 - diagnostics: which GPU did we match?
    print(f"   NVML device: {pynvml.nvmlDeviceGetName(handle)} {pynvml.nvmlDeviceGetUUID(handle)}")
    print(f"   torch device: {torch.cuda.get_device_name(0)} uuid {torch.cuda.get_device_properties(0).uuid}")
    print(f"   memory API: {'v2 (reserved separate)' if probe._mem_v2 else 'v1 (reserved counted as used)'}")  # noqa: SLF001
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        probe.read()
        times.append(time.perf_counter() - t0)
    med, p95 = statistics.median(times) * 1e3, sorted(times)[int(len(times) * 0.95)] * 1e3
    print(f"   read(): median {med:.3f} ms, p95 {p95:.3f} ms")
    ok = (r.device_total is not None and r.device_used is not None and r.allocator_allocated is not None
          and r.process_rss is not None)
    return ok, (f"device {mib(r.device_used)} used of {mib(r.device_total)}, reserved {mib(r.device_reserved)}, "
                f"process {mib(r.process_gpu)}; read() median {med:.3f} ms")


@check("2. a 512 MiB allocation moves allocator, device and process figures")
def check_allocation(probe):
    probe.reset_peak()
    torch.cuda.synchronize()
    before = probe.read()
    block = torch.ones(512 * MiB // 4, dtype=torch.float32, device="cuda")  # touched, so really resident
    torch.cuda.synchronize()
    after = probe.read()
    show(after)

    def delta(field):
        a, b = getattr(after, field), getattr(before, field)
        return None if a is None or b is None else a - b

    d_alloc, d_dev, d_proc = delta("allocator_allocated"), delta("device_used"), delta("process_gpu")
    print(f"   delta allocated {mib(d_alloc)}, device used {mib(d_dev)}, process gpu {mib(d_proc)}")
    peak_before_reset = after.allocator_peak
    del block
    torch.cuda.synchronize()
    probe.reset_peak()
    reset = probe.read()
    print(f"   peak {mib(peak_before_reset)} -> after free + reset_peak {mib(reset.allocator_peak)}")
    ok = d_alloc == 512 * MiB and peak_before_reset >= after.allocator_allocated
    ok = ok and reset.allocator_peak < peak_before_reset
    # The caching allocator may already hold a free segment, so the device can rise by less.
    ok = ok and d_dev is not None and d_dev >= 0
    if d_proc is None:
        note = "process GPU memory n/a (" + "; ".join(n for n in after.notes if "process" in n) + ")"
    else:
        note = f"process +{mib(d_proc)}"
    return ok, f"allocated +{mib(d_alloc)}, device +{mib(d_dev)}, {note}"


@check("3. GPU process table")
def check_processes(probe):
    rows = probe.gpu_processes()
    for p in rows:
        star = "*" if p.is_self else " "
        print(f"  {star} gpu{p.gpu_index} pid {p.pid:>8} {p.kind:17s} {mib(p.used_bytes):>14}  {p.name}")
    for note in probe.last_notes:
        print(f"   note: {note}")
    mine = [p for p in rows if p.is_self]
    return bool(mine), f"{len(rows)} process(es); this one {'listed' if mine else 'NOT listed (container PID namespace?)'}"


@check("4. allocator snapshot (pytorch.org/memory_viz)")
def check_snapshot(out_dir: Path):
    from kvscope.core.runtimes.probes import allocator_snapshot_save, allocator_snapshot_start
    allocator_snapshot_start(max_entries=10_000)
    xs = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (8, 16, 32)]
    del xs[1]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    path = allocator_snapshot_save(out_dir / "snapshot.pickle")
    save_s = time.perf_counter() - t0
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    traces = snap.get("device_traces", [[]])
    n_events = sum(len(t) for t in traces)
    size = path.stat().st_size
    print(f"   {path}: {size:,} bytes, keys {sorted(snap)}, {n_events} trace events, saved in {save_s:.2f} s")
    return "segments" in snap and n_events >= 3, f"{size:,} bytes, {n_events} events"


def sample_while(probe, action, seconds: float, rate_hz: float = 50.0):
    """Read the probe at rate_hz on a thread while `action()` runs on this one."""
    readings, stop = [], threading.Event()

    def loop():
        while not stop.is_set():
            readings.append(probe.read())
            stop.wait(1 / rate_hz)

    t = threading.Thread(target=loop, name="gpu-check-sampler")
    t.start()
    try:
        action()
        time.sleep(seconds)
    finally:
        stop.set()
        t.join()
    return readings


@check("5a. spike from this process (1 GiB) -> attributed to this app's event")
def check_own_spike():
    from kvscope.core.live.spikes import EVENT_LOAD, Event, attribute_cause, detect_spikes, rise_between
    from kvscope.core.runtimes.probes import MemoryProbe
    probe = MemoryProbe("cuda:0")  # its own probe: one probe per thread
    held = []
    events = []

    def act():
        time.sleep(0.8)
        events.append(Event(time.monotonic(), EVENT_LOAD, "1 GiB test tensor"))
        held.append(torch.ones(GiB // 4, dtype=torch.float32, device="cuda"))
        torch.cuda.synchronize()

    readings = sample_while(probe, act, 1.0)
    ts = [r.time_s for r in readings]
    dev = detect_spikes(ts, [r.device_used for r in readings], 256 * MiB, 0.5, series="device")
    own_series = [r.process_gpu if r.process_gpu is not None else r.allocator_reserved for r in readings]
    held.clear()
    torch.cuda.empty_cache()
    probe.close()
    for s in dev:
        s = s.with_cause(attribute_cause(s, events, process_rise=rise_between(ts, own_series, s.start_s, s.time_s)))
        print(f"   spike at +{s.time_s - ts[0]:.2f} s: {mib(s.rise_bytes)} ({s.cause})")
    ok = len(dev) == 1 and abs(dev[0].rise_bytes - GiB) < 128 * MiB
    ok = ok and attribute_cause(dev[0], events, process_rise=rise_between(ts, own_series, dev[0].start_s, dev[0].time_s)).startswith("model load")
    return ok, f"{len(dev)} device spike(s) over {len(readings)} readings"


CHILD = r"""
import time, torch
x = torch.ones((1 << 30) // 4, dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
print("allocated", flush=True)
time.sleep(3)
"""


@check("5b. spike from another process (1 GiB) -> 'another process'")
def check_other_process():
    from kvscope.core.live.spikes import CAUSE_OTHER_PROCESS, attribute_cause, detect_spikes, rise_between
    from kvscope.core.runtimes.probes import MemoryProbe
    probe = MemoryProbe("cuda:0")
    child: list[subprocess.Popen] = []
    seen_child_in_table = []

    def act():
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        child.append(proc)
        line = proc.stdout.readline()  # waits for torch import + allocation in the child
        print(f"   child {proc.pid}: {line.strip()}")
        seen_child_in_table.extend(p for p in probe_table.gpu_processes() if p.pid == proc.pid)

    probe_table = MemoryProbe("cuda:0")
    try:
        readings = sample_while(probe, act, 1.0)
    finally:
        for proc in child:
            proc.wait(timeout=30)
    ts = [r.time_s for r in readings]
    own = [r.process_gpu if r.process_gpu is not None else r.allocator_reserved for r in readings]
    spikes = detect_spikes(ts, [r.device_used for r in readings], 256 * MiB, 0.5, series="device")
    causes = [attribute_cause(s, [], process_rise=rise_between(ts, own, s.start_s, s.time_s)) for s in spikes]
    for s, c in zip(spikes, causes):
        print(f"   spike at +{s.time_s - ts[0]:.2f} s: {mib(s.rise_bytes)} ({c})")
    for p in seen_child_in_table:
        print(f"   child in process table: gpu{p.gpu_index} pid {p.pid} {mib(p.used_bytes)} {p.name}")
    probe.close()
    probe_table.close()
    big = [(s, c) for s, c in zip(spikes, causes) if s.rise_bytes >= 900 * MiB]
    ok = bool(big) and all(c == CAUSE_OTHER_PROCESS for _, c in big)
    return ok, f"{len(spikes)} spike(s); child listed in table: {bool(seen_child_in_table)}"


@check("6. MemorySampler thread on cuda:0 at 20 Hz")
def check_sampler():
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QCoreApplication, QTimer

    from kvscope.workers.sampler import MemorySampler
    app = QCoreApplication.instance() or QCoreApplication([])
    sampler = MemorySampler("cuda:0", rate_hz=20.0)
    rates, count, notes, errors = [], [0], [], []
    sampler.rate_measured.connect(rates.append)
    sampler.readings.connect(lambda batch: count.__setitem__(0, count[0] + len(batch)))
    sampler.note.connect(notes.append)
    sampler.errored.connect(errors.append)
    sampler.start()
    QTimer.singleShot(2300, app.quit)
    app.exec()
    t0 = time.monotonic()
    stopped = sampler.stop()
    stop_s = time.monotonic() - t0
    for n in notes:
        print(f"   note: {n}")
    print(f"   rates {[round(r, 2) for r in rates]}, {count[0]} readings, stop {stop_s * 1e3:.1f} ms, errors {errors}")
    ok = stopped and not errors and bool(rates) and all(15 <= r <= 22 for r in rates)
    return ok, f"achieved {rates[-1]:.2f} Hz" if rates else "no rate reported"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for snapshot.pickle (default: a temp folder)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_probe_check: no CUDA (torch.cuda.is_available() is False): nothing to check here")
        return 0
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="kvscope-gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s), "
          f"{torch.cuda.get_device_name(0)}")
    from kvscope.core.runtimes.probes import MemoryProbe
    probe = MemoryProbe("cuda:0")
    check_probe(probe)
    check_allocation(probe)
    check_processes(probe)
    check_snapshot(out_dir)
    check_own_spike()
    check_other_process()
    check_sampler()
    probe.close()
    print("\n== summary")
    for name, ok, detail in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())

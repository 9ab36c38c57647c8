"""A quiet terminal (issue 36, item 6): nothing of the torch profiler's own output reaches the user.

The engine measures the attention kernel, the prefill's and a decode step's allocator peak on the CPU under the
torch profiler, whose C++ side (libkineto, c10) writes to file descriptor 2 by itself: ``USDT:... profiler_start``
and ``profiler_stop`` at every session, ``ERROR: External init callback must run in same thread as
registerClient`` at the first session on a thread other than the one that imported torch, and c10's ``Memory
block of unknown size was allocated before the profiling started``. ``kernels.quiet_profiler`` keeps those off
and writes back everything else. Real processes, stdout and stderr read apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

#: What the profiler's C++ side prints (seen before the fix in `run`'s stderr, and in the window's engine process).
PROFILER_MARKS = ("USDT:", "STAGE:", "profiler_start", "profiler_stop", "SyncActivityProfilerHandler",
                  "registerClient", "External init callback", "Memory block of unknown size", "kineto", "Kineto",
                  "CUPTI")


def _profiler_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(mark in line for mark in PROFILER_MARKS)]


def test_run_prints_nothing_of_the_profiler(tmp_path):
    """`main.py run` on the CPU through profiled decode steps (the first after the prefill and after the re-run, two
    tokens after each switch: core/runtimes/transformers/peak_cadence.py) and a switch that re-runs the tokens (a
    profiled prefill and kernel): the table on stdout and our progress lines on stderr, nothing of the profiler's on
    either; the recording shows the profiler did run (the prefills' and the decode steps' peaks)."""
    tokens = 24
    record = tmp_path / "run.jsonl"
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "run", "--model", "embedded", "--device", "cpu",
                          "--tokens", str(tokens), "--switch", "8:attention=mla", "--switch", "16:attention=mha",
                          "--record", str(record)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _profiler_lines(out.stdout) == [] and _profiler_lines(out.stderr) == [], (out.stdout[-1500:], out.stderr)
    assert f"generated {tokens} tokens" in out.stdout
    assert "ready: embedded demo model on cpu" in out.stderr  # our own stderr lines are kept
    assert "re-running" in out.stderr  # the switch back to MHA re-ran the tokens (a profiled prefill)
    samples = [json.loads(line) for line in record.read_text().splitlines()[1:]]
    profiled = [s["token"] for s in samples if s.get("peak_bytes_observed") is not None and s["phase"] == "decode"]
    assert len(profiled) >= 2 and any(s["phase"] == "prefill" and s.get("peak_bytes_observed") is not None
                                      for s in samples), profiled  # the profiler ran, several times


def test_a_profiled_call_on_another_thread_keeps_our_lines_and_drops_the_profilers():
    """The first profiler session on a thread other than torch's importer (the window's generation thread) made
    kineto print its `registerClient` error. Under ``measure_peak`` and ``measure_kernel`` there, what the call
    itself writes, to fd 2, sys.stderr and stdout, comes out once each and in order (also from a call that raises);
    the profiler's lines do not."""
    script = textwrap.dedent("""
        import os, sys, threading
        import torch
        from kvscope.core.runtimes.transformers.kernels import measure_kernel
        from kvscope.core.runtimes.transformers.peak import measure_peak

        def call(tag):
            os.write(2, f"ours fd2 {tag}\\n".encode())
            print(f"ours stderr {tag}", file=sys.stderr)
            print(f"ours stdout {tag}", flush=True)
            return (torch.ones(1 << 12) * 2).sum()

        readings = []
        def work():
            readings.append(measure_peak(lambda: call("peak"), "cpu")[1])
            readings.append(measure_kernel(lambda: call("kernel")))
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        try:  # a call that raises under the profiler: what it wrote first still comes out
            measure_peak(lambda: (os.write(2, b"ours before raising\\n"), 1 // 0), "cpu")
        except ZeroDivisionError:
            print("raised", file=sys.stderr)
        print("reading", readings[0] is not None and readings[0].peak > 0, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _profiler_lines(out.stdout) == [] and _profiler_lines(out.stderr) == [], (out.stdout, out.stderr)
    assert out.stderr.splitlines() == ["ours fd2 peak", "ours stderr peak", "ours fd2 kernel", "ours stderr kernel",
                                       "ours before raising", "raised"]
    assert out.stdout.splitlines() == ["ours stdout peak", "ours stdout kernel", "reading True"]

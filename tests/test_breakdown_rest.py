"""The CPU breakdown's runtime baseline, malloc's retained pages and the rest (issue 35, item 4).

A transformers run on the CPU: the run loop gives every Sample the runtime baseline measured at the load (the
resident set then, less the weights and malloc's free pages: torch, transformers, the tokenizer, the engine) and the
free pages glibc's malloc keeps now (``kvscope.core.base.host_memory``); the breakdown shows them as measured parts,
and what is left of the resident set, the rest, is small. Checked on generated samples, on this process's own
figures, and on real runs of the embedded model and SmolLM2-135M with a switch that copies the cache.
"""

from __future__ import annotations

import pytest

from kvscope.core.base.host_memory import HostFigures, process_memory, resident_bytes
from kvscope.core.live.breakdown import MEASURED, PREDICTED, REMAINDER, memory_breakdown
from tests.test_breakdown import MiB, _sample


def test_the_cpu_parts_with_a_measured_baseline() -> None:
    """Baseline and retained pages measured: the runtime is the baseline, the allocator cache malloc's free pages, and
    the rest what the resident set has beyond every part (never spread over a part, never a negative part)."""
    s = _sample(process_rss=900 * MiB, weights_bytes=500 * MiB, kv_bytes_held=12 * MiB, kv_bytes_reserved=12 * MiB,
                activations_predicted=MiB, runtime_baseline=360 * MiB, host_retained=20 * MiB)
    b = memory_breakdown(s)
    assert b.part("runtime").bytes == 360 * MiB and b.part("runtime").source == MEASURED
    assert b.part("allocator_cache").bytes == 20 * MiB and b.part("allocator_cache").source == MEASURED
    assert b.part("activations").source == PREDICTED
    assert b.unattributed == 900 * MiB - 500 * MiB - 12 * MiB - MiB - 360 * MiB - 20 * MiB == 7 * MiB
    assert all(p.bytes is None or p.bytes >= 0 for p in b.parts)
    # without them (an older recording, a runtime in another process): the runtime is the remainder, as before
    old = memory_breakdown(s.replace(runtime_baseline=None, host_retained=None))
    assert old.part("runtime").source == REMAINDER and old.part("runtime").bytes == 900 * MiB - 513 * MiB
    assert old.unattributed == 0


def test_host_figures_of_this_process() -> None:
    """HostFigures: the first Sample with this process's RSS and its weights fixes the baseline (RSS less weights less
    malloc's free pages then, never below 0); every later Sample carries it and malloc's free pages now."""
    now = process_memory()
    assert now.rss is not None and now.rss == pytest.approx(resident_bytes(), rel=0.05)
    if now.malloc_retained is None:
        pytest.skip("not glibc: malloc's figures are not available")
    assert now.malloc_in_use > 0 and now.malloc_retained >= 0
    host = HostFigures()
    assert host.attach(_sample()) == _sample()  # nothing says this process's RSS: left alone
    rss = resident_bytes()
    first = host.attach(_sample(process_rss=rss, weights_bytes=10 * MiB))
    assert 0 < first.runtime_baseline <= rss - 10 * MiB
    assert first.runtime_baseline == rss - 10 * MiB - first.host_retained
    later = host.attach(_sample(process_rss=rss + MiB, weights_bytes=10 * MiB))
    assert later.runtime_baseline == first.runtime_baseline and later.host_retained is not None
    assert HostFigures().attach(_sample(process_rss=MiB, weights_bytes=10 * MiB)).runtime_baseline == 0


#: A run in a process of its own, as the app's engine process is (a model run earlier in the same process leaves its
#: pages behind, in the next run's baseline): its Samples and their breakdowns, one JSON line each.
_RUN = """
import json, sys
from kvscope.core.live.breakdown import memory_breakdown
from kvscope.core.live.run import run_generation
from kvscope.core.model.request import RunHooks, RunRequest
seen = []
run_generation(RunRequest(source=sys.argv[1], max_new_tokens=24, device="cpu", switches=((16, "cache", "static"),)),
               RunHooks(emit=seen.append))
for s in seen:
    b = memory_breakdown(s)
    print(json.dumps({"sample": s.to_dict(), "total": b.total, "rest": b.unattributed,
                      "parts": {p.name: [p.bytes, p.source] for p in b.parts}}))
"""


def _run(source: str) -> list[dict]:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _RUN, source], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("model", ["embedded", "smollm2"])
def test_a_real_run_leaves_a_small_rest(model: str) -> None:
    """A real run in a fresh process (prefill, 16 tokens, a switch to a static cache, 8 more): every Sample has the
    baseline measured at the load and malloc's free pages; the rest is a small share of the resident set (measured on
    this machine: the embedded model 7-10 MiB of 375-412 MiB, SmolLM2-135M 10-35 MiB of 917-1,279 MiB), where before
    the runtime was the whole remainder (350-430 MiB) with nothing named inside it."""
    if model == "smollm2":
        from tests import real_models

        source = str(real_models.smollm2_folder())
    else:
        source = "embedded"
    rows = _run(source)
    load = next(r["sample"] for r in rows if r["sample"]["event"] == "load")
    assert load["runtime_baseline"] is not None and load["host_retained"] is not None
    assert load["runtime_baseline"] == load["process_rss"] - load["weights_bytes"] - load["host_retained"]
    # torch and transformers alone are a few hundred MiB on any machine that runs them
    assert load["runtime_baseline"] > 100 * MiB
    switched = next(r["sample"] for r in rows if r["sample"]["event"] == "switch")
    assert switched["kv_bytes_held"] > 16 * MiB  # the static cache preallocates its whole context
    for r in rows:
        s = r["sample"]
        assert s["runtime_baseline"] == load["runtime_baseline"]
        assert r["parts"]["runtime"][1] == MEASURED and r["parts"]["allocator_cache"][1] == MEASURED
        assert all(size is None or size >= 0 for size, _ in r["parts"].values())
        assert -2 * MiB <= r["rest"] <= max(64 * MiB, r["total"] // 10), (s["phase"], s["event"], s["token"],
                                                                           r["rest"] / MiB)

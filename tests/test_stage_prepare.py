"""Issue 25, item 1: a key never blocks the token stream. A switch to a quantized cache whose backend is
not yet prepared in this process waits while kvscope.core.runtimes.transformers.prepare builds/loads it on a thread of its own; the
run goes on under the current settings, the driver says what it prepares, and the switch applies at a
later token. On a fresh install this is optimum-quanto's C++ build (minutes): the token gaps stay small.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvscope.core.live.engine_process import RunDriver
from kvscope.core.model.request import RunRequest
from kvscope.core.runtimes.transformers import prepare

#: The longest gap between two tokens allowed while the backend is prepared (the issue's done-when: 2 s);
#: a busy 2-core CI machine gets some slack.
GAP_S = 4.0


def test_backend_needed_names_only_the_quantized_caches_that_build_something():
    assert prepare.backend_needed("cache", "quantized:4") == "quanto"
    assert prepare.backend_needed("cache", "quantized:hqq:4") == "hqq"
    assert prepare.backend_needed("cache", "quantized:fp8") is None
    assert prepare.backend_needed("cache", "static") is None
    assert prepare.backend_needed("attention", "mqa") is None
    assert prepare.backend_needed("cache", "no such cache") is None


@pytest.mark.parametrize("value", ["quantized:4", "quantized:hqq:4"])
def test_a_quantized_switch_waits_for_its_backend_off_the_token_path(value, monkeypatch):
    monkeypatch.setattr(prepare, "_jobs", {})  # as in a fresh engine process: nothing prepared yet
    messages: list[tuple[float, str, object]] = []
    lock = threading.Lock()

    def send(kind, payload):
        with lock:
            messages.append((time.monotonic(), kind, payload))

    driver = RunDriver(RunRequest(source="embedded", device="cpu", max_new_tokens=100_000), send)
    runner = threading.Thread(target=driver.run, name="test-run", daemon=True)
    runner.start()

    def samples():
        with lock:
            return [(t, s) for t, kind, batch in messages if kind == "samples" for s in batch]

    deadline = time.monotonic() + 180
    while len([s for _, s in samples() if s.phase == "decode"]) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    pressed_at = max(s.token for _, s in samples())
    driver.command("switch", "cache", value)
    deadline = time.monotonic() + 900  # a fresh install builds quanto's extension here: minutes on 2 cores
    while time.monotonic() < deadline and not any(s.event in ("switch", "refused") for _, s in samples()):
        time.sleep(0.1)
    driver.stop()
    runner.join(60)
    answers = [s for _, s in samples() if s.event in ("switch", "refused")]
    assert answers and answers[0].event == "switch" and answers[0].cache == value, [a.text for a in answers]
    with lock:
        progress = [p for _, kind, p in messages if kind == "progress"]
    assert any(p.startswith("preparing quantized cache") for p in progress), progress
    assert answers[0].token > pressed_at  # tokens went on while the backend was prepared
    # Tokens arrive in batches (every 50 ms at most); the gap between two arrivals is what a viewer sees.
    times = [t for t, s in samples() if s.phase == "decode" and s.token <= answers[0].token + 1]
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"{value}: {len(times)} tokens while preparing; longest gap {max(gaps):.2f} s")
    assert max(gaps) < GAP_S


def _thread_nices(pid: int) -> list[int]:
    """The nice value of every thread of process ``pid`` (Linux: a nice value belongs to a thread)."""
    import os

    import psutil

    out = []
    for thread in psutil.Process(pid).threads():
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, thread.id))
        except OSError:  # ended meanwhile
            pass
    return out


def test_the_engine_started_early_loads_the_first_run_before_it_is_asked():
    """Start-up (issue 25, item 6): main.py spawns the engine before the window's imports, with the first run's
    request; the engine loads that model before it reads the "run" command, which then runs through the pipe the
    window adopts; an early engine no window takes is ended by discard_early. Until the first tokens are out the
    engine runs at the window's priority; from then on every thread of it runs 10 nice steps below."""
    import os
    import sys

    from kvscope.core.live import engine_process
    from kvscope.core.model.request import RunRequest

    linux = sys.platform.startswith("linux")
    base = os.getpriority(os.PRIO_PROCESS, 0) if linux else 0
    request = RunRequest(source="embedded", max_new_tokens=3)
    engine_process.spawn_early(preload=request)
    process, conn = engine_process.take_early()
    assert engine_process.take_early() is None  # adopted once
    try:
        conn.send(("run", request, 7))
        kinds = []
        while "done" not in kinds:
            assert conn.poll(300), kinds
            kind, payload, run = conn.recv()
            kinds.append(kind)
            assert kind != "errored", payload
            if kind == "ready" and linux:  # imports done, model loading: start-up, at the window's priority
                assert set(_thread_nices(process.pid)) == {base}
            if kind == "samples":
                assert run == 7
        assert kinds[:2] == ["ready", "device"] and "loaded" in kinds and "samples" in kinds
        if linux:  # the first tokens are out: every thread yields to the window
            assert set(_thread_nices(process.pid)) == {min(base + 10, 19)}
        conn.send(("quit",))
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
        conn.close()
    engine_process.spawn_early()
    engine_process.discard_early()
    assert engine_process.take_early() is None


def test_a_preloaded_model_is_the_one_the_run_loads_once():
    """kvscope.core.runtimes.transformers.runtime.preload_model: the run asking for the same model takes the one loaded ahead
    (once); a run asking for another loads its own, and nothing loaded ahead is kept."""
    from kvscope.core.model.request import RunRequest
    from kvscope.core.runtimes.transformers import runtime as runtime_module

    request = RunRequest(source="embedded", max_new_tokens=2)
    runtime_module.preload_model(request)
    ahead = runtime_module._preloaded[runtime_module._load_key(request)]
    first = runtime_module.TransformersRuntime(request, lambda text: None)
    first.load()
    assert first.loaded is ahead and not runtime_module._preloaded
    second = runtime_module.TransformersRuntime(request, lambda text: None)
    second.load()
    assert second.loaded is not ahead
    runtime_module.preload_model(request)
    other = RunRequest(source="embedded", max_new_tokens=2, dtype="float32" if ahead.dtype != "float32" else "bfloat16")
    third = runtime_module.TransformersRuntime(other, lambda text: None)
    third.load()
    assert third.loaded is not ahead and not runtime_module._preloaded
    for runtime in (first, second, third):
        runtime.close()

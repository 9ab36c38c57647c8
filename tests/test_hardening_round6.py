"""Hardening, round 6 (issue 38's last open cases): a stopped llama.cpp child, and what is left of calc's
impossible inputs. Real processes, real signals, the real command line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvscope.core.base.process_state import is_stopped

REPO = Path(__file__).resolve().parent.parent


def test_a_stopped_process_is_told_from_a_running_one_and_a_gone_one():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert not is_stopped(child.pid)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(child.pid)
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_stopped(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not is_stopped(child.pid) and not is_stopped(None)


def test_a_stopped_llamacpp_child_ends_the_run_in_one_line_and_keeps_the_recording(tmp_path):
    pytest.importorskip("llama_cpp", reason="the llamacpp extra (make test installs it)")
    from kvscope.core.base.errors import RuntimeCrashed
    from kvscope.core.live.run import run_generation
    from kvscope.core.model.request import RunHooks, RunRequest
    from kvscope.core.prediction.llamacpp import LlamaCppOptions
    from kvscope.core.records.recording import RecordingReader
    from kvscope.core.runtimes.llamacpp import runtime as llamacpp_runtime

    record = tmp_path / "stopped.jsonl"
    before = {p.pid for p in psutil.Process().children()}
    samples, stopped_at = [], []

    def emit(sample):
        samples.append(sample)
        if sample.phase == "decode" and sample.token == 3:  # the child stops now (kill -STOP, a debugger)
            for child in psutil.Process().children():
                if child.pid not in before:
                    child.send_signal(signal.SIGSTOP)
            stopped_at.append(time.monotonic())

    with pytest.raises(RuntimeCrashed, match=r"stopped \(SIGSTOP\) for 5 s, so KV Scope ended it, at token 3") as info:
        run_generation(RunRequest(runtime="llama.cpp", options={"llama.cpp": LlamaCppOptions(n_ctx=512)},
                                  max_new_tokens=20, record_path=str(record)), RunHooks(emit=emit))
    waited = time.monotonic() - stopped_at[0]
    assert llamacpp_runtime.STOPPED_S <= waited < llamacpp_runtime.STOPPED_S + 10, waited
    assert "\n" not in str(info.value)
    with RecordingReader(record) as reader:
        back = list(reader)
    assert back == samples and back[-1].event == "error" and back[-1].token == 3 and "SIGSTOP" in back[-1].text
    assert not [p for p in psutil.Process().children() if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]  # the stopped child was ended, not left behind

"""Helpers shared by several test modules (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest


def run_in_window(qtbot, window, request, timeout: int = 120_000) -> None:
    """Start ``request`` in the window and wait until the run has finished."""
    with qtbot.waitSignal(window.run_finished, timeout=timeout):
        assert window.start_run(request)


def os_thread_names() -> list[str]:
    """Names of this process's OS threads (Linux): a QThread takes its objectName (cut to 15 characters)."""
    task = Path("/proc/self/task")
    if not task.exists():
        pytest.skip("needs /proc to see OS threads")
    names = []
    for entry in task.iterdir():
        try:
            names.append((entry / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names


def engine_that_cannot_start(conn) -> None:
    """An engine process main that dies before it is ready (as one whose torch fails to import would)."""
    raise SystemExit(3)


@pytest.fixture(scope="module")
def hub_offline():
    """No test reaches the network (huggingface_hub reads HF_HUB_OFFLINE once, at import). A module
    that talks to the hub code uses it with ``pytestmark = pytest.mark.usefixtures("hub_offline")``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


def one_line_error(code: int, err: str) -> str:
    """The CLI failed for the user's input: exit 2, exactly one ``kvscope:`` line, said last, no traceback.

    (Progress lines such as "reading config…" may come before it on stderr.)"""
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("kvscope:")]
    assert len(errors) == 1, err
    assert err.rstrip().splitlines()[-1] == errors[0]
    return errors[0]


def run_args(model: str, *extra: str) -> list[str]:
    """``main.py run`` arguments for a short CPU run of ``model``."""
    return ["run", "--model", model, "--device", "cpu", "--tokens", "2", *extra]


def one_torch_thread():
    """A module fixture's body: torch on one thread while the module runs (tiny models are latency-bound;
    one thread avoids fighting other processes for the cores), the count as before after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fail_the_trial_pass(monkeypatch) -> None:
    """Make the switch transaction's trial pass fail after it ran (its cache appends included)."""
    from kvscope.core.runtimes.transformers.engine import Engine

    real = Engine._trial_step

    def trial(self):
        real(self)
        raise RuntimeError("the trial pass failed")

    monkeypatch.setattr(Engine, "_trial_step", trial)

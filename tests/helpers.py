"""Helpers shared by several test modules (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

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

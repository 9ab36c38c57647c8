"""What the seeded fuzzers (recordings, GGUFs, model stores) share: a guard that turns a hang into a
failure, and their table by category."""

from __future__ import annotations

import contextlib
import signal
from collections import Counter
from typing import Callable


class Hang(Exception):
    """A variant still running when its guard's time ran out."""


@contextlib.contextmanager
def guard(seconds: float):
    """Raise Hang in this (main) thread after ``seconds``: a blocking open or a loop is interrupted."""
    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def category_table(title: str, head: str, table: dict[str, Counter], row: Callable[[str, Counter], str]) -> str:
    """The fuzzer's outcome per category and for all of them, one ``row`` each, under ``title`` and ``head``."""
    rows = [title, head]
    total: Counter = Counter()
    for category, counts in table.items():
        total.update(counts)
        rows.append(row(category, counts))
    rows.append(row("all", total))
    return "\n".join(rows)

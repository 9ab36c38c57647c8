"""Standard output as the user gave it: closed (``>&-``), full (``>/dev/full``, a full disk) or failing, said in one line.

Python leaves ``sys.stdout`` None when the process starts with its descriptor 1 closed; ``print`` then writes
nothing and the first descriptor the process opens becomes 1 (a recording, a CSV's temporary file), where any C
library's ``printf`` would land. A write to a full device raises ``OSError`` from whatever ``print`` was called,
and the interpreter's last flush says it again ("Exception ignored ...") after KV Scope's own line.

``guard_stdout`` (``main.py`` runs every command in it) turns a failed write or flush of standard output into
``StreamError``, one line that names where standard output goes (``cannot write to standard output (/dev/full):
No space left on device``), and points descriptor 1 at the null device so that nothing is said twice. A reader
that left (EPIPE, ``| head``) stays ``BrokenPipeError``: not an error of ours. ``require_stdout`` refuses a
command whose output is standard output when it is closed, before any work; ``hold_closed_descriptors`` puts the
null device on a closed 0, 1 or 2 so that no file KV Scope opens takes its number.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from kvscope.core.base.errors import UNAVAILABLE, KVScopeError

__all__ = ["StreamError", "stream_name", "write_failed", "require_stdout", "guard_stdout", "hold_closed_descriptors"]


class StreamError(KVScopeError):
    """Standard output (or another stream KV Scope prints to) is closed or a write to it failed."""

    category = UNAVAILABLE


def _target(stream: Any) -> str | None:
    """Where ``stream``'s descriptor leads (``/dev/full``, ``/tmp/out.txt``), when the system says and it is a name."""
    try:
        fd = stream.fileno()
        where = os.readlink(f"/proc/self/fd/{fd}")
    except (AttributeError, OSError, ValueError):  # no descriptor (a StringIO, pytest's capture), no /proc
        return None
    return where if where.startswith("/") else None  # not "pipe:[123]" or "socket:[456]"


def stream_name(stream: Any = None, default: str = "standard output") -> str:
    """``standard output (/dev/full)``: the stream's role and, where known, the file or device behind it."""
    from kvscope.core.base.safe_text import safe_text

    where = _target(stream if stream is not None else sys.stdout)
    return f"{default} ({safe_text(where, limit=200)})" if where else default


def _silence(stream: Any) -> None:
    """Point ``stream``'s descriptor at the null device: its unwritten buffer then goes nowhere, quietly."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)


def write_failed(stream: Any, exc: OSError, default: str = "standard output") -> StreamError:
    """The ``StreamError`` for ``exc`` raised writing ``stream`` (its descriptor is silenced first)."""
    name = stream_name(stream, default)
    _silence(stream)
    return StreamError(f"cannot write to {name}: {exc.strerror or exc}")


def require_stdout(why: str) -> None:
    """Refuse a command when standard output is closed; ``why`` it needs it (``calc prints its figures there
    (>/dev/null discards them)``). Raises StreamError."""
    if sys.stdout is None:
        raise StreamError(f"standard output is closed, and {why}")


class _Guarded:
    """``sys.stdout`` whose write and flush raise ``StreamError`` instead of ``OSError`` (EPIPE excepted)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._failed: StreamError | None = None

    def _call(self, method: str, *args: Any) -> Any:
        if self._failed is not None:  # once failed, every later write says the same (never half a table more)
            raise StreamError(str(self._failed))
        try:
            return getattr(self._stream, method)(*args)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise
            self._failed = write_failed(self._stream, exc)
            raise StreamError(str(self._failed)) from None

    def write(self, text: str) -> int:
        return self._call("write", text)

    def writelines(self, lines: Any) -> None:
        self._call("writelines", lines)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str) -> Any:  # buffer, fileno, isatty, encoding...: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def guard_stdout() -> Iterator[None]:
    """Run the block with ``sys.stdout`` guarded (``StreamError`` for a failed write or flush, flushed at the end
    inside the guard); the stream as it was afterwards."""
    real = sys.stdout
    if real is None or isinstance(real, _Guarded):
        yield
        return
    guarded = _Guarded(real)
    sys.stdout = guarded
    try:
        yield
        guarded.flush()  # what is still buffered fails here, as this command's error, not at the interpreter's exit
    finally:
        if sys.stdout is guarded:
            sys.stdout = real


def hold_closed_descriptors() -> None:
    """Open the null device on each of descriptors 0, 1 and 2 that is closed, so no file opened later takes it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:  # the lowest free number is taken first, so this is rare (a lower one also closed)
                    os.dup2(null, fd)
                    os.close(null)

"""A file the user names for KV Scope to read, read only if it is a regular file and at most so many bytes.

``/dev/zero`` never ends (``run --prompt-file /dev/zero`` read until the kernel killed the process), a FIFO
with no writer blocks ``open`` forever, a folder cannot be read. ``read_regular_file`` looks with ``os.stat``
first (through symbolic links: the kind of thing a link leads to is what counts), refuses anything but a
regular file and anything larger than the limit unread, opens non-blocking (a FIFO swapped in meanwhile cannot
hold the open), checks the open descriptor again, and reads at most one byte more than the limit (a file that
grew meanwhile is refused too). Messages are one line, for the user, naming the file as ``what`` says.
"""

from __future__ import annotations

import os
import stat

from kvscope.core.base.errors import BAD_INPUT, KVScopeError

__all__ = ["FileRefused", "read_regular_file", "read_at_most", "file_kind"]

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


class FileRefused(KVScopeError, ValueError):
    """A file that will not be read (not a regular file, too large, unreadable); the message is for the user."""

    category = BAD_INPUT


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is (``a FIFO (named pipe)``...), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def read_regular_file(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``, which has at most ``limit`` bytes. ``what`` names it in
    messages (``--prompt-file notes.txt``). Raises FileRefused."""
    link = " (through a symbolic link)" if os.path.islink(path) else ""
    try:
        kind = file_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        raise FileRefused(f"{what} does not exist") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise FileRefused(f"cannot read {what}: {getattr(exc, 'strerror', None) or exc}") from None
    if kind is not None:
        raise FileRefused(f"{what} is {kind}{link}, not a regular file; give a text file")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise FileRefused(f"cannot read {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        kind = file_kind(st.st_mode)
        if kind is not None:  # swapped for a FIFO or a device since the look above
            raise FileRefused(f"{what} is {kind}{link}, not a regular file; give a text file")
        if st.st_size > limit:
            raise FileRefused(f"{what} is {_size(st.st_size)} ({st.st_size:,} bytes); it may be at most "
                              f"{_size(limit)} ({limit:,} bytes), so it was not read")
        data = read_at_most(fd, limit)
    except OSError as exc:
        raise FileRefused(f"cannot read {what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while it was read
        raise FileRefused(f"{what} is more than {_size(limit)} ({limit:,} bytes); it was not read")
    return data


def read_at_most(fd: int, limit: int) -> bytes:
    """What the open descriptor ``fd`` holds, up to ``limit`` + 1 bytes (one more than allowed: a longer result says
    the file is over the limit, never read to its end). OSError as ``os.read`` raises it."""
    chunks, got = [], 0
    while got <= limit:
        chunk = os.read(fd, min(1 << 20, limit + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)

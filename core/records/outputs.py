"""Files the user names for KV Scope to write: one rule for all of them, and an atomic writer.

Every file written at a user-chosen path goes through :func:`check_output_path` first (the CSV of
``export --csv``, the PNG of ``--screenshot`` and of the window's screenshot and summary, the
recording of ``run --record``, the allocator snapshot of ``--snapshot``) and is then written with
:func:`open_output` / :func:`write_output`. The rule:

* ``-`` is standard output, where the caller allows it (a CSV, a PNG); never a recording, whose
  terminal run prints its table there.
* The output is never one of the inputs (the recording being exported or replayed), compared as
  the same file (``os.path.samestat``), so another spelling, a hard link or a symbolic link to it is
  caught too. Not even with ``force``.
* An existing file is replaced only with ``force`` (``--force``); a read-only file never (its mode
  says nobody may write it, and root could).
* Only regular files are ever replaced: a folder, a device (``/dev/stdout``, ``/dev/null``), a FIFO
  or a socket is refused, also when a symbolic link leads to it. (Renaming a file over
  ``/dev/stdout`` as root used to replace the system's link with a regular file.)
* A symbolic link to a regular file is **written through**: its target gets the new content and
  the link stays a link (a link to nothing is refused: following it would create a file wherever
  it points).
* A missing folder is refused ("folder X does not exist"), never created.

Writing goes to a new temporary file in the target's folder, flushed and renamed over the target
(``os.replace``) only once complete, so a failure half-way leaves the old file (or no file), never
half a file. A file that is replaced keeps its permission bits. Messages are one line, for the
user, and name files through :func:`display_path`, which escapes control characters.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import stat
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvscope.core.base.errors import BAD_INPUT, KVScopeError
from kvscope.core.base.streams import write_failed

#: The name that means standard output.
STDOUT = "-"

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


class OutputError(KVScopeError, ValueError):
    """An output path KV Scope will not write, or a write that failed. The message is one line, for the user."""

    category = BAD_INPUT


def display_path(path: str | os.PathLike[str] | None) -> str:
    """A file name as it may appear in a one-line message.

    Names made of printable characters are returned as they are. A name with a control character
    (a newline would split the message in two; an escape sequence would drive the terminal), a
    bidirectional override, a lone surrogate from undecodable bytes or any other unprintable
    character is shown quoted with Python's escapes, as ``repr`` writes it: ``'a\\nb.csv'``.
    """
    if path is None:
        return "None"
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return text if text.isprintable() else repr(text)


@dataclass(frozen=True)
class Output:
    """A checked output: where to write (``path``; None for standard output) and how to name it."""

    name: str  #: as the user gave it
    path: Path | None  #: the regular file to create or replace (a symbolic link's target); None: standard output
    exists: bool = False  #: ``path`` exists and will be replaced
    mode: int | None = None  #: permission bits of the file replaced

    @property
    def stdout(self) -> bool:
        return self.path is None

    @property
    def shown(self) -> str:
        """The name for messages: ``standard output`` or the user's spelling, control characters escaped."""
        return "standard output" if self.path is None else display_path(self.name)

    def __str__(self) -> str:
        return self.name

    def __fspath__(self) -> str:
        if self.path is None:
            raise OutputError("standard output has no file path")
        return str(self.path)


def _kind(mode: int) -> str | None:
    for test, name in _KINDS:
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def check_output_path(path: str | os.PathLike[str] | Output, inputs: Iterable[str | os.PathLike[str] | None] = (), *,
                      force: bool = False, allow_stdout: bool = True, option: str = "--force") -> Output:
    """Check ``path`` against the rule in the module docstring; return the :class:`Output` to write.

    ``inputs``: files this command reads (they may not be the output; missing ones and None are
    ignored). ``force``: an existing regular file may be replaced. ``allow_stdout``: ``-`` means
    standard output (else it is refused). ``option`` names the opt-in in the "already exists"
    message. An ``Output`` (already checked) is returned as it is. Raises OutputError.
    """
    if isinstance(path, Output):
        return path
    name = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    if name == "":
        raise OutputError("an output file name is empty")
    if name == STDOUT:
        if not allow_stdout:
            raise OutputError("this output cannot go to standard output (-): give a file name")
        if sys.stdout is None:  # started with `>&-`: said before anything is read or rendered
            raise OutputError("standard output is closed, and - means standard output; give a file name")
        return Output(name=name, path=None)
    shown = display_path(name)
    given = Path(name).expanduser()
    try:
        st = os.stat(given)  # follows links: the kind of thing a link leads to is what counts
    except FileNotFoundError:
        st = None
    except OSError as exc:  # a loop of links, a path through a file, no permission to look
        raise OutputError(f"cannot write {shown}: {exc.strerror or exc}") from None
    if st is None:
        if given.is_symlink():
            raise OutputError(f"{shown} is a symbolic link to a missing file; refusing to follow it "
                              "(remove the link or give another name)")
        parent = given.parent  # Path("x.csv").parent is Path(".")
        if not parent.exists():
            raise OutputError(f"folder {display_path(parent)} does not exist (it is not created for you)")
        if not parent.is_dir():
            raise OutputError(f"{display_path(parent)} is not a folder")
        return Output(name=name, path=Path(os.path.realpath(parent)) / given.name)
    kind = _kind(st.st_mode)
    if kind is not None:
        hint = " (use - for standard output)" if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode) else ""
        link = " (through a symbolic link)" if given.is_symlink() else ""
        raise OutputError(f"{shown} is {kind}{link}, not a regular file; refusing to write over it{hint}")
    for source in inputs:
        if source is None:
            continue
        try:
            same = os.path.samestat(st, os.stat(Path(os.fsdecode(source)).expanduser()))
        except OSError:
            continue
        if same:
            also = "" if os.fsdecode(source) == name else f" {display_path(source)}"
            raise OutputError(f"{shown} is the input file{also}; refusing to overwrite it (choose another output name)")
    real = Path(os.path.realpath(given))
    if not force:
        through = (f" (a symbolic link: {option} writes through it to {display_path(real)}, the link stays)"
                   if given.is_symlink() else "")
        raise OutputError(f"{shown} already exists; add {option} to replace it{through}")
    if not (st.st_mode & 0o222) or not os.access(given, os.W_OK):
        raise OutputError(f"{shown} is read-only; refusing to replace it")
    return Output(name=name, path=real, exists=True, mode=stat.S_IMODE(st.st_mode))


def _temporary_name(target: Path) -> str:
    """``.NAME.PID.RANDOM.tmp`` beside ``target``, its NAME cut (at a character, counting bytes) so that the whole
    stays within the folder's longest name: a valid name of 250 bytes must not fail for its temporary's sake."""
    suffix = f".{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        longest = os.pathconf(target.parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), a folder gone: the usual limit
        longest = 255
    room = max(longest, 32) - 1 - len(suffix.encode())
    name = target.name
    while len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}{suffix}"


@contextlib.contextmanager
def replacing(out: Output) -> Iterator[Path]:
    """A new temporary path next to ``out.path``, renamed over it when the block ends without error.

    For writers that want a path (Qt, torch). The temporary file is removed when the block raises.
    Raises OutputError (OSError of the rename, or of creating the temporary file).
    """
    if out.path is None:
        raise OutputError("standard output cannot be replaced; write to it with open_output")
    target = out.path
    tmp = target.with_name(_temporary_name(target))
    try:
        # O_EXCL: never an existing file (or a link planted there); 0o666 less the umask, like open().
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        if out.mode is not None:
            os.chmod(tmp, out.mode)
    except OSError as exc:
        raise OutputError(f"cannot write {out.shown}: {exc.strerror or exc}") from None
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise OutputError(f"cannot write {out.shown}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


@contextlib.contextmanager
def open_output(out: Output, *, binary: bool = False, encoding: str = "utf-8",
                newline: str | None = None) -> Iterator[IO]:
    """Open ``out`` for writing: a temporary file renamed into place at the end, or standard output.

    Text mode with ``encoding`` and ``newline`` (``newline=""`` for the csv module) unless
    ``binary``. Standard output is flushed, never closed. Write errors raise OutputError.
    """
    if out.path is None:
        if sys.stdout is None:
            raise OutputError("standard output is closed, and - means standard output; give a file name")
        wrapper = None
        try:
            sys.stdout.flush()
            raw = sys.stdout.buffer
            if binary:
                yield raw
                raw.flush()
                return
            wrapper = io.TextIOWrapper(raw, encoding=encoding, newline=newline, write_through=True)
            yield wrapper
            wrapper.flush()
        except OSError as exc:  # /dev/full, a disk that filled: one line (a reader that left, EPIPE, stays itself)
            if exc.errno == errno.EPIPE:
                raise
            raise OutputError(str(write_failed(sys.stdout, exc))) from None  # descriptor 1 silenced first
        finally:
            if wrapper is not None:
                with contextlib.suppress(OSError, ValueError):
                    wrapper.detach()  # leave sys.stdout's buffer open
        return
    with replacing(out) as tmp:
        try:
            f = open(tmp, "wb") if binary else open(tmp, "w", encoding=encoding, newline=newline)
        except OSError as exc:
            raise OutputError(f"cannot write {out.shown}: {exc.strerror or exc}") from None
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            f.close()  # a flush left to close() fails here, said like any write of it
        except OSError as exc:
            raise OutputError(f"cannot write {out.shown}: {exc.strerror or exc}") from None
        finally:
            # Closed on every path; a close that fails again (the disk is still full) must not replace the
            # one-line error above with a bare OSError (export on an 8 KiB tmpfs did: "internal error").
            with contextlib.suppress(OSError):
                f.close()


def write_output(out: Output, data: bytes) -> None:
    """Write ``data`` to ``out`` (atomically for a file). Raises OutputError."""
    with open_output(out, binary=True) as f:
        f.write(data)

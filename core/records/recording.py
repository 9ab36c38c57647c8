"""Recordings: a run's Samples in a versioned JSONL file, written as they happen, read as a stream.

Format (version 2)::

    line 1   {"format": "kvscope-recording", "version": 2, "app_version": "0.1.0",
              "created": "2025-01-01T12:00:00+00:00", "model": {...}, "device": {...}, "settings": {...}}
    line 2+  one ``Sample.to_dict()`` per line, UTF-8 JSON, in the order produced

Versions. 2: the quality probe's figures (``quality_top1``, ``quality_kl``) compare the run with the model as loaded
(teacher-forced, a full cache, whatever was switched); ``quality_token`` / ``quality_token_text`` say the loaded
model's most likely next token, ``quality_kv_bytes`` what the probe's own cache holds. 1: the same lines without
those three fields, the figures (where present) against a full-cache twin of the running model. Both are read (a
version 1 sample's new fields are None).

Durability. Every sample is written with one ``write`` and flushed to the OS at once, so a crash or a
SIGKILL of the writing process loses at most the sample being written (the kernel already holds the
rest). ``os.fsync`` (which only matters if the *machine* dies: power loss, kernel panic) runs at most
every ``fsync_interval_s`` seconds (0.5 s by default) and on close: an fsync costs from ~0.1 ms to
tens of ms depending on the disk, and the writer runs on the generation thread between two tokens,
so fsyncing per token would disturb the tokens/s it measures at 100+ tokens/s; a time bound (not a
count bound) caps both the cost (<= 2 fsyncs/s) and the loss on power failure (<= 0.5 s), whatever
the token rate. The header is written to a temporary file, fsynced and renamed into place, so the
path never shows a file without a complete header.

Reading. Recordings are untrusted input (people share them), and :class:`RecordingReader` is the
one place that reads them, so it is where they are checked. Only ``json`` parses them, never
pickle or eval; only a regular file is opened (a FIFO, ``/dev/zero``, a socket or a folder is
refused before a byte is read, and the open never waits); each line is capped at
``MAX_LINE_BYTES`` and decoded as strict UTF-8; the file is streamed line by line and never
loaded whole. Every field is checked for type *and range* (a sample's by ``kvscope.core.base.sample.sample_from_json``, the
one validator of untrusted samples; the bounds are ``kvscope.core.base.sample``'s): counts and bytes are ints from 0 to
``MAX_INT`` (2**63-1; the quality probe's ``quality_top1`` 0 or 1), numbers finite and non-negative
(``time_s`` up to ``MAX_TIME_S``; ``quality_kl``, absent from recordings made before the probe, None), text
valid Unicode (no lone surrogate), settings and names at most ``MAX_NAME_CHARS``; the header's
fields likewise (``model.name`` must be text, ``device.total_memory`` a count...). Problems with
the header (empty file, not a recording, unknown or newer version, a field of the wrong type or
range) raise :class:`RecordingError`, one line. Problems with a sample line are *skipped and
counted* by default rather than stopping the read: one damaged line in a long recording must not
make the rest unplayable, and skipping loses nothing that was readable (``strict=True`` raises
instead); ``problem()`` says what was skipped in one line. Beside each field's own type and range, the
fields that say how a run went are checked against each other and the header (``sample_rules``, one rule per
field, the writer's too): see ``SAMPLE_RULES``. A last line cut off without its
newline is the mark of a killed writer: it is reported as ``truncated``, not as corruption. A
replay reads with ``max_text=MAX_TEXT_CHARS``: a text longer than that is cut and marked.

The writer and the reader share the format's every rule (header fields, versions, bounds), so they live together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from kvscope.core.base.errors import BAD_INPUT, KVScopeError
from kvscope.core.base.sample import (MAX_INT, MAX_NAME_CHARS, Sample, checked_fields, is_plain_text, sample_from_json,
                                      short_repr)
from kvscope.core.model.spec import LAYER_KINDS, MAX_LAYERS, ModelSpec, SpecError, canonical_dtype
from kvscope.core.model.states import kv_shapes_from_json, states_from_json
from kvscope.core.records.outputs import OutputError, check_output_path, display_path, replacing

log = logging.getLogger(__name__)

RECORDING_FORMAT = "kvscope-recording"
RECORDING_VERSION = 2
#: The longest line (bytes, newline included) written or read. A prefill sample carries the whole
#: prompt; 8 MiB is ~2M tokens of text, beyond any context window, yet small enough to hold in memory.
MAX_LINE_BYTES = 8 * 1024 * 1024
#: Default bound on the time between two fsyncs of a recording being written (seconds).
FSYNC_INTERVAL_S = 0.5
#: How many skipped-line messages a reader keeps (the count is always exact).
MAX_WARNINGS = 20
#: What a replay shows of one sample's text (characters). Longer texts (a whole prompt, a damaged
#: file) are cut there and marked with :data:`ELIDED` and the count of characters left out: laying out
#: a multi-MiB line without spaces takes Qt minutes. Opt-in (``RecordingReader(max_text=...)``):
#: ``export`` keeps every character.
MAX_TEXT_CHARS = 4096
#: What marks a text cut to ``max_text`` characters: ``...text…[+N chars]``.
ELIDED = "\u2026[+{n:,} chars]"

_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Sample))
#: A JSON escape of a UTF-16 surrogate: only lines with one can hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class RecordingError(KVScopeError, ValueError):
    """A recording that cannot be written or read. The message is one line, for the user."""

    category = BAD_INPUT


def _name(path: Path) -> str:
    return display_path(path.name or str(path))


# ------------------------------------------------------------------------------------------------
# Header


def header_for(spec: Any, device: str | Mapping[str, Any], settings: Mapping[str, Any] | Any,
               app_version: str) -> dict[str, Any]:
    """The header of a recording of a run of ``spec`` (a ``kvscope.core.model.spec.ModelSpec``).

    ``device`` is a device string (``"cuda:0"``, ``"cpu"``), stored as ``{"name": device}``, or a
    mapping with more facts (name, total memory in bytes, ...). ``settings`` is a mapping of plain
    values or a ``RunSettings`` (attention mode and cache strategy are stored by their command-line
    spelling). Only plain JSON fields are kept: the spec's raw HF ``config`` is left out (it can be
    large and is not needed to replay; the spec fields are). ``created`` is the UTC time, ISO 8601.
    """
    model: dict[str, Any] = {}
    for f in dataclasses.fields(spec):
        if f.name == "config":
            continue
        value = getattr(spec, f.name)
        if f.name == "layer_states":  # kvscope.core.model.states.LayerState: each as its JSON list
            model[f.name] = None if value is None else [st.to_json() for st in value]
        elif f.name == "layer_kv":  # kvscope.core.model.states.KVShape tuples
            model[f.name] = None if value is None else [list(shape) for shape in value]
        else:
            model[f.name] = list(value) if isinstance(value, tuple) else value
    model["label"] = getattr(spec, "label", model.get("name"))
    device_dict = {"name": device} if isinstance(device, str) else dict(device)
    return {
        "format": RECORDING_FORMAT,
        "version": RECORDING_VERSION,
        "app_version": str(app_version),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "device": device_dict,
        "settings": _plain_settings(settings),
    }


def _plain_settings(settings: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(settings, Mapping):
        items = dict(settings).items()
    elif dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        items = ((f.name, getattr(settings, f.name)) for f in dataclasses.fields(settings))
    else:
        raise RecordingError(f"settings for a recording must be a mapping or RunSettings, got {type(settings).__name__}")
    plain: dict[str, Any] = {}
    for key, value in items:
        # AttentionMode / CacheStrategy: store the spelling the command line and switches use.
        if value is not None and not isinstance(value, (str, int, float, bool, list, dict)) and hasattr(value, "key"):
            value = value.key
        plain[str(key)] = value
    return plain


def _check_header(header: Any, path: Path) -> dict[str, Any]:
    """Validate a parsed header line; return it. Raises RecordingError with the specific reason."""
    name = _name(path)
    if not isinstance(header, dict):
        raise RecordingError(f"{name} is not a KV Scope recording: line 1 is not a JSON object")
    fmt = header.get("format")
    if fmt != RECORDING_FORMAT:
        raise RecordingError(f"{name} is not a KV Scope recording: format is {short_repr(fmt)}, "
                             f"expected {RECORDING_FORMAT!r}")
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RecordingError(f"recording {name} has an unknown version {short_repr(version)}; "
                             f"this KV Scope reads versions 1 to {RECORDING_VERSION}")
    if version > RECORDING_VERSION:
        raise RecordingError(f"recording version {short_repr(version)} is newer than this KV Scope "
                             f"(reads up to {RECORDING_VERSION}); update KV Scope")
    for key in ("model", "device", "settings"):
        if key in header and not isinstance(header[key], dict):
            raise RecordingError(f"recording {name} has a bad header: {key} must be an object, "
                                 f"got {type(header[key]).__name__}")
    for key in ("app_version", "created"):
        if key in header and not is_plain_text(header[key]):
            raise RecordingError(f"recording {name} has a bad header: {key} must be text")
    if isinstance(header.get("model"), dict):
        try:
            _model_fields(header["model"], complete=False)
        except RecordingError as exc:
            raise RecordingError(f"recording {name} has a {exc}") from None
    for block, fields in _HEADER_FIELDS.items():
        values = header.get(block)
        if not isinstance(values, dict):
            continue
        for key, kind in fields.items():
            if key not in values or values[key] is None:
                continue
            value = values[key]
            if kind == "text" and not (is_plain_text(value) and len(value) <= MAX_NAME_CHARS):
                raise RecordingError(f"recording {name} has a bad header: {block}.{key} must be text of at most "
                                     f"{MAX_NAME_CHARS} characters, got {short_repr(value)}")
            if kind == "count" and not _count(value):
                raise RecordingError(f"recording {name} has a bad header: {block}.{key} must be an integer from 0 "
                                     f"to 2**63-1, got {short_repr(value)}")
    return header


#: Header fields the app reads, by block, and what they must be when present and not null.
_HEADER_FIELDS: dict[str, dict[str, str]] = {
    "model": {"label": "text"},  # and every ModelSpec field: _model_fields
    "device": {"name": "text", "device_name": "text", "total_memory": "count"},
    "settings": {"attention": "text", "attn_impl": "text", "cache": "text", "dtype": "text",
                 "batch": "count", "max_new_tokens": "count", "max_context": "count", "memory_budget": "count"},
}


#: A runtime's name as the registry spells them (``transformers``, ``llama.cpp``, ``mlx``): a recording from a newer
#: KV Scope may name one this build lacks (shown as data, its rules unknown), never an empty or control-character one.
_RUNTIME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")

#: What the reader decides per field of a sample, beyond the field's own type and range (``sample_from_json``): a
#: line that breaks a rule is damage, skipped and counted (``problem()`` names the first), never drawn.
#: ``quality_top1`` (0 or 1, never a bool), ``quality_kl`` (finite, >= 0), ``kv_bytes_held`` <= ``kv_bytes_reserved``
#: and byte counts up to 2**63-1 are the field's own range, checked by ``sample_from_json``; a huge byte count the
#: range allows is drawn (the axes print it). The rules here need another field or the header:
SAMPLE_RULES = {
    "quality_token": "an id of the recorded model's vocabulary (below the header's model.vocab_size)",
    "quality_token_text": "only beside a quality_token (it is that token's text)",
    "quality_kl": "only beside quality_top1 (the probe measures both on the same token)",
    "runtime": "a runtime's name: a letter or digit, then letters, digits, '.', '_', '+' or '-' (at most 64)",
}


def sample_rules(sample: Sample, vocab_size: int | None) -> str | None:
    """Which of ``SAMPLE_RULES`` ``sample`` breaks, in one line, or None. ``vocab_size``: the header's
    ``model.vocab_size`` (None when the header does not say)."""
    if sample.quality_token is not None and vocab_size is not None and sample.quality_token >= vocab_size:
        return (f"sample field quality_token {sample.quality_token:,} is not a token of the recorded model "
                f"(its vocabulary has {vocab_size:,})")
    if sample.quality_token_text is not None and sample.quality_token is None:
        return "sample field quality_token_text is set without a quality_token"
    if sample.quality_kl is not None and sample.quality_top1 is None:
        return "sample field quality_kl is set without quality_top1"
    if sample.runtime != "transformers" and not _RUNTIME_NAME.fullmatch(sample.runtime):
        return f"sample field runtime {short_repr(sample.runtime)} is not a runtime's name"
    return None


def _vocab_size(header: Mapping[str, Any]) -> int | None:
    model = header.get("model")
    vocab = model.get("vocab_size") if isinstance(model, Mapping) else None
    return vocab if _count(vocab) and vocab > 0 else None


def _count(value: Any) -> bool:
    """A count or a byte size: an int (not a bool) from 0 to MAX_INT."""
    return type(value) is int and 0 <= value <= MAX_INT


# ------------------------------------------------------------------------------------------------
# Writing


class RecordingWriter:
    """Append Samples to a new recording, one flushed JSON line each.

    ``RecordingWriter(path, header)`` creates ``path`` with ``header`` as line 1 (``format`` and
    ``version`` are set by the writer; ``created`` is added if missing). An existing file is an
    error unless ``overwrite=True``, so a recording is never replaced by accident; the path is
    checked by ``kvscope.core.records.outputs.check_output_path`` (never a device, a folder or standard output; a
    missing folder is not created; a symbolic link is written through to its file). Thread-safe:
    ``write`` may run on the generation thread while ``close`` comes from the GUI thread.
    Write failures (disk full, file removed) raise RecordingError; lines already written stay.
    """

    def __init__(self, path: str | os.PathLike[str], header: Mapping[str, Any], *, overwrite: bool = False,
                 fsync_interval_s: float | None = FSYNC_INTERVAL_S) -> None:
        self.path = Path(path)
        self.fsync_interval_s = fsync_interval_s
        self.samples_written = 0
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        # format and version first: a reader recognises a cut-off header by its opening bytes
        full = {"format": RECORDING_FORMAT, "version": RECORDING_VERSION,
                **{k: v for k, v in header.items() if k not in ("format", "version")}}
        full.setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        try:
            line = json.dumps(full, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
        except (TypeError, ValueError) as exc:
            raise RecordingError(f"cannot write recording {_name(self.path)}: header is not plain JSON ({exc})") from None
        if len(line) > MAX_LINE_BYTES:
            raise RecordingError(f"cannot write recording {_name(self.path)}: header is larger than "
                                 f"{MAX_LINE_BYTES // (1024 * 1024)} MiB")
        try:
            out = check_output_path(self.path, force=overwrite, allow_stdout=False)
        except OutputError as exc:
            raise RecordingError(f"cannot create recording: {exc}") from None
        self.header = full
        self._vocab = _vocab_size(full)
        # Header first in a temporary sibling, fsynced, then renamed: the path either does not exist or
        # starts with a complete header, whatever moment the process dies. (Reopen after the rename
        # rather than keep the handle: Windows cannot rename a file Python holds open.)
        try:
            with replacing(out) as tmp:
                with open(tmp, "wb") as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
            _fsync_dir(out.path.parent)
            self._file = open(out.path, "ab", buffering=0)  # unbuffered: one write() = one syscall
        except OutputError as exc:
            raise RecordingError(f"cannot create recording: {exc}") from None
        except OSError as exc:
            raise RecordingError(f"cannot create recording {display_path(self.path)}: {exc.strerror or exc}") from exc
        self._last_sync = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._file is None

    def gone(self) -> str | None:
        """Why the recording is no longer at its path (deleted, or replaced by another file), or None.

        Writes to a file deleted mid-run still succeed (they go to the unlinked inode), so a run would
        end saying "recorded to ..." with nothing there; the path's file must be the one still open."""
        with self._lock:
            if self._file is None:
                return None
            mine = os.fstat(self._file.fileno())
        shown = display_path(self.path)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return (f"recording {shown} was deleted during the run: its {self.samples_written:,} samples are lost "
                    "(nothing was recorded)")
        except OSError:
            return None  # unreadable now (permissions): nothing to say for sure
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            return (f"recording {shown} was replaced by another file during the run: this run's "
                    f"{self.samples_written:,} samples are not in it")
        return None

    def check_still_there(self) -> None:
        """Raise RecordingError (``gone``'s reason) if the recording is no longer at its path: the end of a run
        says so instead of "recorded to ..." (both engines' run loops)."""
        gone = self.gone()
        if gone:
            raise RecordingError(gone)

    def write(self, sample: Sample) -> None:
        """Append one sample as one line and hand it to the OS before returning (see module doc)."""
        try:
            # Same dict as Sample.to_dict() (every field is a scalar), without dataclasses.asdict's
            # recursive deep copy, which was ~70% of the cost of a write.
            data = {name: getattr(sample, name) for name in _FIELD_NAMES}
            # Refuse here what a reader would skip (a NaN time, an unknown phase, a wrong type): a
            # producer bug shows at once, and every line written is a line that replays.
            checked_fields(data)
            broken = sample_rules(sample, self._vocab)
            if broken:
                raise ValueError(broken)
            line = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
        except (TypeError, ValueError) as exc:
            raise RecordingError(f"cannot record sample at token {getattr(sample, 'token', '?')}: {exc}") from None
        if len(line) > MAX_LINE_BYTES:
            raise RecordingError(f"cannot record sample at token {sample.token}: it is larger than "
                                 f"{MAX_LINE_BYTES // (1024 * 1024)} MiB")
        with self._lock:
            if self._file is None:
                raise RecordingError(f"recording {_name(self.path)} is closed")
            try:
                # One unbuffered write of the whole line: a kill leaves at most this line partial.
                view = memoryview(line)
                while view:
                    n = self._file.write(view)
                    view = view[n:]
                self.samples_written += 1
                now = time.monotonic()
                if self.fsync_interval_s is not None and now - self._last_sync >= self.fsync_interval_s:
                    os.fsync(self._file.fileno())
                    self._last_sync = now
            except OSError as exc:
                raise RecordingError(f"cannot write to recording {_name(self.path)}: {exc.strerror or exc}; "
                                     f"the {self.samples_written} samples before it are kept") from exc

    def close(self) -> None:
        """Fsync and close. Idempotent."""
        with self._lock:
            f, self._file = self._file, None
            if f is None:
                return
            try:
                os.fsync(f.fileno())
            except OSError as exc:
                log.warning("could not fsync recording %s: %s", self.path, exc)
            finally:
                f.close()

    def __enter__(self) -> "RecordingWriter":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); Windows cannot open a directory and does not need it."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# Reading


_KINDS_OF_FILE = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                  (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> str | None:
    """What a file that is not a regular file is ("a folder", "a FIFO (named pipe)"...), or None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS_OF_FILE if test(mode)), "not a regular file")


def _open_for_reading(path: Path) -> IO[bytes]:
    """Open a recording to read, refusing anything but a regular file before reading a byte.

    A FIFO would block the open (and the read) until some writer came; ``/dev/zero`` or
    ``/dev/urandom`` never end; a folder cannot be read. The kind is checked with ``stat`` and again
    on the opened descriptor (the name could be swapped between the two), and the open itself does
    not wait (``O_NONBLOCK``, where the system has it), so no input makes a reader hang.
    """
    shown = display_path(path)
    nonblocking = getattr(os, "O_NONBLOCK", 0)
    fd = None
    try:
        what = _not_regular(os.stat(path).st_mode)
        if not what:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | nonblocking)
    except FileNotFoundError:
        raise RecordingError(f"recording {shown} does not exist") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RecordingError(f"cannot open recording {shown}: {why}") from None
    if fd is None:
        raise RecordingError(f"{shown} is {what}, not a recording")
    try:
        what = _not_regular(os.fstat(fd).st_mode)
        if what:
            raise RecordingError(f"{shown} is {what}, not a recording")
        if nonblocking:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_line(f: IO[bytes], skip_rest: bool = True) -> tuple[bytes, bool]:
    """One line (newline included) and whether it was too long. A too-long line is returned empty
    and, with ``skip_rest``, the rest of it is consumed in bounded chunks, so memory stays under
    ``MAX_LINE_BYTES`` (a header is never skipped: a too-long one ends the read at once)."""
    line = f.readline(MAX_LINE_BYTES)
    if len(line) < MAX_LINE_BYTES or line.endswith(b"\n"):
        return line, False
    while skip_rest:  # skip the rest of the overlong line without holding it
        chunk = f.readline(MAX_LINE_BYTES)
        if not chunk or chunk.endswith(b"\n"):
            break
    return b"", True


_BOM = b"\xef\xbb\xbf"
_HEADER_START = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + RECORDING_FORMAT.encode() + rb'"')


def _parse_header_line(f: IO[bytes], path: Path) -> dict[str, Any]:
    name = _name(path)
    line, too_long = _read_line(f, skip_rest=False)
    if too_long:
        raise RecordingError(f"{name} is not a KV Scope recording: line 1 is longer than "
                             f"{MAX_LINE_BYTES // (1024 * 1024)} MiB")
    if not line:
        raise RecordingError(f"recording {name} is empty")
    if not line.strip():
        raise RecordingError(f"{name} is not a KV Scope recording: line 1 is blank")
    try:
        # Strict UTF-8 (the format's encoding), a leading BOM tolerated: json.loads(bytes) would guess
        # UTF-16/32 and let encoded surrogates through ('surrogatepass').
        header = json.loads(line.removeprefix(_BOM).decode("utf-8"))
    except (ValueError, RecursionError):
        if not line.endswith(b"\n") and _HEADER_START.match(line):
            raise RecordingError(f"recording {name} is truncated: its header line is incomplete") from None
        raise RecordingError(f"{name} is not a KV Scope recording: line 1 is not JSON") from None
    return _check_header(header, path)


def elide(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters and marked (``ELIDED``) when longer; else ``text`` itself."""
    if len(text) <= limit:
        return text
    return text[:limit] + ELIDED.format(n=len(text) - limit)


class RecordingReader:
    """Stream a recording: the header on construction, then Samples one line at a time.

    ``RecordingReader(path)`` reads and checks the header (``.header``, ``.version``) or raises
    RecordingError. Iterating yields Samples without ever holding more than one line. After (or
    during) iteration:

    * ``samples``: Samples yielded so far;
    * ``skipped``: damaged sample lines skipped (bad JSON, wrong types, too long, not UTF-8);
    * ``warnings``: one line per skipped line (the first ``MAX_WARNINGS``), ``"line N: why"``;
    * ``truncated``: True when the last line was cut off without its newline (a killed writer)
      and was dropped; a complete last line without a newline is still read;
    * ``elided``: samples whose text was cut to ``max_text`` characters.

    This is the one place recordings are read, so it is where they are checked: only regular
    files are opened (never a FIFO, a device or a folder); every line costs at most
    ``MAX_LINE_BYTES`` of memory; every field of every sample is checked for type and range by
    :func:`sample_from_json` (a line that fails is *damaged*: skipped and counted, reported by
    ``problem()`` in one line); the header's fields by ``_check_header`` (a bad header raises).

    With ``strict=True`` the first damaged line raises RecordingError instead of being skipped.
    ``max_text=N`` cuts each sample's text to N characters, marked with ``ELIDED`` (what a replay
    shows: see ``MAX_TEXT_CHARS``); by default texts are kept whole. Iterate once; the file
    closes at the end of the iteration, on ``close()`` or on ``with`` exit.
    """

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = False, max_text: int | None = None) -> None:
        self.path = Path(path)
        self.strict = strict
        self.max_text = max_text
        self.samples = 0
        self.skipped = 0
        self.elided = 0
        self.truncated = False
        self.warnings: list[str] = []
        self._iterated = False
        self._file: IO[bytes] | None = _open_for_reading(self.path)
        try:
            self.header = _parse_header_line(self._file, self.path)
        except BaseException:
            self.close()
            raise
        self.version: int = self.header["version"]
        self._vocab = _vocab_size(self.header)

    @property
    def model(self) -> dict[str, Any]:
        return self.header.get("model") or {}

    @property
    def device(self) -> dict[str, Any]:
        return self.header.get("device") or {}

    @property
    def settings(self) -> dict[str, Any]:
        return self.header.get("settings") or {}

    def _bad_line(self, number: int, why: str) -> None:
        message = f"line {number}: {why}"
        if self.strict:
            raise RecordingError(f"recording {_name(self.path)} is corrupted at {message}")
        self.skipped += 1
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(message)
        # Debug, not warning: a file with 10,000 damaged lines must not print 10,000 lines. What was
        # skipped reaches the user as one line, from problem() (export and replay both print it).
        log.debug("recording %s: skipped %s", self.path, message)

    def __iter__(self) -> Iterator[Sample]:
        if self._iterated:
            raise RecordingError(f"recording {_name(self.path)} was already read; open it again")
        self._iterated = True
        f = self._file
        if f is None:
            return
        number = 1
        try:
            while True:
                line, too_long = _read_line(f)
                number += 1
                if too_long:
                    self._bad_line(number, f"longer than {MAX_LINE_BYTES // (1024 * 1024)} MiB")
                    continue
                if not line:
                    break
                complete = line.endswith(b"\n")
                if complete and not line.strip():
                    continue  # a blank line (hand-edited file) is not data and not damage
                try:
                    sample = sample_from_json(json.loads(line.decode("utf-8")),
                                              check_unicode=_SURROGATE_ESCAPE.search(line) is not None)
                except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                    if not complete and isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
                        # A writer killed mid-line (maybe mid-character): expected, not corruption. It can
                        # only be the last line. (A last line that parses but holds bad values is damage.)
                        self.truncated = True
                        log.info("recording %s: last line %d was cut off (writer stopped mid-sample)", self.path, number)
                        break
                    unreadable = (json.JSONDecodeError, UnicodeDecodeError, RecursionError)  # JSON is UTF-8
                    why = "not valid JSON" if isinstance(exc, unreadable) else str(exc)
                    self._bad_line(number, why.splitlines()[0] if why else "unreadable")
                    continue
                broken = sample_rules(sample, self._vocab)
                if broken:
                    self._bad_line(number, broken)
                    continue
                if self.max_text is not None and len(sample.text) > self.max_text:
                    sample = dataclasses.replace(sample, text=elide(sample.text, self.max_text))
                    self.elided += 1
                self.samples += 1
                yield sample
        finally:
            self.close()

    def problem(self) -> str | None:
        """One line for the user about what reading had to skip, or None if the file was clean."""
        parts = []
        if self.skipped:
            first = f" (first: {self.warnings[0]})" if self.warnings else ""
            parts.append(f"skipped {self.skipped} damaged line{'s' if self.skipped != 1 else ''}{first}")
        if self.truncated:
            parts.append("the last sample was cut off (the recording was interrupted)")
        if not parts:
            return None
        return f"recording {_name(self.path)}: " + "; ".join(parts)

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def __enter__(self) -> "RecordingReader":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked header of a recording (reads line 1 only). Raises RecordingError."""
    p = Path(path)
    with _open_for_reading(p) as f:
        return _parse_header_line(f, p)


def iter_samples(path: str | os.PathLike[str], *, strict: bool = False) -> Iterator[Sample]:
    """Stream the Samples of a recording. Header problems raise RecordingError here, at the call;
    damaged lines are skipped (see RecordingReader; use it directly to learn what was skipped)."""
    return iter(RecordingReader(path, strict=strict))


#: More query heads than any model has by far: the calculator lists the divisors of the count.
MAX_HEADS = 1 << 16


def spec_from_header(header: Mapping[str, Any]):
    """The ModelSpec a recording's header describes (for replay's labels and calculator), validated.

    Every field is checked as the reader checks it (``_model_fields``), none may be missing, and the
    shape must be one the calculator can work with (1 to ``MAX_LAYERS`` layers, 1 to ``MAX_HEADS``
    query heads, 1 to that many KV heads, one layer type per layer, a dtype it knows). Raises
    RecordingError, one line, naming the field.
    """
    model = header.get("model")
    if not isinstance(model, Mapping):
        raise RecordingError(f"bad header: model must be an object, got {type(model).__name__}")
    kwargs = _model_fields(model, complete=True)
    layers, heads, kv_heads = kwargs["num_layers"], kwargs["num_query_heads"], kwargs["num_kv_heads"]
    if not 1 <= layers <= MAX_LAYERS:
        raise RecordingError(f"bad header: model.num_layers must be from 1 to {MAX_LAYERS:,}, got {layers:,}")
    if not 1 <= heads <= MAX_HEADS or not 1 <= kv_heads <= heads:
        raise RecordingError(f"bad header: the model has {heads:,} query heads and {kv_heads:,} KV heads "
                             f"(need 1 to {MAX_HEADS:,} query heads, and 1 to that many KV heads)")
    if kwargs["head_dim"] < 1 or kwargs["hidden_size"] < 1:
        raise RecordingError("bad header: model.head_dim and model.hidden_size must be positive")
    if len(kwargs["layer_types"]) != layers:
        raise RecordingError(f"bad header: model.layer_types has {len(kwargs['layer_types']):,} entries "
                             f"for {layers:,} layers")
    for name in ("layer_states", "layer_kv"):
        if kwargs.get(name) is not None and len(kwargs[name]) != layers:
            raise RecordingError(f"bad header: model.{name} has {len(kwargs[name]):,} entries for {layers:,} layers")
    try:
        canonical_dtype(kwargs["dtype"])
    except SpecError:
        raise RecordingError(f"bad header: model.dtype {short_repr(kwargs['dtype'])} "
                             "is not a dtype KV Scope knows") from None
    return ModelSpec(**kwargs)


def _model_fields(model: Mapping[str, Any], *, complete: bool) -> dict[str, Any]:
    """The ModelSpec keyword arguments in a header's model block, each checked against its
    annotation: names text (at most ``MAX_NAME_CHARS``, valid Unicode), flags booleans, counts
    ints from 0 to ``MAX_INT``, ``layer_types`` a list of known kinds. Fields the spec does not
    have are left out. ``complete``: a required field missing is an error (the reader, which
    also reads minimal headers, checks only the fields present). RecordingError ``bad header: ...``."""
    kinds = LAYER_KINDS
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ModelSpec):
        name, t = f.name, str(f.type)
        if name == "config":
            continue
        if name not in model:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
            if complete and required:
                raise RecordingError(f"bad header: model.{name} is missing")
            continue
        value = model[name]
        if value is None and "None" in t:
            kwargs[name] = None
            continue
        if name in ("layer_states", "layer_kv"):  # per layer: what it holds beside K/V, its K/V shape
            parsed = (states_from_json if name == "layer_states" else kv_shapes_from_json)(value)
            if parsed is False or parsed is None or len(parsed) > MAX_INT or any(
                    not all(_count(v) for v in (p.to_json() if name == "layer_states" else p)) for p in parsed):
                raise RecordingError(f"bad header: model.{name} must be a list, one entry per layer, of "
                                     f"{'states' if name == 'layer_states' else 'K/V shapes'} as KV Scope writes them")
            kwargs[name] = parsed
            continue
        if t.startswith("tuple"):
            if not isinstance(value, list) or len(value) > MAX_INT or not all(type(v) is str and v in kinds
                                                                              for v in value):
                raise RecordingError(f"bad header: model.{name} must be a list of {', '.join(kinds)}")
            value = tuple(value)
        elif t.startswith("bool"):
            if type(value) is not bool:
                raise RecordingError(f"bad header: model.{name} must be true or false, got {short_repr(value)}")
        elif t.startswith("int"):
            if not _count(value):
                raise RecordingError(f"bad header: model.{name} must be an integer from 0 to 2**63-1, "
                                     f"got {short_repr(value)}")
        elif t.startswith("float"):
            if type(value) not in (int, float) or not 0 <= value <= MAX_INT:
                raise RecordingError(f"bad header: model.{name} must be a finite number, got {short_repr(value)}")
        elif t.startswith("str"):
            if not (is_plain_text(value) and len(value) <= MAX_NAME_CHARS):
                raise RecordingError(f"bad header: model.{name} must be text of at most {MAX_NAME_CHARS} "
                                     f"characters, got {short_repr(value)}")
        kwargs[name] = value
    return kwargs

"""Recordings: a run's Samples in a versioned JSONL file, written as they happen, read as a stream.

Format (version 1)::

    line 1   {"format": "kvscope-recording", "version": 1, "app_version": "0.1.0",
              "created": "2025-01-01T12:00:00+00:00", "model": {...}, "device": {...}, "settings": {...}}
    line 2+  one ``Sample.to_dict()`` per line, UTF-8 JSON, in the order produced

Durability. Every sample is written with one ``write`` and flushed to the OS at once, so a crash or a
SIGKILL of the writing process loses at most the sample being written (the kernel already holds the
rest). ``os.fsync`` (which only matters if the *machine* dies: power loss, kernel panic) runs at most
every ``fsync_interval_s`` seconds (0.5 s by default) and on close: an fsync costs from ~0.1 ms to
tens of ms depending on the disk, and the writer runs on the generation thread between two tokens,
so fsyncing per token would disturb the tokens/s it measures at 100+ tokens/s; a time bound (not a
count bound) caps both the cost (<= 2 fsyncs/s) and the loss on power failure (<= 0.5 s), whatever
the token rate. The header is written to a temporary file, fsynced and renamed into place, so the
path never shows a file without a complete header.

Reading. Recordings are untrusted input (people share them): only ``json`` parses them, never
pickle or eval; each line is capped at ``MAX_LINE_BYTES``; the file is streamed line by line and
never loaded whole. Problems with the header (empty file, not a recording, unknown or newer
version) raise :class:`RecordingError`. Problems with a sample line are *skipped and counted* by
default rather than stopping the read: one damaged line in a long recording must not make the rest
unplayable, and skipping loses nothing that was readable (``strict=True`` raises instead). A last
line without its newline is the mark of a killed writer: it is reported as ``truncated``, not as
corruption.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from core.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample

log = logging.getLogger(__name__)

RECORDING_FORMAT = "kvscope-recording"
RECORDING_VERSION = 1
#: The longest line (bytes, newline included) written or read. A prefill sample carries the whole
#: prompt; 8 MiB is ~2M tokens of text, beyond any context window, yet small enough to hold in memory.
MAX_LINE_BYTES = 8 * 1024 * 1024
#: Default bound on the time between two fsyncs of a recording being written (seconds).
FSYNC_INTERVAL_S = 0.5
#: How many skipped-line messages a reader keeps (the count is always exact).
MAX_WARNINGS = 20

_PHASES = (PHASE_PREFILL, PHASE_DECODE, PHASE_EVENT)
_SAMPLE_FIELDS = dataclasses.fields(Sample)
_FIELD_NAMES = tuple(f.name for f in _SAMPLE_FIELDS)


class RecordingError(ValueError):
    """A recording that cannot be written or read. The message is one line, for the user."""


def _name(path: Path) -> str:
    return path.name or str(path)


# ------------------------------------------------------------------------------------------------
# Header


def header_for(spec: Any, device: str | Mapping[str, Any], settings: Mapping[str, Any] | Any,
               app_version: str) -> dict[str, Any]:
    """The header of a recording of a run of ``spec`` (a ``core.spec.ModelSpec``).

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
        raise RecordingError(f"{name} is not a KV Scope recording: format is {fmt!r}, expected {RECORDING_FORMAT!r}")
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RecordingError(f"recording {name} has an unknown version {version!r}; "
                             f"this KV Scope reads versions 1 to {RECORDING_VERSION}")
    if version > RECORDING_VERSION:
        raise RecordingError(f"recording version {version} is newer than this KV Scope "
                             f"(reads up to {RECORDING_VERSION}); update KV Scope")
    for key in ("model", "device", "settings"):
        if key in header and not isinstance(header[key], dict):
            raise RecordingError(f"recording {name} has a bad header: {key} must be an object, "
                                 f"got {type(header[key]).__name__}")
    for key in ("app_version", "created"):
        if key in header and not isinstance(header[key], str):
            raise RecordingError(f"recording {name} has a bad header: {key} must be text")
    return header


# ------------------------------------------------------------------------------------------------
# Writing


class RecordingWriter:
    """Append Samples to a new recording, one flushed JSON line each.

    ``RecordingWriter(path, header)`` creates ``path`` with ``header`` as line 1 (``format`` and
    ``version`` are set by the writer; ``created`` is added if missing). An existing file is an
    error unless ``overwrite=True``, so a recording is never replaced by accident. Thread-safe:
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
        if self.path.exists() and not overwrite:
            raise RecordingError(f"recording {self.path} already exists; choose another name or allow overwriting")
        self.header = full
        # Header first in a temporary sibling, fsynced, then renamed: the path either does not exist or
        # starts with a complete header, whatever moment the process dies. (Reopen after the rename
        # rather than keep the handle: Windows cannot rename a file Python holds open.)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
            self._file = open(self.path, "ab", buffering=0)  # unbuffered: one write() = one syscall
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise RecordingError(f"cannot create recording {self.path}: {exc.strerror or exc}") from exc
        self._last_sync = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._file is None

    def write(self, sample: Sample) -> None:
        """Append one sample as one line and hand it to the OS before returning (see module doc)."""
        try:
            # Same dict as Sample.to_dict() (every field is a scalar), without dataclasses.asdict's
            # recursive deep copy, which was ~70% of the cost of a write.
            data = {name: getattr(sample, name) for name in _FIELD_NAMES}
            # Refuse here what a reader would skip (a NaN time, an unknown phase, a wrong type): a
            # producer bug shows at once, and every line written is a line that replays.
            _checked_fields(data)
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


def _open_for_reading(path: Path) -> IO[bytes]:
    try:
        if path.is_dir():
            raise RecordingError(f"{path} is a folder, not a recording")
        return open(path, "rb")
    except FileNotFoundError:
        raise RecordingError(f"recording {path} does not exist") from None
    except OSError as exc:
        raise RecordingError(f"cannot open recording {path}: {exc.strerror or exc}") from None


def _read_line(f: IO[bytes]) -> tuple[bytes, bool]:
    """One line (newline included) and whether it was too long. A too-long line is consumed
    in bounded chunks and returned empty, so memory stays under ``MAX_LINE_BYTES``."""
    line = f.readline(MAX_LINE_BYTES)
    if len(line) < MAX_LINE_BYTES or line.endswith(b"\n"):
        return line, False
    while True:  # skip the rest of the overlong line without holding it
        chunk = f.readline(MAX_LINE_BYTES)
        if not chunk or chunk.endswith(b"\n"):
            return b"", True


_HEADER_START = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + RECORDING_FORMAT.encode() + rb'"')


def _parse_header_line(f: IO[bytes], path: Path) -> dict[str, Any]:
    name = _name(path)
    line, too_long = _read_line(f)
    if too_long:
        raise RecordingError(f"{name} is not a KV Scope recording: line 1 is longer than "
                             f"{MAX_LINE_BYTES // (1024 * 1024)} MiB")
    if not line:
        raise RecordingError(f"recording {name} is empty")
    if not line.strip():
        raise RecordingError(f"{name} is not a KV Scope recording: line 1 is blank")
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        if not line.endswith(b"\n") and _HEADER_START.match(line):
            raise RecordingError(f"recording {name} is truncated: its header line is incomplete") from None
        raise RecordingError(f"{name} is not a KV Scope recording: line 1 is not JSON") from None
    return _check_header(header, path)


def _field_checks() -> tuple[tuple[str, str | None, bool], ...]:
    """(name, kind, nullable) per Sample field, read from the annotations the way Sample.from_dict does."""
    checks = []
    for f in _SAMPLE_FIELDS:
        t = str(f.type)
        kind = ("int" if "int" in t and "float" not in t else "float" if t.startswith("float")
                else "str" if t.startswith("str") else None)
        checks.append((f.name, kind, "None" in t))
    return tuple(checks)


_CHECKS = _field_checks()
_REQUIRED = tuple(f.name for f in _SAMPLE_FIELDS
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def _allowed_types() -> dict[str, frozenset[type]]:
    """The JSON value types each Sample field accepts (json makes exactly int, float, str, bool, list,
    dict, None). Fields of a kind from_dict does not check accept any scalar."""
    allowed: dict[str, frozenset[type]] = {}
    for name, kind, nullable in _CHECKS:
        types = {"int": {int}, "float": {int, float}, "str": {str}}.get(kind or "", {int, float, str, bool})
        allowed[name] = frozenset(types | ({type(None)} if nullable else set()))
    return allowed


_ALLOWED = _allowed_types()


def sample_from_json(data: Any) -> Sample:
    """A Sample from one parsed JSON line of a recording; ValueError says what is wrong.

    The same checks and messages as ``Sample.from_dict`` (unknown keys dropped, missing fields
    and wrong types named), plus what a replay needs: an object, required fields not null, no
    booleans for numbers, a known phase, a finite time. Done here with a precomputed table of
    allowed types because it runs once per line of files with millions of lines; the slower
    field-by-field pass runs only to name what is wrong.
    """
    return Sample(**_checked_fields(data))


def _checked_fields(data: Any) -> dict[str, Any]:
    """The Sample keyword arguments in ``data`` (unknown keys dropped), checked; ValueError if bad."""
    if type(data) is not dict:
        raise ValueError(f"a sample must be a JSON object, got {type(data).__name__}")
    allowed = _ALLOWED
    unknown = False
    for key, value in data.items():
        types = allowed.get(key)
        if types is None:
            unknown = True
        elif type(value) not in types:
            _explain(data)
    kwargs = {k: v for k, v in data.items() if k in allowed} if unknown else data
    if len(kwargs) < len(_REQUIRED) or not all(name in kwargs for name in _REQUIRED):
        _explain(data)
    phase = kwargs["phase"]
    if phase not in _PHASES:
        raise ValueError(f"sample phase must be one of {', '.join(_PHASES)}, got {phase!r}")
    if not math.isfinite(kwargs["time_s"]):
        raise ValueError(f"sample time must be a finite number, got {kwargs['time_s']!r}")
    return kwargs


def _explain(data: dict[str, Any]) -> None:
    """Raise ValueError naming the first problem of a sample dict (the fast path found one)."""
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise ValueError(f"sample is missing {', '.join(missing)}")
    for name, kind, nullable in _CHECKS:
        if name not in data:
            continue
        value = data[name]
        if value is None:
            if not nullable:
                raise ValueError(f"sample field {name} must not be null")
            continue
        if kind == "int":
            raise_if = type(value) is not int
            what = "an integer"
        elif kind == "float":
            raise_if = type(value) not in (int, float)
            what = "a number"
        elif kind == "str":
            raise_if = type(value) is not str
            what = "text"
        else:
            raise_if = type(value) not in (int, float, str, bool)
            what = "a plain value"
        if raise_if:
            raise ValueError(f"sample field {name} must be {what}, got {value!r}")
    raise ValueError("sample is not valid")  # unreachable while _ALLOWED and _CHECKS agree


class RecordingReader:
    """Stream a recording: the header on construction, then Samples one line at a time.

    ``RecordingReader(path)`` reads and checks the header (``.header``, ``.version``) or raises
    RecordingError. Iterating yields Samples without ever holding more than one line. After (or
    during) iteration:

    * ``samples``: Samples yielded so far;
    * ``skipped``: damaged sample lines skipped (bad JSON, wrong types, too long, not UTF-8);
    * ``warnings``: one line per skipped line (the first ``MAX_WARNINGS``), ``"line N: why"``;
    * ``truncated``: True when the last line was cut off without its newline (a killed writer)
      and was dropped; a complete last line without a newline is still read.

    With ``strict=True`` the first damaged line raises RecordingError instead of being skipped.
    Iterate once; the file closes at the end of the iteration, on ``close()`` or on ``with`` exit.
    """

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = False) -> None:
        self.path = Path(path)
        self.strict = strict
        self.samples = 0
        self.skipped = 0
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
        log.warning("recording %s: skipped %s", self.path, message)

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
                    sample = sample_from_json(json.loads(line))
                except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                    if not complete:
                        # A writer killed mid-line: expected, not corruption. It can only be the last line.
                        self.truncated = True
                        log.info("recording %s: last line %d was cut off (writer stopped mid-sample)", self.path, number)
                        break
                    why = str(exc) if not isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError, RecursionError)) \
                        else "not valid JSON"
                    self._bad_line(number, why.splitlines()[0] if why else "unreadable")
                    continue
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


def spec_from_header(header: Mapping[str, Any]):
    """The ModelSpec a recording's header describes (for replay's labels and calculator), validated.

    Raises RecordingError when the header's model block is missing fields or has absurd values.
    """
    from core.spec import ModelSpec

    model = header.get("model")
    if not isinstance(model, Mapping):
        raise RecordingError("bad header: model must be an object")
    fields = {f.name: f for f in dataclasses.fields(ModelSpec) if f.name != "config"}
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in model:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise RecordingError(f"bad header: model.{name} is missing")
            continue
        value = model[name]
        if name == "layer_types":
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise RecordingError("bad header: model.layer_types must be a list of strings")
            value = tuple(value)
        elif f.type.startswith("int") and value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RecordingError(f"bad header: model.{name} must be a non-negative integer, got {value!r}")
        kwargs[name] = value
    if kwargs.get("num_layers", 0) <= 0 or kwargs.get("num_query_heads", 0) <= 0:
        raise RecordingError("bad header: the model has no layers or no heads")
    return ModelSpec(**kwargs)

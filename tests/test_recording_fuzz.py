"""A seeded recording fuzzer: every damaged, hostile or odd input ends cleanly (issue 18, items 4-7).

From the demo recording (``assets/demo/demo.jsonl``, made by the app) ``random.Random(SEED)`` makes
more than 200 variants in the categories below. Each goes through the paths that read recordings,
in this process:

* ``export``: ``main.main(["export", FILE, "--csv", OUT])``, the command line itself (its exit
  status, stdout and stderr, and the CSV it wrote);
* the reader: ``RecordingReader`` as export and replay use it, every sample checked against the
  ranges a sample may hold (no negative count, NaN or value beyond 64 bits gets through);
* ``replay``: ``MainWindow.open_recording`` (the replay worker on its thread, the plots, the text,
  the events table, the stats), unpaced as a ``--screenshot`` plays it.

Each variant's outcome is one of: a clean refusal (one line, nothing read), a clean partial result
(what was readable, and a one-line warning saying what was skipped), a correct result; or a
failure: a traceback (an exception escaping, an "internal error", or one logged by the window), a
hang (past the per-variant time guard), or *silently wrong* (lines dropped without a warning, a
sample intact in the file missing from the output, a value out of range shown as valid, a
well-formed file refused, a message of more than one line). The table of outcomes per category is
printed (visible without ``-s``) and the test fails on any failure.

A few variants also go through real ``python main.py replay FILE --screenshot`` and ``export``
processes (exit status, one line on stderr); the screenshot timeout and its watchdog are checked
on a replay that never ends.

``KVSCOPE_FUZZ_SEED`` picks another seed (to explore; CI uses the fixed one).
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from kvscope import main as kvscope_main
from kvscope.core.base.sample import MAX_INT, PHASE_DECODE, Sample
from kvscope.core.records.recording import MAX_LINE_BYTES, RecordingError, RecordingReader, spec_from_header
from tests.fuzzing import Hang, category_table, guard

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "assets" / "demo" / "demo.jsonl"
SEED = int(os.environ.get("KVSCOPE_FUZZ_SEED", "18"))
#: Wall-clock guard per variant and path (export, reader, replay); a variant that passes it hangs.
GUARD_S = 30.0
#: What Qt's offscreen platform prints on stderr by itself (not a message of ours).
QT_NOISE = ("This plugin does not support",)

CATEGORIES = ("cut", "flipped", "duplicated", "reordered", "wrong types", "huge numbers", "NaN/Infinity",
              "deep nesting", "binary", "non-UTF-8", "oversize", "special files")

_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(Sample)}
INT_FIELDS = [n for n, t in _FIELDS.items() if t.startswith("int")]
FLOAT_FIELDS = [n for n, t in _FIELDS.items() if t.startswith("float")]
STR_FIELDS = [n for n, t in _FIELDS.items() if t.startswith("str")]
HEADER_PATHS = [("format",), ("version",), ("app_version",), ("created",), ("model",), ("device",), ("settings",),
                ("model", "name"), ("model", "display_name"), ("model", "label"), ("model", "dtype"),
                ("model", "model_type"), ("model", "num_layers"), ("model", "num_query_heads"),
                ("model", "num_kv_heads"), ("model", "head_dim"), ("model", "hidden_size"), ("model", "layer_types"),
                ("model", "tie_word_embeddings"), ("model", "sliding_window"), ("model", "num_parameters"),
                ("device", "name"), ("device", "device_name"), ("device", "total_memory"),
                ("settings", "max_context"), ("settings", "attention"), ("settings", "batch")]
HEADER_NUMBERS = [p for p in HEADER_PATHS if p[-1] in ("version", "num_layers", "num_query_heads", "num_kv_heads",
                                                       "head_dim", "hidden_size", "num_parameters", "sliding_window",
                                                       "total_memory", "max_context", "batch")]
RAW = "\u0000raw\u0000"  # a placeholder dumped as a JSON string, then replaced by raw bytes


# ------------------------------------------------------------------------------------------------
# The generator


@dataclasses.dataclass
class Variant:
    category: str
    name: str
    data: bytes | None = None  # the file's bytes; None for a special file made by ``special``
    special: str | None = None


def _lines() -> tuple[bytes, list[bytes]]:
    lines = DEMO.read_bytes().splitlines(keepends=True)
    return lines[0], lines[1:]


def _dump(obj, raws: list[bytes] = ()) -> bytes:
    """JSON of ``obj`` (NaN and Infinity as Python's json writes them) with each RAW placeholder
    replaced, in order, by the raw bytes given."""
    text = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    for raw in raws:
        text = text.replace(json.dumps(RAW).encode(), raw, 1)
    return text + b"\n"


def _set_header(header: bytes, path: tuple[str, ...], value, raws: list[bytes] = ()) -> bytes:
    h = json.loads(header)
    target = h
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return _dump(h, raws)


def _set_sample(line: bytes, field: str, value, raws: list[bytes] = ()) -> bytes:
    d = json.loads(line)
    d[field] = value
    return _dump(d, raws)


def _with(header: bytes, body: list[bytes]) -> bytes:
    return header + b"".join(body)


def _huge_int(rng: random.Random) -> tuple[object, list[bytes]]:
    """A number no count may hold: 20-4,000 digits, negative, 2**63, 2**64, or past json's own limit."""
    pick = rng.randrange(7)
    if pick == 0:
        return RAW, [b"9" * rng.randint(20, 4000)]
    if pick == 1:
        return RAW, [b"-" + b"9" * rng.randint(2, 400)]
    if pick == 2:
        return RAW, [b"1" * 5000]  # past int max str digits: json itself refuses it
    return [2**63, 2**64, -1, -(2**63)][pick - 3], []


def _huge_float(rng: random.Random):
    return rng.choice([-1e6, -1.0, -5e-324, 1e300, 1.7976931348623157e308, 1e10, 9.3e18, -0.0 - 1e-9])


def _wrong_value(rng: random.Random):
    return rng.choice(["text", "", 1.5, True, False, None, [1, 2], {"a": 1}, [], {}, "0", ["x"] * 3, 0.1])


def generate(seed: int = SEED) -> list[Variant]:
    rng = random.Random(seed)
    header, body = _lines()
    whole = _with(header, body)
    out: list[Variant] = []

    def add(category: str, name: str, data: bytes) -> None:
        out.append(Variant(category, name, data))

    # cut: every kind of place a writer (or a copy) can stop
    add("cut", "empty", b"")
    add("cut", "inside header", whole[: rng.randrange(1, len(header) - 1)])
    add("cut", "after header", header)
    add("cut", "header without newline", header[:-1])
    ends = [len(header) + sum(len(x) for x in body[:i]) for i in range(len(body) + 1)]
    for _ in range(6):
        add("cut", "at a line end", whole[: rng.choice(ends)])
    for _ in range(12):
        add("cut", "mid-file", whole[: rng.randrange(len(header), len(whole))])
    # flipped: bit flips anywhere, in the header, in one line
    for _ in range(16):
        data = bytearray(whole)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        add("flipped", "bits anywhere", bytes(data))
    for _ in range(6):
        data = bytearray(whole)
        data[rng.randrange(len(header))] ^= 1 << rng.randrange(8)
        add("flipped", "a header bit", bytes(data))
    for _ in range(6):
        data = bytearray(whole)
        start = ends[rng.randrange(len(body))]
        data[start + rng.randrange(1, 60)] = rng.choice(b'{}[]",:0\\\n ')
        add("flipped", "a byte of syntax", bytes(data))
    # duplicated: lines, the header as a sample, a block, the whole body, many times
    for _ in range(8):
        i = rng.randrange(len(body))
        copies = [body[i]] * rng.randint(2, 60)
        add("duplicated", "one line", _with(header, body[:i] + copies + body[i:]))
    add("duplicated", "header twice", _with(header, [header] + body))
    add("duplicated", "header in the middle", _with(header, body[:50] + [header] + body[50:]))
    add("duplicated", "whole body x3", _with(header, body * 3))
    add("duplicated", "whole file twice", whole + whole)
    for _ in range(6):
        i, j = sorted(rng.sample(range(len(body)), 2))
        add("duplicated", "a block", _with(header, body[:j] + body[i:j] + body[j:]))
    add("duplicated", "a line 5,000 times", _with(header, body[:10] + [body[10]] * 5_000 + body[10:]))
    # reordered
    for _ in range(6):
        shuffled = body[:]
        rng.shuffle(shuffled)
        add("reordered", "shuffled body", _with(header, shuffled))
    add("reordered", "reversed body", _with(header, body[::-1]))
    add("reordered", "header last", b"".join(body) + header)
    add("reordered", "header second", body[0] + header + b"".join(body[1:]))
    for _ in range(6):
        swapped = body[:]
        i, j = rng.sample(range(len(body)), 2)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        add("reordered", "two lines swapped", _with(header, swapped))
    times_back = [_set_sample(line, "time_s", 100.0 - i) for i, line in enumerate(body)]
    add("reordered", "time runs backwards", _with(header, times_back))
    # wrong types: a sample field, a header field, a sample that is not an object
    for _ in range(16):
        i = rng.randrange(len(body))
        field = rng.choice(list(_FIELDS))
        line = _set_sample(body[i], field, _wrong_value(rng))
        add("wrong types", f"sample {field}", _with(header, body[:i] + [line] + body[i + 1:]))
    for _ in range(14):
        path = rng.choice(HEADER_PATHS)
        add("wrong types", "header " + ".".join(path), _with(_set_header(header, path, _wrong_value(rng)), body))
    for value in ([1, 2, 3], "just text", 42, None, True):
        i = rng.randrange(len(body))
        add("wrong types", "sample not an object", _with(header, body[:i] + [_dump(value)] + body[i + 1:]))
    add("wrong types", "header is a list", _with(b"[1, 2, 3]\n", body))
    for odd in ("{value}", "d}namic{", "<b>html</b>&amp;", "%s %d %n", "\x1b[31mred\x1b[0m", "a\nb\r\tc\u0000",
                "\u202eevil", " ", "\ufeff"):  # the right type, odd content: format strings, markup, controls
        i = rng.randrange(len(body))
        field = rng.choice(STR_FIELDS + ["event"])
        add("wrong types", f"odd text in {field}", _with(header, body[:i] + [_set_sample(body[i], field, odd)]
                                                         + body[i + 1:]))
    switches = [i for i, x in enumerate(body) if json.loads(x).get("event") == "switch"]
    for odd in ("{value}", "}{", "{0}"):
        i = rng.choice(switches)
        add("wrong types", "odd switch text", _with(header, body[:i] + [_set_sample(_set_sample(body[i], "text", odd),
                                                                                     "cache", odd)] + body[i + 1:]))
    add("wrong types", "unknown phase", _with(header, body[:5] + [_set_sample(body[5], "phase", "warmup")] + body[6:]))
    # huge numbers: counts beyond 64 bits or negative, times far away, and the largest valid values
    for _ in range(12):
        i = rng.randrange(len(body))
        field = rng.choice(INT_FIELDS)
        value, raws = _huge_int(rng)
        add("huge numbers", f"sample {field}", _with(header, body[:i] + [_set_sample(body[i], field, value, raws)]
                                                     + body[i + 1:]))
    for _ in range(6):
        i = rng.randrange(len(body))
        field = rng.choice(FLOAT_FIELDS)
        add("huge numbers", f"sample {field}", _with(header, body[:i] + [_set_sample(body[i], field,
                                                                                      _huge_float(rng))]
                                                     + body[i + 1:]))
    add("huge numbers", "first time -1e6", _with(header, [_set_sample(body[0], "time_s", -1e6)] + body[1:]))
    add("huge numbers", "time jumps 1e8 s", _with(header, body[:60] + [_set_sample(x, "time_s", 1e8 + i)
                                                                        for i, x in enumerate(body[60:])]))
    add("huge numbers", "largest valid counts", _with(header, body[:3] + [_set_sample(body[3], "kv_bytes_observed",
                                                                                       MAX_INT)] + body[4:]))
    for _ in range(6):  # the largest values a sample may hold, in every numeric field of a few samples
        picks = rng.sample(range(len(body)), 3)
        lines = body[:]
        for i in picks:
            d = json.loads(lines[i])
            for field in INT_FIELDS:
                d[field] = rng.choice([MAX_INT, rng.randrange(MAX_INT), 0])
            d["time_s"], d["tokens_per_s"] = rng.choice([(1e9, 1e9), (0.0, 0.0), (1e-300, 5e-324)])
            lines[i] = _dump(d)
        add("huge numbers", "extreme valid values", _with(header, lines))
    for _ in range(6):
        path = rng.choice(HEADER_NUMBERS)
        value, raws = _huge_int(rng)
        add("huge numbers", "header " + ".".join(path), _with(_set_header(header, path, value, raws), body))
    # NaN and Infinity, which Python's json reads by default
    for _ in range(10):
        i = rng.randrange(len(body))
        field = rng.choice(INT_FIELDS + FLOAT_FIELDS)
        value = rng.choice([math.nan, math.inf, -math.inf])
        add("NaN/Infinity", f"sample {field}", _with(header, body[:i] + [_set_sample(body[i], field, value)]
                                                     + body[i + 1:]))
    for _ in range(6):
        path = rng.choice(HEADER_NUMBERS)
        add("NaN/Infinity", "header " + ".".join(path),
            _with(_set_header(header, path, rng.choice([math.nan, math.inf, -math.inf])), body))
    add("NaN/Infinity", "every time NaN", _with(header, [_set_sample(x, "time_s", math.nan) for x in body]))
    # deep nesting: a field, a whole line, the header
    for depth in (50, 1_000, 100_000, 1_000_000, 4_000_000):
        kind = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        raw = kind[0] * depth + b"1" + kind[1] * depth
        i = rng.randrange(len(body))
        field = rng.choice(list(_FIELDS))
        add("deep nesting", f"sample {field} {depth} deep", _with(header, body[:i] + [_set_sample(body[i], field,
                                                                                                   RAW, [raw])]
                                                                  + body[i + 1:]))
    for depth in (10_000, 1_000_000):
        add("deep nesting", f"line {depth} deep", _with(header, body[:7] + [b"[" * depth + b"]" * depth + b"\n"]
                                                        + body[7:]))
        add("deep nesting", f"line {depth} deep, unclosed", _with(header, body[:7] + [b"[" * depth + b"\n"]
                                                                  + body[7:]))
    for depth in (1_000, 100_000):
        add("deep nesting", f"header model {depth} deep",
            _with(_set_header(header, ("model", "name"), RAW, [b"[" * depth + b"]" * depth]), body))
    # binary: random bytes for a line, for the file, NULs, a binary tail
    for _ in range(6):
        i = rng.randrange(len(body))
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 400)))
        add("binary", "a random line", _with(header, body[:i] + [junk + b"\n"] + body[i + 1:]))
    for size in (10, 4096, 300_000):
        add("binary", f"{size} random bytes", bytes(rng.randrange(256) for _ in range(size)))
    add("binary", "NULs in a line", _with(header, body[:4] + [body[4][:30] + b"\x00" * 50 + body[4][30:]] + body[5:]))
    add("binary", "NUL file", b"\x00" * 70_000)
    add("binary", "binary tail", whole + bytes(rng.randrange(256) for _ in range(20_000)))
    add("binary", "gzip of the file", gzip.compress(whole, mtime=0))
    add("binary", "CR only line ends", whole.replace(b"\n", b"\r"))
    add("binary", "CRLF line ends", whole.replace(b"\n", b"\r\n"))
    # non-UTF-8: Latin-1, broken sequences, surrogates escaped and encoded, UTF-16, BOM
    for _ in range(3):
        i = rng.randrange(len(body))
        line = body[i].replace(b'"text":"', b'"text":"caf\xe9 \xff\xfe ', 1)
        add("non-UTF-8", "Latin-1 bytes in a text", _with(header, body[:i] + [line] + body[i + 1:]))
    for raw in (rb'"\ud800"', rb'"a\udfff b"', rb'"\uDBFF\u0041"', rb'"ok \ud83d\ude00"'):
        i = rng.randrange(len(body))
        field = rng.choice(["text", "attention", "event", "device"])
        add("non-UTF-8", f"escaped surrogate in {field}", _with(header, body[:i] + [_set_sample(body[i], field, RAW,
                                                                                                  [raw])]
                                                                 + body[i + 1:]))
    add("non-UTF-8", "escaped surrogate in header model.name",
        _with(_set_header(header, ("model", "name"), RAW, [rb'"\ud800x"']), body))
    add("non-UTF-8", "encoded surrogate (CESU-8)", _with(header, body[:3] + [_set_sample(body[3], "text", RAW,
                                                                                           [b'"\xed\xa0\x80"'])]
                                                          + body[4:]))
    add("non-UTF-8", "overlong encoding", _with(header, body[:3] + [_set_sample(body[3], "text", RAW,
                                                                                  [b'"\xc0\xaf"'])] + body[4:]))
    add("non-UTF-8", "UTF-16 file", whole.decode("utf-8").encode("utf-16"))
    add("non-UTF-8", "UTF-8 BOM", b"\xef\xbb\xbf" + whole)
    add("non-UTF-8", "Latin-1 header", _set_header(header, ("model", "name"), RAW, [b'"caf\xe9"']) + b"".join(body))
    # oversize: texts that would take Qt minutes to lay out, lines past the cap, long labels, many events
    nospace = "x" * (8 * 1024 * 1024 - 4096)
    decode = [i for i, x in enumerate(body) if json.loads(x)["phase"] == PHASE_DECODE]
    add("oversize", "~8 MiB text without spaces", _with(header, body[:decode[3]] + [_set_sample(body[decode[3]], "text",
                                                                                                 nospace)]
                                                        + body[decode[3] + 1:]))
    big = [_set_sample(x, "text", "y" * (700 * 1024)) if i in decode[:11] else x for i, x in enumerate(body)]
    add("oversize", "11 texts of 700 KiB", _with(header, big))
    add("oversize", "a line past the cap", _with(header, body[:5] + [b'{"text": "' + b"a" * (MAX_LINE_BYTES + 10)
                                                                     + b'"}\n'] + body[5:]))
    add("oversize", "a header past the cap", b'{"format": "kvscope-recording", "x": "' + b"h" * MAX_LINE_BYTES
        + b'"}\n' + b"".join(body))
    add("oversize", "a 100 KB attention name",
        _with(header, body[:5] + [_set_sample(body[5], "attention", "m" * 100_000)] + body[6:]))
    switch = next(x for x in body if json.loads(x).get("event") == "switch")
    add("oversize", "300 switch events", _with(header, body + [switch] * 300))
    # special files are made in place (see _make_special)
    for special in ("fifo", "directory", "dev-zero", "link-to-fifo", "missing", "socket", "header only", "blank lines"):
        out.append(Variant("special files", special, special=special))
    return out


def _make_special(variant: Variant, path: Path) -> None:
    header, body = _lines()
    kind = variant.special
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-to-fifo":
        os.mkfifo(path.with_suffix(".fifo"))
        path.symlink_to(path.with_suffix(".fifo"))
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "header only":
        path.write_bytes(header)
    elif kind == "blank lines":
        path.write_bytes(header + b"\n\n" + b"\n   \n".join(body) + b"\n")
    elif kind != "missing":
        raise AssertionError(kind)


# ------------------------------------------------------------------------------------------------
# The oracle: what a correct reading of the bytes must give


@dataclasses.dataclass
class Expect:
    header_intact: bool  # line 1 is the demo's header, byte for byte, in a regular file
    candidates: int  # non-blank lines after line 1 (what a reading may not drop without saying so)
    intact: int  # of them, lines identical to one of the demo's sample lines, newline included


def expect(variant: Variant, path: Path) -> Expect:
    header, body = _lines()
    if variant.data is None:
        if variant.special in ("header only", "blank lines"):
            return Expect(True, 0 if variant.special == "header only" else len(body), 0 if variant.special ==
                          "header only" else len(body))
        return Expect(False, 0, 0)
    known = set(body)
    parts = variant.data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    rest = lines[1:]
    return Expect(bool(lines) and lines[0] == header, sum(1 for x in rest if x.strip()),
                  sum(1 for x in rest if x in known))


def sample_problem(s: Sample) -> str | None:
    """Why a sample the reader let through would be shown wrongly (out of range), or None."""
    for name, t in _FIELDS.items():
        value = getattr(s, name)
        if value is None:
            continue
        if t.startswith("int") and not (type(value) is int and 0 <= value <= MAX_INT):
            return f"{name}={value!r}"
        if t.startswith("float") and not (type(value) in (int, float) and math.isfinite(value) and value >= 0):
            return f"{name}={value!r}"
        if t.startswith("str"):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return f"{name} is not valid Unicode"
    return None


# ------------------------------------------------------------------------------------------------
# Running one variant


FAILURES = ("traceback", "hang", "silently wrong")


def one_line(text: str) -> bool:
    return "\n" not in text.strip() and "Traceback" not in text


def run_export(path: Path, out: Path, exp: Expect, capsys) -> tuple[str, str]:
    """``main.py export`` in this process: (outcome, detail)."""
    capsys.readouterr()
    try:
        with guard(GUARD_S):
            code = kvscope_main.main(["export", str(path), "--csv", str(out)])
    except Hang as exc:
        return "hang", str(exc)
    except BaseException as exc:  # noqa: BLE001 - what escapes main() is a traceback for the user
        return "traceback", f"{type(exc).__name__}: {exc}"
    captured = capsys.readouterr()
    err = "\n".join(x for x in captured.err.splitlines() if not x.startswith(QT_NOISE)).strip()
    if "internal error" in err or "Traceback" in err:
        return "traceback", err[:300]
    if err and not (one_line(err) and err.startswith("kvscope: ")):
        return "silently wrong", f"stderr is not one line: {err[:300]!r}"
    if code == 2:
        if exp.header_intact:
            return "silently wrong", f"a readable recording was refused: {err}"
        return "refused", err
    if code != 0:
        return "silently wrong", f"exit {code} without a message" if not err else f"exit {code}: {err}"
    if not out.is_file():
        return "silently wrong", "exit 0 and no CSV"
    limit = csv.field_size_limit(2 * MAX_LINE_BYTES)  # a text may be ~8 MiB: the csv module's default is 128 KiB
    try:
        with open(out, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    finally:
        csv.field_size_limit(limit)
    if len(rows) < exp.intact:
        return "silently wrong", f"{len(rows)} rows, but {exp.intact} intact sample lines"
    if len(rows) < exp.candidates and not err:
        return "silently wrong", f"{len(rows)} of {exp.candidates} lines exported, exit 0 and no warning"
    for row in rows:
        for name in INT_FIELDS:
            if row[name] and not (row[name].isdigit() and int(row[name]) <= MAX_INT):
                return "silently wrong", f"CSV {name}={row[name][:40]!r}"
        for name in FLOAT_FIELDS:
            if row[name] and not (math.isfinite(float(row[name])) and float(row[name]) >= 0):
                return "silently wrong", f"CSV {name}={row[name]!r}"
    return ("partial" if err else "correct"), err


def run_reader(path: Path, exp: Expect) -> tuple[str, str, int | None]:
    """The reader as replay and export use it: (outcome, detail, what a replay must show). What it must
    show: None if the file is refused; the error text if the replay must refuse it (its header's
    model is not one the replay can show: ``spec_from_header``); else the decode samples read."""
    try:
        with guard(GUARD_S):
            try:
                reader = RecordingReader(path)
            except RecordingError as exc:
                if not one_line(str(exc)):
                    return "silently wrong", f"refusal of more than one line: {str(exc)[:200]!r}", None
                if exp.header_intact:
                    return "silently wrong", f"a readable recording was refused: {exc}", None
                return "refused", str(exc), None
            with reader:
                samples = list(reader)
    except Hang as exc:
        return "hang", str(exc), None
    except Exception as exc:  # noqa: BLE001 - only RecordingError is a clean refusal
        return "traceback", f"{type(exc).__name__}: {exc}", None
    for s in samples:
        bad = sample_problem(s)
        if bad:
            return "silently wrong", f"a sample out of range got through: {bad}", None
    problem = reader.problem()
    if problem is not None and not one_line(problem):
        return "silently wrong", f"warning of more than one line: {problem[:200]!r}", None
    if len(samples) < exp.intact:
        return "silently wrong", f"{len(samples)} samples, but {exp.intact} intact lines", None
    if len(samples) + reader.skipped < exp.candidates and not reader.truncated:
        return "silently wrong", "lines dropped without being counted", None
    if len(samples) < exp.candidates and problem is None:
        return "silently wrong", f"{len(samples)} of {exp.candidates} lines read and no warning", None
    try:
        spec_from_header(reader.header)
    except RecordingError as exc:
        return ("partial" if problem else "correct"), problem or "", str(exc)
    return ("partial" if problem else "correct"), problem or "", sum(1 for s in samples if s.phase == PHASE_DECODE)


def replay_in_window(window, qtbot, path: Path, exp: Expect, decode: int | str | None,
                     records: list) -> tuple[str, str]:
    """``window.open_recording`` unpaced (as ``replay --screenshot`` plays), to the end: (outcome, detail)."""
    records.clear()
    with qtbot.capture_exceptions() as exceptions:
        try:
            with qtbot.waitSignal(window.run_finished, timeout=int(GUARD_S * 1000)):
                assert window.open_recording(str(path), speed=math.inf)
        except qtbot.TimeoutError:
            window.stop_run()
            qtbot.waitUntil(lambda: window.state == "idle", timeout=10_000)
            return "hang", f"no end after {GUARD_S:g} s ({window.decode_tokens} tokens)"
        # (the end of a run has drawn the plots, the text and the numbers: MainWindow._on_finished)
    if exceptions:
        kind, value, _tb = exceptions[0]
        return "traceback", f"{kind.__name__}: {value}"
    logged = [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    if logged:
        return "traceback", f"logged: {logged[0].getMessage()[:200]}"
    error = window.last_error
    if error and not one_line(error):
        return "silently wrong", f"error of more than one line: {error[:200]!r}"
    if decode is None or isinstance(decode, str):  # the file (or its model, for a replay) is refused
        if not error or window.decode_tokens:
            return "silently wrong", f"a refused file replayed {window.decode_tokens} tokens, error {error!r}"
        return "refused", error
    if window.decode_tokens != decode:
        return "silently wrong", f"{window.decode_tokens} tokens shown, the reader read {decode}"
    return ("partial" if error else "correct"), error


WORST = ("hang", "traceback", "silently wrong", "refused", "partial", "correct")


class _Records(logging.Handler):
    def __init__(self, records: list) -> None:
        super().__init__(level=logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def replay_window(qtbot, settings):
    from kvscope.ui.main_window import MainWindow

    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    w.resize(1000, 700)  # small: painting is most of a replay's cost, and the fuzzer replays 200+ files
    w.show()
    qtbot.waitUntil(lambda: w.calculator.warm, timeout=60_000)
    yield w
    w.shutdown()


def test_the_generator_is_seeded_and_covers_every_category():
    a, b = generate(SEED), generate(SEED)
    assert [(v.name, v.data) for v in a] == [(v.name, v.data) for v in b]
    assert len(a) >= 200
    assert {v.category for v in a} == set(CATEGORIES)


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not hasattr(signal, "setitimer"), reason="POSIX (FIFOs, SIGALRM)")
def test_every_variant_ends_cleanly(replay_window, qtbot, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVSCOPE_DEBUG", raising=False)
    variants = generate(SEED)
    records: list = []
    handler = _Records(records)
    root = logging.getLogger()
    root.addHandler(handler)
    table = {c: Counter() for c in CATEGORIES}
    failures = []
    spent: Counter = Counter()  # seconds per path, for the summary
    started = time.monotonic()
    try:
        for n, variant in enumerate(variants):
            path = tmp_path / f"v{n:03d}.jsonl"
            if variant.data is not None:
                path.write_bytes(variant.data)
            else:
                _make_special(variant, path)
            exp = expect(variant, path)
            outcomes = []
            t0 = time.monotonic()
            export = run_export(path, tmp_path / f"v{n:03d}.csv", exp, capsys)
            outcomes.append(("export",) + export)
            t1 = time.monotonic()
            reader = run_reader(path, exp)
            outcomes.append(("reader",) + reader[:2])
            t2 = time.monotonic()
            if reader[0] not in ("hang", "traceback"):
                outcomes.append(("replay",) + replay_in_window(replay_window, qtbot, path, exp, reader[2], records))
            spent.update(export=t1 - t0, reader=t2 - t1, replay=time.monotonic() - t2)
            worst = min(outcomes, key=lambda o: WORST.index(o[1]))
            if os.environ.get("KVSCOPE_FUZZ_VERBOSE"):
                with capsys.disabled():
                    print(f"#{n} {variant.category} / {variant.name}: {worst[1]} "
                          f"({time.monotonic() - started:.1f} s) {[o[:2] for o in outcomes]}")
            table[variant.category][worst[1]] += 1
            if worst[1] in FAILURES:
                failures.append(f"{variant.category} / {variant.name} (#{n}): {worst[0]}: {worst[1]}: {worst[2]}")
            if variant.data is not None and len(variant.data) > 1_000_000:
                path.unlink()  # keep tmp_path small
    finally:
        root.removeHandler(handler)
    elapsed = time.monotonic() - started
    with capsys.disabled():
        print()
        print(render_table(table, SEED, len(variants), elapsed))
        print("time per path: " + ", ".join(f"{k} {v:.0f} s" for k, v in spent.items()))
        for line in failures:
            print("  FAIL " + line)
    assert not failures, "\n".join(failures)


def render_table(table: dict[str, Counter], seed: int, n: int, elapsed: float) -> str:
    head = f"{'category':<15}{'tried':>6}{'clean':>6} {'(refused/partial/correct)':<26}{'traceback':>10}" \
           f"{'hang':>6}{'silently wrong':>16}"
    return category_table(f"recording fuzzer, seed {seed}: {n} variants in {elapsed:.0f} s", head, table, _row)


def _row(name: str, c: Counter) -> str:
    tried = sum(c.values())
    clean = c["refused"] + c["partial"] + c["correct"]
    split = f"({c['refused']}/{c['partial']}/{c['correct']})"
    return f"{name:<15}{tried:>6}{clean:>6} {split:<26}{c['traceback']:>10}{c['hang']:>6}{c['silently wrong']:>16}"


# ------------------------------------------------------------------------------------------------
# Real processes: exit status and one line on stderr


def _cli_variants(tmp_path: Path) -> list[tuple[str, Path, int, int, str]]:
    """(name, file, replay exit, export exit, what stderr must say) for the issue's own examples."""
    header, body = _lines()
    made = []

    def write(name: str, data: bytes) -> Path:
        p = tmp_path / f"{name}.jsonl"
        p.write_bytes(data)
        return p

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    made.append(("FIFO", fifo, 2, 2, "FIFO"))
    i = next(k for k, x in enumerate(body) if json.loads(x)["phase"] == PHASE_DECODE)
    made.append(("400-digit token", write("token", _with(header, body[:i] + [_set_sample(body[i], "token", RAW,
                                                                                         [b"9" * 400])]
                                                                  + body[i + 1:])), 1, 0, "skipped 1 damaged line"))
    made.append(("time_s -1e6 first", write("time", _with(header, [_set_sample(body[0], "time_s", -1e6)] + body[1:])),
                 1, 0, "time_s must be from 0"))
    made.append(("model.name an object", write("name", _with(_set_header(header, ("model", "name"), {"a": 1}), body)),
                 2, 2, "model.name must be text"))
    made.append(("~8 MiB text without spaces", write("text", _with(header, body[:i] + [
        _set_sample(body[i], "text", "x" * (8 * 1024 * 1024 - 4096))] + body[i + 1:])), 0, 0, ""))
    return made


def _stderr_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip() and not x.startswith(QT_NOISE)]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX (FIFOs)")
def test_cli_replay_and_export_exit_codes_and_one_line(tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    env.pop("KVSCOPE_DEBUG", None)
    runs = []
    for name, path, replay_code, export_code, says in _cli_variants(tmp_path):
        png, out = tmp_path / f"{path.stem}.png", tmp_path / f"{path.stem}.csv"
        for command, code in ((["replay", str(path), "--screenshot", str(png)], replay_code),
                              (["export", str(path), "--csv", str(out)], export_code)):
            proc = subprocess.Popen([sys.executable, str(REPO / "main.py"), *command], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            runs.append((name, command[0], code, says, proc))
    problems = []
    for name, command, code, says, proc in runs:
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            problems.append(f"{name}: {command} hung")
            continue
        lines = _stderr_lines(stderr)
        if proc.returncode != code or len(lines) > 1 or (says and not (lines and says in lines[0])) \
                or any(not x.startswith("kvscope: ") for x in lines) or "Traceback" in stderr:
            problems.append(f"{name}: {command} exited {proc.returncode} (expected {code}), stderr {lines!r}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# Bounded pacing, and the screenshot timeout that fires


def test_replay_pacing_is_bounded_by_the_gap_cap(qapp, tmp_path, monkeypatch):
    """At 1x a recording whose time jumps by 1e8 s (or starts at 0 and ends a day later) plays in
    seconds: each gap is waited at most MAX_GAP_S; a time running backwards waits nothing."""
    from kvscope.workers import replay
    from kvscope.workers.replay import _ReplayWorker

    monkeypatch.setattr(replay, "MAX_GAP_S", 0.5)
    MAX_GAP_S = 0.5
    header, body = _lines()
    lines = [_set_sample(x, "time_s", [0.0, 1e8, 5.0, 86_400.0][i]) for i, x in enumerate(body[:4])]
    path = tmp_path / "jumps.jsonl"
    path.write_bytes(_with(header, lines))
    worker = _ReplayWorker(str(path), 1.0)
    got, errors = [], []
    worker.samples.connect(lambda batch: (got.extend(batch), worker.credits.release()))
    worker.errored.connect(errors.append)
    started = time.monotonic()
    worker.work()
    elapsed = time.monotonic() - started
    assert len(got) == 4 and errors == []
    assert 2 * MAX_GAP_S - 0.2 < elapsed < 2 * MAX_GAP_S + 3  # two capped gaps, one backwards, none long


def test_screenshot_timeout_fires_with_a_message_and_status_2(qtbot, tmp_path, capsys, monkeypatch):
    import kvscope.ui.app
    from kvscope.workers import replay

    slow = replay._ReplayWorker._emit

    def crawl(self, batch):
        time.sleep(0.5)  # a replay that would take far longer than the timeout
        slow(self, batch)

    monkeypatch.setattr(replay._ReplayWorker, "_emit", crawl)
    monkeypatch.setattr(kvscope.ui.app, "SCREENSHOT_TIMEOUT_S", 1.0)
    out = tmp_path / "slow.png"
    started = time.monotonic()
    assert kvscope.ui.app.run_replay(str(DEMO), screenshot=str(out)) == 2
    assert time.monotonic() - started < 30
    err = _stderr_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("kvscope: gave up after 1 s with "), err
    assert out.is_file()  # what was shown by then


def test_screenshot_watchdog_ends_a_replay_whose_window_stopped_answering(tmp_path):
    """A QTimer cannot fire while the GUI thread is stuck; the watchdog thread ends the process anyway."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        import kvscope.ui.app
        from kvscope.ui.main_window import MainWindow
        kvscope.ui.app.SCREENSHOT_TIMEOUT_S, kvscope.ui.app.WATCHDOG_GRACE_S = 0.5, 1.0
        MainWindow.open_recording = lambda self, *a, **k: time.sleep(120) or True  # the GUI thread is stuck
        sys.exit(kvscope.ui.app.run_replay({str(DEMO)!r}, screenshot={str(tmp_path / "x.png")!r}))
    """)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 60
    lines = _stderr_lines(proc.stderr)
    assert lines == ["kvscope: gave up after 1.5 s (the window stopped responding) with 0 tokens"], proc.stderr


def test_text_view_paragraphs_stay_bounded(replay_window):
    """Tokens without spaces or newlines go into paragraphs of at most TEXT_BLOCK_CHARS, so each
    insertion lays out a bounded paragraph (one growing paragraph made 200 KB take minutes)."""
    from kvscope.ui.main_window import TEXT_BLOCK_CHARS

    w = replay_window
    w.reset_view()
    started = time.monotonic()
    for _ in range(50):
        w.text_view.pending.extend([("token", "z" * 4000), ("token", " word" * 300), ("marker", " \u27e8mqa\u27e9 ")])
        w.text_view.flush(w.theme)
    assert time.monotonic() - started < 20
    doc = w.text_view.document()
    lengths = [doc.findBlockByNumber(i).length() - 1 for i in range(doc.blockCount())]
    assert max(lengths) <= TEXT_BLOCK_CHARS
    assert sum(lengths) == 50 * (4000 + 1500 + len(" \u27e8mqa\u27e9 "))  # nothing lost

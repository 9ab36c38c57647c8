"""A seeded fuzzer of the weights files a run loads (issue 38, item 7): hostile safetensors made from the real
SmolLM2-135M's ``model.safetensors`` header.

``random.Random(SEED)`` edits the real header (a dtype, a shape, offsets, a tensor gone or twice, the length prefix,
non-JSON, non-UTF-8 bytes, deep nesting) or the file's length (truncated, bytes added) and writes each variant as a
sparse file (the header, then the data's length of zeros: no 270 MB copy). Each goes through KV Scope's own reader
(``kvscope.core.model.weights_file.check_safetensors``, what both runtimes ask before a library opens the file)
under a time guard, and the outcome is judged against the safetensors library itself:

* *refused*: one line (a ``WeightsFileError`` naming the file) for a file the library refuses too;
* *correct*: accepted, and the library opens it with the same tensors, dtypes and shapes;
* *stricter*: refused though the library opens it (counted, shown; not a failure);
* failures: a traceback (any other exception), a hang (past the guard), *silently wrong* (accepted while the
  library refuses it, or accepted with other tensors than the library's), a message of more than one line.

The table of counts per category is printed (visible with ``-s`` or in the captured output of a failure) and the
test fails on any failure. ``KVSCOPE_FUZZ_SEED`` picks another seed (to explore; CI uses the fixed one).
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from collections import Counter
from pathlib import Path

from kvscope.core.model.weights_file import WeightsFileError, check_safetensors
from tests.fuzzing import Hang, category_table, guard

SEED = int(os.environ.get("KVSCOPE_FUZZ_SEED", "38"))
VARIANTS = 240
GUARD_S = 10.0
CATEGORIES = ("dtype", "shape", "offsets", "tensors", "length prefix", "header bytes", "file length", "valid edits")


def _real_header() -> tuple[dict, int]:
    from tests.real_models import smollm2_folder

    path = smollm2_folder() / "model.safetensors"
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return header, path.stat().st_size - 8 - length


def _tensors(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def _write(path: Path, header_bytes: bytes, data_size: int, prefix: int | None = None) -> Path:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes) if prefix is None else prefix))
        f.write(header_bytes)
        f.truncate(8 + len(header_bytes) + max(data_size, 0))  # sparse: zeros, no disk
    return path


def _variants(rng: random.Random, header: dict, data_size: int):
    """(category, what, header bytes, data size, length prefix or None), VARIANTS of them."""
    names = _tensors(header)
    dumps = lambda h: json.dumps(h).encode()  # noqa: E731
    for i in range(VARIANTS):
        category = CATEGORIES[i % len(CATEGORIES)]
        h = json.loads(json.dumps(header))
        name = rng.choice(names)
        entry = h[name]
        size, prefix, raw = data_size, None, None
        if category == "dtype":
            entry["dtype"] = rng.choice(["F64", "F32", "I64", "BF16" if entry["dtype"] != "BF16" else "F16", "Q4",
                                         "", None, 7, "f16", "F4", "F8_E4M3"])
            what = f"{name} dtype {entry['dtype']!r}"
        elif category == "shape":
            shape = list(entry["shape"])
            change = rng.choice(["grow", "shrink", "negative", "float", "bool", "huge", "deep", "string", "swap"])
            if change == "grow":
                shape[rng.randrange(len(shape))] += rng.randint(1, 9)
            elif change == "shrink":
                shape = shape[:-1] or [0]
            elif change == "negative":
                shape[0] = -shape[0]
            elif change == "float":
                shape[0] = shape[0] + 0.5
            elif change == "bool":
                shape = [True] * len(shape)
            elif change == "huge":
                shape[0] = 2 ** rng.choice([48, 63, 64, 200])
            elif change == "deep":
                shape = [1] * 17
            elif change == "string":
                shape = "576,576"
            else:
                shape = shape[::-1]  # the same bytes: a lie the format cannot see
            entry["shape"] = shape
            what = f"{name} shape {change}"
        elif category == "offsets":
            start, end = entry["data_offsets"]
            change = rng.choice(["past end", "overlap", "gap", "reversed", "negative", "float", "three", "huge"])
            entry["data_offsets"] = {
                "past end": [start + data_size, end + data_size], "overlap": [max(start - 2, 0), end - 2],
                "gap": [start + 2, end + 2], "reversed": [end, start], "negative": [-start - 1, end],
                "float": [start + 0.0, end], "three": [start, end, end], "huge": [start, 2**64]}[change]
            what = f"{name} offsets {change}"
        elif category == "tensors":
            change = rng.choice(["drop", "twice", "not an object", "extra", "metadata"])
            if change == "drop":
                del h[name]
            elif change == "twice":
                h[name + ".copy"] = dict(entry)
            elif change == "not an object":
                h[name] = [entry["dtype"], entry["shape"]]
            elif change == "extra":
                h["extra.weight"] = {"dtype": "F32", "shape": [4], "data_offsets": [data_size, data_size + 16]}
            else:
                h["__metadata__"] = rng.choice([{"format": "pt"}, {"x": 1}, [1, 2], "text", None])
            what = f"tensors {change}"
        elif category == "length prefix":
            raw = dumps(h)
            prefix = rng.choice([0, 1, 7, len(raw) - 1, len(raw) + 1, len(raw) + data_size + 9, 10**8 + 1, 2**60,
                                 2**64 - 1])
            what = f"length prefix {prefix}"
        elif category == "header bytes":
            raw = dumps(h)
            change = rng.choice(["cut", "non-utf8", "not an object", "nested", "nul", "bom"])
            if change == "cut":
                raw = raw[: rng.randrange(1, len(raw))]
            elif change == "non-utf8":
                at = rng.randrange(len(raw))
                raw = raw[:at] + b"\xff\xfe" + raw[at + 2:]
            elif change == "not an object":
                raw = json.dumps(list(h)).encode()
            elif change == "nested":
                raw = b"[" * 100_000 + b"]" * 100_000
            elif change == "nul":
                raw = raw + b"\x00" * rng.randint(1, 64)
            else:
                raw = b"\xef\xbb\xbf" + raw
            what = f"header {change}"
        elif category == "file length":
            size = rng.choice([0, data_size // 2, data_size - 1, int(data_size * 0.999), data_size + 1,
                               data_size + 4096, -len(dumps(h)) - 1])
            what = f"data {size:,} of {data_size:,} bytes"
        else:  # edits that keep the file valid: the reader must accept them
            change = rng.choice(["as is", "metadata", "pad with spaces", "reordered keys"])
            if change == "metadata":
                h["__metadata__"] = {"format": "pt", "note": "edited"}
            elif change == "reordered keys":
                h = dict(reversed(list(h.items())))
            raw = dumps(h) + (b" " * rng.randint(1, 7) if change == "pad with spaces" else b"")
            what = f"valid: {change}"
        yield category, what, raw if raw is not None else dumps(h), size, prefix


def _library_opens(path: Path) -> dict | None:
    """What the safetensors library makes of the file: {tensor: (dtype, shape)}, or None when it refuses it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            out = {}
            for key in f.keys():
                piece = f.get_slice(key)
                out[key] = (piece.get_dtype(), tuple(piece.get_shape()))
            return out
    except Exception:  # noqa: BLE001 - any refusal of the library's is a refusal
        return None


def test_hostile_safetensors_headers(tmp_path):
    header, data_size = _real_header()
    rng = random.Random(SEED)
    table: dict[str, Counter] = {c: Counter() for c in CATEGORIES}
    failures: list[str] = []
    started = time.monotonic()
    slowest = 0.0
    for n, (category, what, raw, size, prefix) in enumerate(_variants(rng, header, data_size)):
        path = _write(tmp_path / f"v{n}.safetensors", raw, size, prefix)
        t0 = time.monotonic()
        try:
            with guard(GUARD_S):
                ours = check_safetensors(path, "model")
            error = None
        except WeightsFileError as exc:
            ours, error = None, str(exc)
        except Hang:
            table[category]["hang"] += 1
            failures.append(f"{category}: {what}: hang")
            continue
        except Exception as exc:  # noqa: BLE001 - the fuzzer's point: nothing else may escape
            table[category]["traceback"] += 1
            failures.append(f"{category}: {what}: {type(exc).__name__}: {exc}"[:300])
            continue
        finally:
            slowest = max(slowest, time.monotonic() - t0)
        theirs = _library_opens(path)
        if error is not None:
            if "\n" in error or not error.startswith("model: "):
                table[category]["silently wrong"] += 1
                failures.append(f"{category}: {what}: not one line naming the model: {error!r}")
            elif theirs is not None:
                table[category]["stricter"] += 1
            else:
                table[category]["refused"] += 1
        elif theirs is None or {k: v[1] for k, v in ours.items()} != {k: v[1] for k, v in theirs.items()}:
            table[category]["silently wrong"] += 1
            failures.append(f"{category}: {what}: accepted, the library {'refuses it' if theirs is None else 'disagrees'}")
        else:
            table[category]["correct"] += 1
        path.unlink()
    elapsed = time.monotonic() - started
    head = f"{'category':<15}{'tried':>6}{'refused':>8}{'correct':>8}{'stricter':>9}{'traceback':>10}{'hang':>5}" \
           f"{'silently wrong':>15}"
    print("\n" + category_table(f"safetensors fuzzer, seed {SEED}: {VARIANTS} variants of SmolLM2-135M's header in "
                                f"{elapsed:.1f} s (slowest {slowest:.2f} s)", head, table, _row))
    assert not failures, "\n".join(failures[:20])
    assert sum(sum(c.values()) for c in table.values()) == VARIANTS
    assert table["valid edits"]["correct"] == sum(table["valid edits"].values()) > 0  # valid files are read
    for category in CATEGORIES[:-1]:
        assert table[category]["refused"] > 0, category  # every category does reach a refusal


def _row(name: str, c: Counter) -> str:
    return (f"{name:<15}{sum(c.values()):>6}{c['refused']:>8}{c['correct']:>8}{c['stricter']:>9}{c['traceback']:>10}"
            f"{c['hang']:>5}{c['silently wrong']:>15}")

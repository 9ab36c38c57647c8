"""A seeded GGUF fuzzer: every damaged, hostile or odd GGUF ends as a one-line refusal or a correct reading
(issue 29, items 1, 5 and 7).

``random.Random(SEED)`` makes more than 200 GGUF files, each written byte by byte here (``GgufFile``: the
format of ggml's docs/gguf.md, so any field can hold any type, count or length), in the categories below. Each
goes through, in this process:

* the header reader: ``kvscope.core.model.gguf.read_gguf`` and ``GgufModel.spec()``, and llama.cpp's plan of the header
  (``kvscope.core.prediction.llamacpp.plan``) where the reading succeeds;
* ``calc``: ``main.main(["calc", "--model", FILE, ...])``, the command line itself (exit status, stdout, stderr),
  as a table and as JSON.

Outcomes: **refused** (``read_gguf`` raised a SpecError; ``calc`` exited 2 with that same message on one line of
stderr, and nothing on stdout), **correct** (the reading equals what the generator wrote, or, for a damaged
file that still reads, obeys every limit llama.cpp sets, and ``calc`` printed it with exit 0); or a failure:
**traceback** (any other exception, an "internal error", exit 1), **hang** (past the per-variant guard), or
**silently wrong** (a reading that differs from what was written, a value past llama.cpp's limits accepted, a
refusal where a correct file was written, a message of more than one line, a control character printed raw).

A handful of the issue's own files also go through real ``python main.py calc`` processes (exit status, one
line, seconds). The table of outcomes per category is printed (visible without ``-s``).

``KVSCOPE_FUZZ_SEED`` picks another seed (to explore; CI uses the fixed one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import resource
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvscope import main as kvscope_main
from kvscope.core.base.safe_text import is_safe, safe_text
from kvscope.core.model.gguf import GGML_TYPES, LLAMA_MAX_LAYERS, OWN_CACHE, read_gguf
from kvscope.core.model.spec import SpecError
from tests.fuzzing import Hang, category_table, guard

REPO = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("KVSCOPE_FUZZ_SEED", "29"))
#: Wall-clock guard per variant and path; a variant that passes it hangs (the reader takes milliseconds).
GUARD_S = 20.0
#: The most Python memory one reading may allocate (tracemalloc's peak): the 262K-token header takes ~3 MB (its
#: 4,608-tensor one too); what a header claims is never allocated.
MAX_READ_ALLOCATION = 32 << 20
TRACE_BELOW = 4 << 20
PEAKS: list[int] = []  # tracemalloc's peak of every reading, for the summary
CATEGORIES = ("valid", "cut", "flipped", "huge counts", "huge lengths", "wrong types", "zero heads",
              "absurd heads", "escape codes")
OUTCOMES = ("refused", "correct", "traceback", "hang", "silently wrong")
FAILURES = ("traceback", "hang", "silently wrong")

# ------------------------------------------------------------------------------------------------
# GGUF, byte by byte (ggml's docs/gguf.md: little-endian; a string is a u64 length and its bytes; a key-value
# pair is a string key, a u32 value type and the value; an array is a u32 element type, a u64 count and the
# elements; a tensor info is a string name, a u32 dimension count, u64 dimensions, a u32 ggml type and a u64
# offset into the data, which starts at the next multiple of the alignment).

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "B", U64: "Q", I64: "q", F64: "d"}
F32_T, F16_T, Q8_0_T = 0, 1, 8


class _Raw(bytes):
    """A value written as these bytes, whatever its type says (a count or a length that lies)."""


def gstr(text: str | bytes) -> bytes:
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    return struct.pack("<Q", len(raw)) + raw


def gvalue(vtype: int, value: Any, sub: int | None = None) -> bytes:
    if isinstance(value, _Raw):
        return bytes(value)
    if vtype == STR:
        return gstr(value)
    if vtype == ARR:
        if sub in _FMT:  # numbers in one pack: a 1M-element array is written in milliseconds
            return struct.pack(f"<IQ{len(value)}{_FMT[sub]}", sub, len(value), *value)
        return struct.pack("<IQ", sub, len(value)) + b"".join(gvalue(sub, v) for v in value)
    return struct.pack("<" + _FMT[vtype], value)


@dataclasses.dataclass
class Tensor:
    name: str
    dims: tuple[int, ...]  # ggml order: the row (ne0) first
    ggml_type: int = F16_T


@dataclasses.dataclass
class GgufFile:
    """A GGUF to write: metadata as (key, type, value, element type) in order, tensors with their shapes."""

    meta: list[tuple[str, int, Any, int | None]]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32
    data_cap: int = 1 << 26  # zeros written for the data at most (a tensor that claims 2^40 bytes gets this much)

    def set(self, key: str, vtype: int, value: Any, sub: int | None = None) -> "GgufFile":
        for i, (k, *_rest) in enumerate(self.meta):
            if k == key:
                self.meta[i] = (key, vtype, value, sub)
                return self
        self.meta.append((key, vtype, value, sub))
        return self

    def drop(self, key: str) -> "GgufFile":
        self.meta = [m for m in self.meta if m[0] != key]
        return self

    def tensor_bytes(self, t: Tensor) -> int:
        _name, block, size = GGML_TYPES[t.ggml_type]
        n = 1
        for d in t.dims:
            n *= d
        return n // block * size

    def to_bytes(self) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.meta)))
        for key, vtype, value, sub in self.meta:
            out += gstr(key) + struct.pack("<I", vtype) + gvalue(vtype, value, sub)
        offset = 0
        for t in self.tensors:
            out += gstr(t.name) + struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims)
            out += struct.pack("<IQ", t.ggml_type, offset % 2**64)  # a tensor past 2^64 bytes wraps, as in C
            offset += -(-self.tensor_bytes(t) // self.alignment) * self.alignment
        out += b"\0" * (-len(out) % self.alignment)
        return bytes(out) + b"\0" * min(offset, self.data_cap)


@dataclasses.dataclass(frozen=True)
class Truth:
    """What a valid generated file says, to compare the reading with."""

    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_k: int
    n_ctx_train: int
    n_vocab: int
    parameters: int
    weight_bytes: int
    tied: bool


def model(rng: random.Random | None = None, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
          n_head_kv: int = 2, n_ff: int = 128, vocab: int = 32, ctx: int = 2048, tied: bool = True,
          quant: bool = False, name: str = "tiny fuzz", arch: str = "llama", per_layer_arrays: bool = False,
          kv_key: bool = True) -> tuple[GgufFile, Truth]:
    """A llama-architecture GGUF with the tensors llama.cpp's loader asks for (src/models/llama.cpp), zeros for
    data (the reader never looks at it), and the truth about it."""
    head = n_embd // n_head
    layer_array = (lambda v: (f"{arch}.", ARR, [v] * n_layer, I32)) if per_layer_arrays else (
        lambda v: (f"{arch}.", U32, v, None))
    meta: list[tuple[str, int, Any, int | None]] = [("general.architecture", STR, arch, None),
                                                    ("general.name", STR, name, None)]

    def per(key: str, value: int) -> None:
        prefix, vtype, v, sub = layer_array(value)
        meta.append((prefix + key, vtype, v, sub))

    meta += [(f"{arch}.context_length", U32, ctx, None), (f"{arch}.embedding_length", U32, n_embd, None),
             (f"{arch}.block_count", U32, n_layer, None)]
    per("feed_forward_length", n_ff)
    per("attention.head_count", n_head)
    if kv_key:
        per("attention.head_count_kv", n_head_kv)
    meta += [(f"{arch}.rope.dimension_count", U32, head, None),
             (f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-5, None),
             ("tokenizer.ggml.model", STR, "gpt2", None),
             ("tokenizer.ggml.tokens", ARR, [f"t{i}" for i in range(vocab)], STR),
             ("tokenizer.ggml.token_type", ARR, [1] * vocab, I32)]
    mat = Q8_0_T if quant else F16_T
    kv = n_head_kv if kv_key else n_head
    tensors = [Tensor("token_embd.weight", (n_embd, vocab), F16_T), Tensor("output_norm.weight", (n_embd,), F32_T)]
    if not tied:
        tensors.append(Tensor("output.weight", (n_embd, vocab), mat))
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [Tensor(b + "attn_norm.weight", (n_embd,), F32_T), Tensor(b + "attn_q.weight", (n_embd, n_head * head), mat),
                    Tensor(b + "attn_k.weight", (n_embd, kv * head), mat), Tensor(b + "attn_v.weight", (n_embd, kv * head), mat),
                    Tensor(b + "attn_output.weight", (n_head * head, n_embd), mat), Tensor(b + "ffn_norm.weight", (n_embd,), F32_T),
                    Tensor(b + "ffn_gate.weight", (n_embd, n_ff), mat), Tensor(b + "ffn_up.weight", (n_embd, n_ff), mat),
                    Tensor(b + "ffn_down.weight", (n_ff, n_embd), mat)]
    g = GgufFile(meta, tensors)
    elements = sum(_prod(t.dims) for t in tensors)
    truth = Truth(arch, name, n_layer, n_embd, (n_head,) * n_layer, (kv,) * n_layer, head, ctx, vocab, elements,
                  sum(g.tensor_bytes(t) for t in tensors), tied)
    return g, truth


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


# ------------------------------------------------------------------------------------------------
# The variants


@dataclasses.dataclass
class Variant:
    category: str
    name: str
    data: bytes
    expect: str  # "refused", "correct" or "either" (a damaged file that may still read)
    truth: Truth | None = None  # "correct": what the reading must equal
    match: str | None = None  # "refused": what the one line must say


def _offsets(data: bytes) -> dict[str, int]:
    """Where the parts of a file written by GgufFile start: the key-value pairs, the tensor infos, the data."""
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    off = 24
    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", data, off)
        off += 8 + klen
        (vtype,) = struct.unpack_from("<I", data, off)
        off += 4
        off = _skip_value(data, off, vtype)
    tensors = off
    for _ in range(n_tensors):
        (nlen,) = struct.unpack_from("<Q", data, off)
        off += 8 + nlen
        (n_dims,) = struct.unpack_from("<I", data, off)
        off += 4 + 8 * n_dims + 4 + 8
    return {"kv": 24, "tensors": tensors, "data": off + (-off % 32)}


def _skip_value(data: bytes, off: int, vtype: int) -> int:
    if vtype == STR:
        return off + 8 + struct.unpack_from("<Q", data, off)[0]
    if vtype == ARR:
        sub, count = struct.unpack_from("<IQ", data, off)
        off += 12
        if sub == STR:
            for _ in range(count):
                off = _skip_value(data, off, STR)
            return off
        return off + count * struct.calcsize(_FMT[sub])
    return off + struct.calcsize(_FMT[vtype])


def generate(seed: int = SEED) -> list[Variant]:
    rng = random.Random(seed)
    out: list[Variant] = []

    def add(category: str, name: str, g: GgufFile | bytes, expect: str, truth: Truth | None = None,
            match: str | None = None) -> None:
        out.append(Variant(category, name, g if isinstance(g, bytes) else g.to_bytes(), expect, truth, match))

    # valid: llama.cpp reads these; the reading must equal what was written.
    for i in range(22):
        n_head = rng.choice((1, 2, 4, 8))
        n_embd = n_head * rng.choice((8, 16, 32)) * (2 if i % 3 == 0 else 1)
        n_embd = max(n_embd, 32)
        n_head_kv = rng.choice([k for k in (1, 2, 4, 8) if n_head % k == 0])
        quant = n_embd % 32 == 0 and rng.random() < 0.3
        kw = dict(n_layer=rng.randint(1, 6), n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                  n_ff=rng.choice((32, 64, 96)) if not quant else 64, vocab=rng.randint(8, 300), ctx=rng.choice((512, 2048, 8192)),
                  tied=rng.random() < 0.6, quant=quant, per_layer_arrays=rng.random() < 0.3, kv_key=rng.random() < 0.85)
        g, truth = model(**kw)
        if i == 0:  # a genuine large vocabulary and merges (~262K tokens, ~280K merges): skipped by size
            g.set("tokenizer.ggml.tokens", ARR, [f"<tok{j}>" for j in range(262_144)], STR)
            g.set("tokenizer.ggml.merges", ARR, [f"a{j} b{j}" for j in range(280_000)], STR)
            g.set("tokenizer.ggml.token_type", ARR, [1] * 262_144, I32)
            truth = dataclasses.replace(truth, n_vocab=262_144)
        if i == 1:  # a 4 MB numeric array and other keys the predictor does not read
            g.set("tokenizer.ggml.scores", ARR, [0.0] * 1_000_000, F32)
            g.set("general.license", STR, "x" * 100_000)
            g.set("some.vendor.array", ARR, list(range(600)), U16)
        add("valid", f"llama {kw}", g, "correct", truth)

    base, base_truth = model(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, vocab=40)
    data = base.to_bytes()
    offs = _offsets(data)

    # cut: every cut loses tensor data at least.
    cuts = sorted({0, 3, 4, 8, 16, 23, 24, 25} | {rng.randrange(24, offs["tensors"]) for _ in range(10)}
                  | {rng.randrange(offs["tensors"], offs["data"]) for _ in range(10)}
                  | {rng.randrange(offs["data"], len(data)) for _ in range(8)} | {len(data) - 1})
    for n in cuts:
        add("cut", f"first {n} of {len(data)} bytes", data[:n], "refused")

    # flipped: bytes in the header (may still read: must then obey every limit), or only in the data (the
    # header is the same: the reading must be the original's).
    for i in range(44):
        raw = bytearray(data)
        in_data = i % 4 == 3
        lo, hi = (offs["data"], len(data)) if in_data else (4, offs["data"])
        spots = [rng.randrange(lo, hi) for _ in range(rng.randint(1, 6))]
        for pos in spots:
            raw[pos] = rng.randrange(256)
        if in_data:
            add("flipped", f"data bytes {spots}", bytes(raw), "correct", base_truth)
        else:
            add("flipped", f"header bytes {spots}", bytes(raw), "either")

    # huge counts: counts that claim more than the file holds, or more than llama.cpp takes.
    huge = (10**9, 2**30 + 1, 2**32, 2**62, 2**63, 2**64 - 1)
    for n in huge:
        add("huge counts", f"metadata count {n}", data[:16] + struct.pack("<Q", n) + data[24:], "refused",
            match="metadata keys")
        add("huge counts", f"tensor count {n}", data[:8] + struct.pack("<Q", n) + data[16:], "refused", match="tensors")
    # The issue's 110-byte file: an array that claims 10^9 elements and ends 12 bytes later.
    tiny = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + gstr("general.architecture") + struct.pack("<I", STR) + gstr("llama")
    tiny += gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARR, U32, 10**9) + b"\0" * 12
    add("huge counts", "array of 10^9 u32 in a 126-byte file", tiny, "refused", match="needs 4,000,000,000 bytes")
    for n in (10**9, 2**31, 2**40, 2**64 - 1, 5_000_000):
        g, _ = model(vocab=40)
        g.set("tokenizer.ggml.tokens", ARR, _Raw(struct.pack("<IQ", STR, n) + gstr("a") * 40), STR)
        add("huge counts", f"string array claims {n}", g, "refused")
        g, _ = model(vocab=40)
        g.set("tokenizer.ggml.token_type", ARR, _Raw(struct.pack("<IQ", I32, n) + b"\1\0\0\0" * 40), I32)
        add("huge counts", f"i32 array claims {n}", g, "refused")
    for n in (2**21 + 1, 3_000_000):  # genuine string arrays past any vocabulary: refused by count, not walked
        g, _ = model(vocab=40)
        g.set("tokenizer.ggml.merges", ARR, _Raw(struct.pack("<IQ", STR, n) + struct.pack("<Q", 0) * n), STR)
        add("huge counts", f"{n:,} empty strings", g, "refused", match="string arrays")
    for dims in (5, 255, 2**32 - 1):
        g, _ = model(vocab=40)
        raw = bytearray(g.to_bytes())
        at = raw.index(gstr("output_norm.weight")) + len(gstr("output_norm.weight"))
        struct.pack_into("<I", raw, at, dims)
        add("huge counts", f"a tensor with {dims} dimensions", bytes(raw), "refused", match="dimension")

    # huge lengths: strings, keys, names and dimensions past the file or past llama.cpp's limits.
    for n in (2**16, 10**9, 2**40, 2**63, 2**64 - 1):
        raw = bytearray(data)
        struct.pack_into("<Q", raw, 24, n)  # the first key's length
        add("huge lengths", f"first key of {n:,} bytes", bytes(raw), "refused")
    for n in (10**7, 10**9, 2**40, 2**63, 2**64 - 1):  # each past the file's end or past llama.cpp's 1 GiB
        g, _ = model(vocab=40)
        g.set("general.name", STR, _Raw(struct.pack("<Q", n) + b"abc"))
        add("huge lengths", f"general.name of {n:,} bytes", g, "refused")
        g, _ = model(vocab=40)
        g.set("tokenizer.chat_template", STR, _Raw(struct.pack("<Q", n) + b"{{x}}"))
        add("huge lengths", f"chat_template of {n:,} bytes", g, "refused")
    for n in (64, 65, 1000, 10**9):
        g, _ = model(vocab=40)
        g.tensors[1].name = "n" * 63  # 63 bytes: llama.cpp's longest name (GGML_MAX_NAME 64)
        raw = bytearray(g.to_bytes())
        at = raw.index(gstr("n" * 63))
        struct.pack_into("<Q", raw, at, n)
        add("huge lengths", f"tensor name of {n:,} bytes", bytes(raw), "refused", match="name")
    for d in (2**40, 2**62, 2**63 + 5, 2**64 - 1):
        g, _ = model(vocab=40)
        g.tensors[1].dims = (d,)
        g.data_cap = 1 << 16
        add("huge lengths", f"a dimension of {d:,}", g, "refused")
    g, truth = model(vocab=40, name="n" * 60_000)  # a long but genuine name: read, and shown cut
    add("huge lengths", "a 60,000-character name", g, "correct", dataclasses.replace(truth, name="n" * 4096))
    g, truth = model(vocab=40)
    g.tensors[1].name = "n" * 63
    add("huge lengths", "a tensor name of 63 bytes", g, "correct", truth)

    # wrong types: keys llama.cpp reads as u32 stored otherwise, unknown value and tensor types.
    for key in ("block_count", "embedding_length", "context_length", "attention.head_count", "attention.head_count_kv",
                "feed_forward_length", "attention.key_length"):
        for vtype, value, sub in ((I32, 2, None), (U64, 2, None), (F32, 2.0, None), (STR, "2", None), (BOOL, 1, None),
                                  (ARR, [2.0, 2.0], F32)):
            if rng.random() < 0.45:
                continue
            g, _ = model(vocab=40)
            g.set(f"llama.{key}", vtype, value, sub)
            add("wrong types", f"llama.{key} as type {vtype}/{sub}", g, "refused")
    for vtype in (13, 255, 2**31, 2**32 - 1):
        g, _ = model(vocab=40)
        g.set("general.weird", vtype, _Raw(b"\0" * 8))
        add("wrong types", f"value type {vtype}", g, "refused", match="type")
    for sub in (ARR, 13, 2**32 - 1):
        g, _ = model(vocab=40)
        g.set("general.nested", ARR, _Raw(struct.pack("<IQ", sub, 1) + b"\0" * 16))
        add("wrong types", f"array of type {sub}", g, "refused")
    for t in (4, 5, 31, 36, 37, 38, 42, 99, 2**31 - 1, 2**32 - 1):
        g, _ = model(vocab=40)
        raw = bytearray(g.to_bytes())
        name = gstr("output_norm.weight")
        at = raw.index(name) + len(name) + 4 + 8  # one dimension
        struct.pack_into("<I", raw, at, t)
        add("wrong types", f"tensor type {t}", bytes(raw), "refused", match="ggml type")
    g, _ = model(vocab=40)
    g.tensors[2].ggml_type = Q8_0_T
    g.tensors[2].dims = (40, 8)  # rows of 40 values in blocks of 32
    add("wrong types", "Q8_0 rows of 40", g, "refused", match="blocks of 32")
    for vtype, value in ((U64, 32), (U32, 0), (U32, 48), (STR, "32")):
        g, _ = model(vocab=40)
        g.set("general.alignment", vtype, value)
        add("wrong types", f"general.alignment {value!r} as type {vtype}", g, "refused", match="alignment")
    g, _ = model(vocab=40)
    g.set("general.architecture", U32, 7)
    add("wrong types", "general.architecture a number", g, "refused", match="architecture")
    g, truth = model(vocab=40)
    g.set("llama.attention.layer_norm_rms_epsilon", STR, "small")  # a key the predictor does not read
    add("wrong types", "an unread key of another type", g, "correct", truth)
    raw = bytearray(data)
    struct.pack_into("<I", raw, 4, 1)
    add("wrong types", "GGUF version 1", bytes(raw), "refused", match="version 1")
    for v in (0, 4, 2**24, 0x03000000):
        raw = bytearray(data)
        struct.pack_into("<I", raw, 4, v)
        add("wrong types", f"GGUF version {v}", bytes(raw), "refused", match="version")

    # zero heads and sizes
    for key, value, match in (("attention.head_count", 0, "head_count is 0"), ("attention.head_count_kv", 0, "head_count_kv is 0"),
                              ("embedding_length", 0, "embedding_length is 0"), ("block_count", 0, "block_count is 0"),
                              ("attention.key_length", 0, "K/V head of 0"), ("attention.value_length", 0, "x 0 values")):
        g, _ = model(vocab=40)
        g.set(f"llama.{key}", U32, value)
        add("zero heads", f"{key} 0", g, "refused", match=match)
    for heads, kvs in (([0, 0], [0, 0]), ([4, 4], [0, 0]), ([0, 0], [2, 2]), ([4, 0], [2, 2])):
        g, _ = model(vocab=40)
        g.set("llama.attention.head_count", ARR, heads, I32)
        g.set("llama.attention.head_count_kv", ARR, kvs, I32)
        add("zero heads", f"per-layer heads {heads}, KV heads {kvs}", g, "refused")
    g, _ = model(vocab=40, n_embd=32, n_head=64, n_head_kv=64)  # 32 // 64: heads of 0 values
    add("zero heads", "64 heads of a 32-wide embedding", g, "refused", match="K/V head of 0")
    for missing in ("llama.block_count", "llama.embedding_length", "llama.context_length", "general.architecture"):
        g, _ = model(vocab=40)
        g.drop(missing)
        add("zero heads", f"no {missing}", g, "refused")
    g, _ = model(vocab=40)
    g.tensors = []
    add("zero heads", "no tensors", g, "refused", match="no tensors")

    # absurd heads and layers
    for kv, heads in ((64, 4), (2**31 - 1, 4), (2**32 - 1, 4), (3, 4), (8, 12), (5, 5 * 2**28)):
        g, _ = model(vocab=40)
        g.set("llama.attention.head_count", U32, heads)
        g.set("llama.attention.head_count_kv", U32, kv)
        add("absurd heads", f"{kv} KV heads for {heads} query heads", g, "refused")
    g, _ = model(vocab=40)
    g.set("llama.attention.head_count_kv", ARR, [2, 64], I32)
    add("absurd heads", "per-layer KV heads [2, 64]", g, "refused", match="do not divide")
    g, _ = model(vocab=40)
    g.set("llama.attention.head_count_kv", ARR, [2, 4], I32)  # divides, but blk.1.attn_k holds 2 heads
    add("absurd heads", "per-layer KV heads [2, 4] with 2-head tensors", g, "refused", match="wrong shape")
    for n in (LLAMA_MAX_LAYERS + 1, 100_000, 2**31 - 1, 2**32 - 1):
        g, _ = model(vocab=40)
        g.set("llama.block_count", U32, n)
        add("absurd heads", f"block_count {n:,}", g, "refused", match="block_count")
    for length in (1, 3, 600):
        g, _ = model(vocab=40)
        g.set("llama.attention.head_count", ARR, [4] * length, I32)
        add("absurd heads", f"head_count array of {length} for 2 layers", g, "refused", match="lists")
    for heads, kl in ((2**31 - 1, 128), (2**20, 2**20)):
        g, _ = model(vocab=40)
        g.set("llama.attention.head_count", U32, heads)
        g.set("llama.attention.head_count_kv", U32, heads)
        g.set("llama.attention.key_length", U32, kl)
        g.set("llama.attention.value_length", U32, kl)
        add("absurd heads", f"{heads:,} heads of {kl:,}", g, "refused")
    g, _ = model(vocab=40)
    g.set("llama.nextn_predict_layers", U32, 2)
    add("absurd heads", "nextn layers = block_count", g, "refused", match="nextn")
    g, _ = model(vocab=40)
    g.set("llama.attention.head_count", I32, -4)
    add("absurd heads", "head_count -4 as i32", g, "refused")
    g, _ = model(vocab=40)
    g.set("llama.attention.head_count", ARR, [4, -4], I32)
    add("absurd heads", "head_count [4, -4]", g, "refused")
    g, truth = model(vocab=40, n_layer=LLAMA_MAX_LAYERS, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    add("absurd heads", "512 layers (llama.cpp's most)", g, "correct", truth)

    # escape codes in names: read, and printed escaped
    for name in ("\x1b]0;pwned\x07\x1b[2J\x1b[Hfake line\r\nok", "a\rb", "\x9b31m red", "bidi \u202eevil\u202c",
                 "bell\x07\x07", "nul\x00name", "tab\tand\nnew", "\ud800 lone", "ok name"):
        g, truth = model(vocab=40, name=name)
        shown = name.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        add("escape codes", f"general.name {name!r}", g, "correct", dataclasses.replace(truth, name=shown))
    g, truth = model(vocab=40)
    g.set("tokenizer.ggml.tokens", ARR, ["\x1b[2J", "\x1b]0;t\x07"] + [f"t{i}" for i in range(38)], STR)
    add("escape codes", "escape codes in the vocabulary", g, "correct", truth)
    g, truth = model(vocab=40)
    g.set("general.\x1b[2Jkey", U32, 1)
    add("escape codes", "escape codes in a key", g, "correct", truth)
    g, _ = model(vocab=40)
    g.set("llama.block_count", STR, "\x1b[2J\x1b[31mevil")
    add("escape codes", "escape codes in a refused value", g, "refused", match="block_count")
    for key in ("general.{0}{x}", "tokenizer.{}", "{{", "x}{:>99999999}"):  # format fields in a key: text, never a template
        g, truth = model(vocab=40)
        g.set(key, U32, 1)
        add("escape codes", f"a key named {key!r}", g, "correct", truth)
        g, _ = model(vocab=40)
        g.set(key, STR, _Raw(struct.pack("<Q", 10**7) + b"x"))
        add("escape codes", f"a key named {key!r} cut short", g, "refused", match=re.escape(key))
    g, truth = model(vocab=40)
    g.tensors[1].name = "{0}{name!r}"
    add("escape codes", "a tensor named with format fields", g, "correct", truth)
    g, _ = model(vocab=40, arch="ll\x1b[2Jama")
    add("escape codes", "escape codes in the architecture", g, "either")
    g, _ = model(vocab=40)
    g.tensors[1].name = "\x1b]0;x\x07"
    g.tensors.append(Tensor("\x1b]0;x\x07", (8,), F32_T))
    add("escape codes", "a duplicated tensor named with escapes", g, "refused", match="twice")
    return out


# ------------------------------------------------------------------------------------------------
# Running a variant


def limits_problem(g, file_size: int) -> str | None:
    """A reading that breaks a limit llama.cpp sets (a damaged file that still read must keep every one)."""
    from kvscope.core.model.gguf import GGML_MAX_NAME

    if not 1 <= g.n_layer_all <= LLAMA_MAX_LAYERS or g.n_embd <= 0:
        return f"layers {g.n_layer_all}, embedding {g.n_embd}"
    if len({t.name for t in g.tensors}) != len(g.tensors) or not g.tensors:
        return "duplicate or no tensors"
    for t in g.tensors:
        name, block, size = next(v for v in GGML_TYPES.values() if v[0] == t.ggml_type)
        if len(t.name.encode("utf-8", "surrogateescape")) >= GGML_MAX_NAME or len(t.shape) > 4:
            return f"tensor {t.name!r}"
        if t.n_bytes != _prod(t.shape) // block * size or (t.shape and t.shape[0] % block):
            return f"tensor {t.name!r} of {t.n_bytes} bytes"
    if g.weight_bytes > file_size:
        return f"{g.weight_bytes:,} bytes of tensors in a file of {file_size:,}"
    if len(g.n_head) != g.n_layer_all or len(g.n_head_kv) != g.n_layer_all:
        return "per-layer arrays"
    if g.arch not in OWN_CACHE and not any(g.n_head_kv[:g.n_layer]):
        return "no K/V heads"
    for il in range(g.n_layer_all):
        h, kv = g.n_head[il], g.n_head_kv[il]
        if kv and (not h or h % kv):
            return f"layer {il}: {kv} KV heads for {h}"
        if kv and not g.is_mla and (g.head_k_of(il) <= 0 or g.head_v_of(il) <= 0):
            return f"layer {il}: head sizes"
    s = g.spec()
    if s.num_query_heads % s.num_kv_heads or s.head_dim < 1 or s.num_layers < 1:
        return f"spec {s.num_query_heads}/{s.num_kv_heads}/{s.head_dim}"
    return None


def truth_problem(g, truth: Truth) -> str | None:
    got = Truth(g.arch, g.name, g.n_layer, g.n_embd, g.n_head, g.n_head_kv, g.head_k, g.n_ctx_train, g.n_vocab,
                g.parameters, g.weight_bytes, not any(t.name == "output.weight" for t in g.tensors))
    if got != truth:
        diff = {f.name: (getattr(got, f.name), getattr(truth, f.name)) for f in dataclasses.fields(Truth)
                if getattr(got, f.name) != getattr(truth, f.name)}
        return f"read {diff} (got, written)"
    s = g.spec()
    if (s.num_layers, s.num_query_heads, s.num_kv_heads, s.head_dim, s.num_parameters) != (
            truth.n_layer, truth.n_head[0], truth.n_head_kv[0], truth.head_k, truth.parameters):
        return f"spec {s}"
    return None


def run_reader(path: Path, v: Variant, file_size: int) -> tuple[str, str, Any]:
    """(outcome, detail, the reading or the refusal's message)."""
    from kvscope.core.model.attention import SettingsError
    from kvscope.core.prediction.llamacpp import LlamaCppOptions, plan

    traced = file_size < TRACE_BELOW  # tracemalloc slows the walk of 542K strings ~8x; the lying files are small
    if traced:
        tracemalloc.start()
    try:
        with guard(GUARD_S):
            g = read_gguf(path)
            g.spec()
        error = None
    except (SpecError, Hang) as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - anything else escaping is the failure this fuzzer looks for
        return "traceback", f"{type(exc).__name__}: {exc}", None
    finally:
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
        if traced:
            tracemalloc.stop()
            PEAKS.append(peak)
    if isinstance(error, Hang):
        return "hang", str(error), None
    if peak > MAX_READ_ALLOCATION:  # a claim of 10^9 elements allocates nothing: the memory map is not counted
        return "silently wrong", f"the reader allocated {peak:,} B", None
    if error is not None:
        message = str(error)
        if "\n" in message or not message:
            return "silently wrong", f"a message of {message.count(chr(10)) + 1} lines", message
        if v.expect == "correct":
            return "silently wrong", f"a correct file refused: {message}", message
        if v.match and not re.search(v.match, message):
            return "silently wrong", f"refused, but not for {v.match!r}: {message}", message
        return "refused", message, message
    if v.expect == "refused":
        return "silently wrong", "read what llama.cpp refuses", g
    problem = limits_problem(g, file_size)
    if problem is None and v.truth is not None:
        problem = truth_problem(g, v.truth)
    if problem is not None:
        return "silently wrong", problem, g
    try:
        with guard(GUARD_S):
            plan(g, LlamaCppOptions(n_ctx=1024))
    except SettingsError:
        pass  # a cache llama.cpp keeps its own way (recurrent, chunked): said as such, in one line
    except Exception as exc:  # noqa: BLE001
        return "traceback", f"llama.cpp's plan: {type(exc).__name__}: {exc}", g
    return "correct", "", g


def run_calc(path: Path, capsys, reading: Any) -> tuple[str, str]:
    """``calc`` on the file: the same refusal as the reader, or (as a table, as JSON and with llama.cpp's rules)
    exit 0 with the reading."""
    refused = isinstance(reading, str)
    for extra in ((),) if refused else ((), ("--json",), ("--runtime", "llama.cpp")):
        capsys.readouterr()
        try:
            with guard(GUARD_S):
                status = kvscope_main.main(["calc", "--model", str(path), "--context", "1000", *extra])
        except Hang as exc:
            return "hang", str(exc)
        except BaseException as exc:  # noqa: BLE001
            return "traceback", f"calc {extra}: {type(exc).__name__}: {exc}"
        out, err = capsys.readouterr()
        for text in (out, err):
            if not is_safe(text.replace("\n", "")):
                return "silently wrong", f"calc {extra} printed a control character raw: {text[:200]!r}"
        lines = [x for x in err.splitlines() if x.strip()]
        if status == 1 or "internal error" in err or "Traceback" in err:
            return "traceback", f"calc {extra}: exit {status}: {err[-300:]}"
        if isinstance(reading, str):  # refused by the reader: calc says the same line
            if status != 2 or out or lines != [f"kvscope: {safe_text(reading)}"]:
                return "silently wrong", f"calc {extra}: exit {status}, stderr {lines!r}, not the reader's refusal"
            continue
        if "--runtime" in extra and status == 2 and len(lines) == 1:
            continue  # llama.cpp's own cache kinds KV Scope does not follow yet (one line, exit 2)
        if status != 0 or lines:
            return "silently wrong", f"calc {extra} of a readable file: exit {status}, stderr {lines!r}"
        if extra == ("--json",):
            row = json.loads(out)["rows"][0]
            if not isinstance(row["kv_cache_bytes"], int) or row["kv_cache_bytes"] < 0:
                return "silently wrong", f"calc --json: KV {row['kv_cache_bytes']!r}"
        elif not extra and safe_text(reading.name or reading.path.name, limit=None)[:30] not in out:
            return "silently wrong", "calc's table does not name the model"
    return ("refused" if isinstance(reading, str) else "correct"), ""


# ------------------------------------------------------------------------------------------------
# The tests


def test_the_generator_is_seeded_and_covers_every_category():
    a, b = generate(SEED), generate(SEED)
    assert [(v.name, v.data) for v in a] == [(v.name, v.data) for v in b]
    assert len(a) >= 200
    assert {v.category for v in a} == set(CATEGORIES)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="POSIX (SIGALRM)")
def test_every_gguf_ends_refused_or_correct(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVSCOPE_DEBUG", raising=False)
    variants = generate(SEED)
    table = {c: Counter() for c in CATEGORIES}
    failures = []
    spent = Counter()
    started = time.monotonic()
    for n, v in enumerate(variants):
        path = tmp_path / f"v{n:03d}.gguf"
        path.write_bytes(v.data)
        t0 = time.monotonic()
        outcome, detail, reading = run_reader(path, v, len(v.data))
        t1 = time.monotonic()
        if outcome in ("refused", "correct"):
            calc_outcome, calc_detail = run_calc(path, capsys, reading if outcome == "correct" else detail)
            if calc_outcome != outcome:
                outcome, detail = calc_outcome, calc_detail
        spent.update(reader=t1 - t0, calc=time.monotonic() - t1)
        table[v.category][outcome] += 1
        if os.environ.get("KVSCOPE_FUZZ_VERBOSE"):
            with capsys.disabled():
                print(f"#{n} {v.category} / {v.name[:80]}: {outcome} {detail[:160]}")
        if outcome in FAILURES:
            failures.append(f"{v.category} / {v.name[:100]} (#{n}): {outcome}: {detail[:300]}")
        path.unlink()
    elapsed = time.monotonic() - started
    with capsys.disabled():
        print()
        print(render_table(table, SEED, len(variants), elapsed))
        print(f"time per path: reader {spent['reader']:.1f} s, calc {spent['calc']:.1f} s; the most one reading "
              f"allocated: {max(PEAKS) / 2**20:.1f} MiB (tracemalloc, {len(PEAKS)} files under 4 MiB)")
        for line in failures:
            print("  FAIL " + line)
    assert not failures, "\n".join(failures)


def render_table(table: dict[str, Counter], seed: int, n: int, elapsed: float) -> str:
    head = f"{'category':<14}{'tried':>6}{'refused':>9}{'correct':>9}{'traceback':>11}{'hang':>6}{'silently wrong':>16}"
    return category_table(f"GGUF fuzzer, seed {seed}: {n} files in {elapsed:.1f} s (header reader, calc "
                          "table/--json/--runtime llama.cpp)", head, table, _row)


def _row(name: str, c: Counter) -> str:
    return (f"{name:<14}{sum(c.values()):>6}{c['refused']:>9}{c['correct']:>9}{c['traceback']:>11}{c['hang']:>6}"
            f"{c['silently wrong']:>16}")


# ------------------------------------------------------------------------------------------------
# Real processes: the issue's own files through `python main.py calc`


def issue_files(root: Path) -> list[tuple[str, Path, int, str]]:
    """(what, file, exit status, what stdout or stderr must say) for the files issue 29 reproduced."""
    made = []

    def write(name: str, g: GgufFile | bytes) -> Path:
        p = root / f"{name}.gguf"
        p.write_bytes(g if isinstance(g, bytes) else g.to_bytes())
        return p

    tiny = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + gstr("general.architecture") + struct.pack("<I", STR) + gstr("llama")
    tiny += gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARR, U32, 10**9) + b"\0" * 12
    made.append(("an array of 10^9 elements in a 126-byte file", write("claims", tiny), 2, "needs 4,000,000,000 bytes"))
    g, _ = model(vocab=40)
    g.set("tokenizer.ggml.token_type", ARR, [1] * 1_000_000, I32)
    g.set("tokenizer.ggml.merges", ARR, ["ab cd"] * 300_000, STR)
    made.append(("4 MB arrays", write("arrays", g), 0, "tiny fuzz: "))
    for what, key, vtype, value, sub, says in (
            ("block_count 100,000", "llama.block_count", U32, 100_000, None, "at most 512 layers"),
            ("per-layer KV heads [2, 64]", "llama.attention.head_count_kv", ARR, [2, 64], I32, "do not divide"),
            ("0 query heads", "llama.attention.head_count", U32, 0, None, "head_count is 0"),
            ("0 KV heads", "llama.attention.head_count_kv", U32, 0, None, "head_count_kv is 0"),
            ("0 embedding length", "llama.embedding_length", U32, 0, None, "embedding_length is 0"),
            ("64 KV heads for 4 query heads", "llama.attention.head_count_kv", U32, 64, None, "64 KV heads do not divide 4"),
            ("2^31-1 KV heads", "llama.attention.head_count_kv", U32, 2**31 - 1, None, "2,147,483,647 KV heads")):
        g, _ = model(vocab=40)
        g.set(key, vtype, value, sub)
        made.append((what, write(what.replace(" ", "_").replace("/", "_"), g), 2, says))
    g, _ = model(vocab=40, name="\x1b]0;pwned\x07\x1b[2J\x1b[Hfake line\r\nok")
    made.append(("escape codes in the name", write("escapes", g), 0, r"\x1b]0;pwned\x07\x1b[2J\x1b[Hfake line\r\nok"))
    return made


def _limited_memory() -> None:
    """In the child: 1 GiB of address space (calc on a GGUF needs ~30 MiB; the old reader passed 2.6 GB in 20 s)."""
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def test_the_issues_files_through_real_calc_and_run_processes(tmp_path):
    """``calc`` (both runtimes) and ``run`` on the files issue 29 reproduced: the same one line, exit 2, in seconds
    and within 1 GiB of memory; the readable ones print with their escape codes escaped."""
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_DEBUG"}
    for what, path, status, says in issue_files(tmp_path):
        commands = [["calc", "--model", str(path), "--context", "1000", "--runtime", runtime]
                    for runtime in ("transformers", "llama.cpp")]
        if status == 2:  # run refuses the header before llama.cpp (or torch) is even imported
            commands.append(["run", "--model", str(path), "--tokens", "2"])
        said = set()
        for command in commands:
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, str(REPO / "main.py"), *command], cwd=REPO, env=env,
                                  capture_output=True, timeout=60, preexec_fn=_limited_memory)
            elapsed = time.monotonic() - t0
            out, err = proc.stdout.decode(), proc.stderr.decode()
            assert b"\x1b" not in proc.stdout + proc.stderr and b"\r" not in proc.stdout + proc.stderr, what
            assert elapsed < 30, (what, elapsed)  # a hang guard; the reading itself takes milliseconds
            if status == 0 and "llama.cpp" in command and proc.returncode == 2:
                # A readable header llama.cpp's own loader refuses (no vocabulary: issue 38's dry run says so, with no
                # figure): one line, its reason, escaped.
                lines = [x for x in err.splitlines() if x.strip()]
                assert len(lines) == 1 and "llama.cpp refuses this file at load" in lines[0] and out == "", (what, err)
                continue
            assert proc.returncode == status, (what, command, proc.returncode, err)
            if status == 2:
                lines = [x for x in err.splitlines() if x.strip()]
                assert len(lines) == 1 and lines[0].startswith("kvscope: ") and says in lines[0], (what, lines)
                assert out == ""
                said.add(lines[0])
            else:
                assert says in out and err == "", (what, out[:300], err)
        assert len(said) <= 1, said  # calc and run: the same line


def test_the_calculator_says_the_same_line_and_shows_names_as_text(qtbot, tmp_path):
    """The calculator (where picking a GGUF in the Source list leads) shows the reader's refusal, escaped; a name
    full of HTML and escape codes is shown as text, never rendered."""
    from PySide6.QtCore import Qt

    from kvscope.ui.calculator import CalculatorTab

    tab = CalculatorTab()
    qtbot.addWidget(tab)
    try:
        for what, path, status, _says in issue_files(tmp_path):
            if status != 2:
                continue
            with pytest.raises(SpecError) as refused:
                read_gguf(path)
            tab.load_model(str(path))
            qtbot.waitUntil(lambda: tab.error_label.text() == safe_text(str(refused.value)), timeout=30_000)
        name = "<img src='file:///etc/passwd'>\x1b[2J<b>bold</b>"
        g, _ = model(vocab=40, name=name, ctx=512)
        path = tmp_path / "html.gguf"
        path.write_bytes(g.to_bytes())
        with qtbot.waitSignal(tab.spec_loaded, timeout=60_000):
            tab.load_model(str(path))
        assert tab.model_status.textFormat() == Qt.TextFormat.PlainText
        assert tab.error_label.textFormat() == Qt.TextFormat.PlainText
        assert tab.model_status.text().startswith(safe_text(name) + ":")
        tab.set_context(4096)  # past the trained 512: the headline (rich text) names the model
        headline = tab.headline.text()
        assert "&lt;img src=" in headline and "<img" not in headline and "<b>bold" not in headline, headline
    finally:
        tab.shutdown()


def test_safe_text_escapes_what_a_terminal_or_a_bidi_renderer_would_obey():
    """Every C0 and C1 control, DEL, the line separators, the bidi marks, embeddings, overrides and isolates, and
    lone surrogates come out as distinct printable escapes; any other text (random letters of any script, symbols,
    emoji) comes out unchanged; safe_lines keeps line feeds and tabs only."""
    from kvscope.core.base.safe_text import safe_lines

    unsafe = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0), 0x61C, 0x200E, 0x200F, 0x2028, 0x2029,
                               *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0xD800, 0xDBFF, 0xDC80, 0xDFFF)]
    shown = [safe_text(ch) for ch in unsafe]
    assert all(s.isprintable() and s.isascii() and s.startswith("\\") for s in shown)
    assert len(set(shown)) == len(unsafe)
    rng = random.Random(SEED)
    letters = [ch for ch in map(chr, range(0x20, 0x30000, 7)) if ch.isprintable() and ch not in unsafe]
    for _ in range(500):
        text = "".join(rng.choice(letters) for _ in range(rng.randint(0, 40)))
        assert safe_text(text) == text == safe_lines(text)
    assert safe_lines("a\n\tb\r\x1b[2J") == "a\n\tb\\r\\x1b[2J"
    assert safe_text("x" * 300, limit=200) == "x" * 199 + "…"
    printed = safe_text("\x1b]0;pwned\x07\x1b[2J\x1b[Hfake line\r\nok \u202eevil")
    assert is_safe(printed) and printed == "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[Hfake line\\r\\nok \\u202eevil"


def test_the_events_table_and_the_model_badge_show_hostile_names_as_text(qtbot):
    """A recording's event text and a model's name (from a GGUF, a config or a recording) reach the window's
    events table and badge row escaped, as plain text: no control character, and HTML shown, never rendered."""
    from PySide6.QtCore import Qt

    from kvscope.core.model.request import ModelInfo
    from kvscope.core.model.sources import load_spec
    from kvscope.ui.badges import BadgeRow
    from kvscope.ui.diagnose import EventsTable
    from kvscope.ui.theme import theme
    from tests.synthetic import synthetic_samples as samples

    table = EventsTable(theme("dark"))
    qtbot.addWidget(table)
    hostile = "switch\x1b]0;pwned\x07\x1b[2J\r\nfake line \u202eevil"
    event = next(s for s in samples(30, switches={20: "mqa"}) if s.is_event).replace(text=hostile)
    table.add_event(event)
    cells = [table.item(0, c).text() for c in range(table.columnCount())]
    assert all(is_safe(text) for text in cells) and any("\\x1b]0;pwned\\x07" in text for text in cells), cells
    row = BadgeRow()
    qtbot.addWidget(row)
    name = "<img src='file:///etc/passwd'>\x1b[2J<b>big</b>"
    spec = load_spec("embedded")
    row.show_model(ModelInfo(name, "/models/x.gguf", "cpu", "CPU", "f16", spec, None, (), (), ()))
    badge = row.badges["model"]
    assert badge.textFormat() == Qt.TextFormat.PlainText and badge.text() == safe_text(name)
    assert "&lt;img src=" in badge.toolTip() and "<img" not in badge.toolTip()

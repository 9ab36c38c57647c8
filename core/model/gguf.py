"""GGUF files as a model source: the header read by KV Scope's own bounded reader, with llama.cpp's refusals.

``read_gguf(path)`` gives a ``GgufModel``: the architecture and the hyperparameters llama.cpp reads from
the file (``src/llama-model.cpp`` ``load_hparams``, in the llama.cpp that llama-cpp-python 0.3.36 vendors:
commit 0c1e570), per layer where the file says so (head counts may be arrays), the sliding-window
pattern (from the file, or llama.cpp's own default for the architecture), the MLA ranks of ``deepseek2``,
and every tensor with its ggml type and exact bytes. ``GgufModel.spec()`` is the ``ModelSpec`` the rest of
KV Scope reads (``calc``'s transformers runtime, the window), with the parameter count taken from the
tensors themselves.

A GGUF is untrusted input. The header is walked in a memory map with every count and length checked against
the bytes left in the file before anything is allocated or looped over; arrays the predictor does not need
(the vocabulary, merges, scores: often 100K+ elements) are skipped by size, never parsed element by element, so
a header of any size reads in a fraction of a second and a few MB. What llama.cpp refuses is refused here with
one line (a ``SpecError``), before anything is predicted or loaded: ggml/src/gguf.cpp's rules (version, key and
value types, array and string limits, tensor names, dimensions, types, offsets, alignment), the layers past
LLAMA_MAX_LAYERS (512), per-layer arrays of the wrong length, a zero embedding, no attention heads or no K/V
heads in an attention model, K/V heads that do not divide the query heads, K/V tensors that disagree with the
heads, and tensor data past the end of the file. ``calc``, ``run``, the calculator and the Source list all read
a GGUF through ``read_gguf``, so all of them say the same line.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.core.model.spec import FULL_ATTENTION, MAX_COUNT, NO_KV, SLIDING_ATTENTION, ModelSpec, SpecError, path_kind

GGUF_MAGIC = b"GGUF"

#: llama.cpp's own sliding-window layer pattern per architecture, where the file does not carry
#: ``{arch}.attention.sliding_window_pattern``: (every n-th layer is full, dense_first). From
#: ``load_swa_pattern(ml, n[, dense_first])`` in src/models/<arch>.cpp: the layer il is a window layer
#: when ``il % n < n - 1`` (dense_first: when ``il % n != 0``).
SWA_PATTERNS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False), "gemma3": (6, False), "gemma3n": (5, False), "cohere2": (4, False),
    "gpt-oss": (2, False), "exaone4": (4, False), "olmo2": (4, False), "afmoe": (4, False),
    "llama4": (4, False), "plamo3": (8, False), "mellum": (4, False), "muse-glimmer": (4, False),
    "smallthinker": (4, True), "cohere2moe": (4, True), "laguna": (4, True),
}
#: Architectures whose window is chunked attention (llama4), not a sliding window.
CHUNKED = {"llama4"}
#: Architectures whose cache is not llama.cpp's plain (or interleaved-window) KV cache: recurrent and
#: hybrid models, indexer caches, compressed caches. KV Scope reads their header but does not predict
#: llama.cpp's allocation for them (``kvscope.core.prediction.llamacpp`` refuses with this reason).
OWN_CACHE = {
    "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1", "granitehybrid",
    "nemotron_h", "nemotron_h_moe", "lfm2", "lfm2moe", "plamo2", "qwen3next", "qwen35", "qwen35moe", "kimi-linear",
    "glm-dsa", "deepseek32", "deepseek4", "minimax-m3", "hy-v4", "dots3note", "glm5-next", "gemma4-assistant",
    "t5", "t5encoder", "bert", "nomic-bert", "jina-bert-v2", "modern-bert",
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    ggml_type: str  # "F16", "Q8_0"...
    shape: tuple[int, ...]  # ggml order (ne0 first)
    n_bytes: int
    layer: int | None = None  # the block it belongs to (``blk.N.``); None: the token embedding, output and norms

    @property
    def elements(self) -> int:
        return math.prod(self.shape) if self.shape else 0


@dataclass(frozen=True)
class GgufModel:
    """What llama.cpp reads from a GGUF's header, per layer where it varies."""

    path: Path
    arch: str
    name: str
    n_layer_all: int
    n_layer_nextn: int
    n_embd: int
    n_ctx_train: int
    n_vocab: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_k: int  # n_embd_head_k of full-attention layers
    head_v: int
    head_k_swa: int
    head_v_swa: int
    n_rot: int
    n_ff: tuple[int, ...]
    n_swa: int  # 0: no sliding window
    is_swa: tuple[bool, ...]
    swa_chunked: bool
    kv_lora_rank: int  # 0 unless MLA
    q_lora_rank: int
    head_k_mla: int  # key_length_mla (0: not MLA)
    head_v_mla: int
    n_layer_kv_from_start: int  # -1: every layer has its own K/V
    tensors: tuple[GgufTensor, ...]
    file_type: str = ""

    @property
    def n_layer(self) -> int:
        """The trunk's layers (the NextN/MTP layers at the end are not attended by the main graph)."""
        return self.n_layer_all - self.n_layer_nextn

    @property
    def is_mla(self) -> bool:
        return self.head_k_mla > 0 and self.head_v_mla > 0

    def has_kv(self, il: int) -> bool:
        """``llama_hparams::has_kv``: layers past n_layer_kv_from_start reuse an earlier layer's K/V."""
        if self.n_layer_kv_from_start >= 0:
            return il < self.n_layer_kv_from_start
        return True

    def head_k_of(self, il: int) -> int:
        return self.head_k_swa if self.is_swa[il] else self.head_k

    def head_v_of(self, il: int) -> int:
        return self.head_v_swa if self.is_swa[il] else self.head_v

    def k_width(self, il: int) -> int:
        """``n_embd_k_gqa(il)``: elements of one cached key row of layer ``il``."""
        return self.head_k_of(il) * self.n_head_kv[il]

    def v_width(self, il: int) -> int:
        return self.head_v_of(il) * self.n_head_kv[il]

    @property
    def weight_bytes(self) -> int:
        """The exact bytes of every tensor in the file, as stored (per quant type)."""
        return sum(t.n_bytes for t in self.tensors)

    @property
    def parameters(self) -> int:
        return sum(t.elements for t in self.tensors)

    def bytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.ggml_type] = out.get(t.ggml_type, 0) + t.n_bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @functools.cached_property
    def bytes_by_layer(self) -> dict[int | None, int]:
        """Tensor bytes per block (None: the tensors outside the blocks), summed once: the calculator asks at
        every context it draws."""
        out: dict[int | None, int] = {}
        for t in self.tensors:
            out[t.layer] = out.get(t.layer, 0) + t.n_bytes
        return out

    def spec(self) -> ModelSpec:
        """The ModelSpec of this file, for every part of KV Scope that reads one (calc's transformers runtime,
        the calculator, the window). Heads and widths are the first attention layer's; per-layer variety is
        kept here and used by ``kvscope.core.prediction.llamacpp``."""
        kv_layers = [il for il in range(self.n_layer) if self.n_head_kv[il] > 0]
        first = kv_layers[0] if kv_layers else 0
        if self.arch in OWN_CACHE:
            types = tuple(NO_KV if self.n_head_kv[il] == 0 else FULL_ATTENTION for il in range(self.n_layer))
        else:
            types = tuple(NO_KV if self.n_head_kv[il] == 0 or not self.has_kv(il) else
                          SLIDING_ATTENTION if self.is_swa[il] else FULL_ATTENTION for il in range(self.n_layer))
        mla: dict[str, Any] = {}
        if self.is_mla:
            mla = dict(kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank or None,
                       qk_rope_head_dim=self.n_rot, qk_nope_head_dim=self.head_k_mla - self.n_rot,
                       v_head_dim=self.head_v_mla)
        tied = not any(t.name == "output.weight" for t in self.tensors)
        heads = self.n_head[first] or 1
        head_dim = self.head_k_mla if self.is_mla else self.head_k_of(first)
        return ModelSpec(
            name=self.path.stem, model_type=self.arch, num_layers=self.n_layer, num_query_heads=heads,
            num_kv_heads=(heads if self.is_mla else self.n_head_kv[first]) or 1, head_dim=head_dim or 1,
            hidden_size=self.n_embd, vocab_size=self.n_vocab, tie_word_embeddings=tied,
            max_position_embeddings=self.n_ctx_train or 4096, dtype="float16", num_parameters=self.parameters,
            layer_types=types, sliding_window=self.n_swa if SLIDING_ATTENTION in types else None,
            display_name=self.name or self.path.name,
            config={"model_type": self.arch, "intermediate_size": max(self.n_ff) if self.n_ff else None,
                    "gguf": str(self.path)},
            **mla,
        )


def is_gguf_source(source: str) -> bool:
    """A path ending in .gguf, or a regular file that starts with GGUF's magic bytes."""
    path = Path(str(source)).expanduser()
    if path.suffix.lower() == ".gguf":
        return True
    try:
        if path_kind(path) == "file":
            with path.open("rb") as f:
                return f.read(4) == GGUF_MAGIC
    except (OSError, SpecError):
        return False
    return False


# ------------------------------------------------------------------------------------------------------------
# The bounded reader: every count and length is checked against the bytes left in the file before anything is
# allocated or looped over; arrays the predictor does not need are skipped by size (strings: by their length
# prefixes), never parsed element by element.

#: llama.cpp's own limits (the llama.cpp that llama-cpp-python 0.3.36 vendors): ggml/src/gguf.cpp reads the
#: header (GGUF_MAX_ARRAY_ELEMENTS, GGUF_MAX_STRING_LENGTH, GGML_MAX_DIMS and GGML_MAX_NAME from ggml.h, the
#: alignment a power of two, offsets in order), src/llama-hparams.h caps the layers (LLAMA_MAX_LAYERS: the
#: per-layer arrays are std::array<uint32_t, 512>, and src/llama-model-loader.cpp ``get_key_or_arr`` throws
#: "n > N_MAX" past it).
LLAMA_MAX_LAYERS = 512
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64
GGUF_MAX_ARRAY_ELEMENTS = 1 << 30
GGUF_MAX_STRING_LENGTH = 1 << 30
GGUF_VERSION = 3
GGUF_DEFAULT_ALIGNMENT = 32
INT64_MAX = 2**63 - 1
#: The GGUF specification (docs/gguf.md): a key is ASCII, "at most 2^16-1 = 65535 bytes long".
MAX_KEY_BYTES = 65_535
#: KV Scope's bounds on the work a header may ask for, far past every real model (a few hundred keys, at most a
#: few thousand tensors: 512 layers of ~30 tensors; vocabulary and merges together under 700,000 strings), so
#: that a header of any size is read in a fraction of a second and a few MB of memory.
MAX_KEYS = 65_536
MAX_TENSORS = 65_536
MAX_ARRAY_STRINGS = 1 << 21

#: ggml's tensor types: id -> (name, values per block, bytes per block), as ggml's type_traits (ggml/src/ggml.c)
#: and gguf-py's GGML_QUANT_SIZES list them (tests/test_gguf.py checks this table against the gguf package).
#: An id not here (a removed type such as Q4_2, or past GGML_TYPE_COUNT) is refused, as gguf.cpp refuses it.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
#: ``general.file_type`` (llama_ftype) -> its name, as gguf-py's LlamaFileType (without MOSTLY_).
FILE_TYPES: dict[int, str] = {
    0: "ALL_F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
    20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE",
    39: "NVFP4", 40: "Q1_0",
}

# GGUF's value types (gguf.h enum gguf_type): id -> (name, struct format); STRING and ARRAY have no fixed size.
STRING, ARRAY = 8, 9
_VALUE_TYPES: dict[int, tuple[str, str]] = {
    0: ("u8", "B"), 1: ("i8", "b"), 2: ("u16", "H"), 3: ("i16", "h"), 4: ("u32", "I"), 5: ("i32", "i"),
    6: ("f32", "f"), 7: ("bool", "b"), 10: ("u64", "Q"), 11: ("i64", "q"), 12: ("f64", "d"),
}
_TYPE_NAMES = {**{t: name for t, (name, _) in _VALUE_TYPES.items()}, STRING: "str", ARRAY: "arr"}
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
#: Element types llama.cpp takes for a per-layer array (``get_arr`` into std::array<uint32_t>: bool, u32, i32).
_LAYER_ARRAY_TYPES = {4, 5, 7}
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
#: A tensor info after its name and dimension count: n u64 dimensions, the u32 ggml type, the u64 offset.
_TENSOR_TAILS = tuple(struct.Struct(f"<{n}QIQ") for n in range(GGML_MAX_DIMS + 1))


@dataclass(frozen=True, slots=True)
class _Field:
    """One metadata value: a scalar (its value; a string's only for ``general.*`` keys), or an array (its element
    type and count; the elements only when ``count <= LLAMA_MAX_LAYERS`` and they are numbers)."""

    type: int
    value: Any = None
    sub: int | None = None
    count: int = 1

    @property
    def type_name(self) -> str:
        if self.type == ARRAY:
            return f"array of {_TYPE_NAMES.get(self.sub, '?')}"
        return _TYPE_NAMES.get(self.type, "?")


def _name_of(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")  # one str per distinct byte string; shown escaped (safe_text)


class _Cursor:
    """A read position in the memory-mapped file that never reads past its end."""

    __slots__ = ("buf", "off", "end", "file")

    def __init__(self, buf, end: int, file: str) -> None:
        self.buf, self.off, self.end, self.file = buf, 0, end, file

    # ``what`` names the field in a refusal; "{}" in it is filled with ``arg`` only then (a header of 65,536
    # tensors does not format 300,000 strings that are never shown).

    def need(self, n: int, what: str, arg: object = "") -> None:
        left = self.end - self.off
        if n > left:
            raise SpecError(f"{self.file} is cut short or damaged: {what.format(arg)} needs {n:,} bytes at byte "
                            f"{self.off:,}, and the file has {left:,} left")

    def u32(self, what: str, arg: object = "") -> int:
        if self.end - self.off < 4:
            self.need(4, what, arg)
        value = _U32(self.buf, self.off)[0]
        self.off += 4
        return value

    def u64(self, what: str, arg: object = "") -> int:
        if self.end - self.off < 8:
            self.need(8, what, arg)
        value = _U64(self.buf, self.off)[0]
        self.off += 8
        return value

    def raw_string(self, what: str, limit: int, arg: object = "") -> bytes:
        n = self.u64(what, arg)
        if n > limit:
            raise SpecError(f"{self.file}: {what.format(arg)} claims {n:,} bytes (at most {limit:,}); the header is "
                            "damaged")
        self.need(n, what, arg)
        raw = self.buf[self.off:self.off + n]
        self.off += n
        return raw

    def skip_string(self, key: str, keep: int = 0) -> bytes:
        """Past one string value; its first ``keep`` bytes are returned (a name: never a copy of 1 GiB)."""
        n = self.u64("{}", key)
        if n > GGUF_MAX_STRING_LENGTH:
            raise SpecError(f"{self.file}: {key} claims {n:,} bytes, past llama.cpp's limit of "
                            f"{GGUF_MAX_STRING_LENGTH:,} (GGUF_MAX_STRING_LENGTH in ggml/src/gguf.cpp)")
        self.need(n, "{}", key)
        head = self.buf[self.off:self.off + min(n, keep)] if keep else b""
        self.off += n
        return head

    def skip_strings(self, count: int, key: str) -> None:
        """Walk ``count`` length-prefixed strings without decoding them (a vocabulary of 262,144 tokens: ~60 ms)."""
        self.need(8 * count, "{}", key)  # every string has its 8-byte length at least
        buf, off, end, u64 = self.buf, self.off, self.end, _U64
        try:
            for _ in range(count):
                off += 8 + u64(buf, off)[0]
        except struct.error:  # a length prefix past the end of the file
            off = end + 1
        if off > end:
            raise SpecError(f"{self.file} is cut short or damaged: the strings of {key} run past the end of the file")
        self.off = off


def _read_header(path: Path) -> tuple[dict[str, _Field], list[GgufTensor]]:
    """The metadata and the tensor infos of a GGUF file, read with every bound checked first (module comment)."""
    file = path.name
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                head = f.read(4)
                if head != GGUF_MAGIC:
                    raise SpecError(f"{file} is not a GGUF file (it starts with {head!r}, not b'GGUF')")
                raise SpecError(f"{file} is cut short: {size} bytes, fewer than a GGUF header's 24")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Cursor(buf, len(buf), file))  # the mapped length: the file may have changed since
    except SpecError:
        raise
    except struct.error:  # past the mapped end: every read is checked first, so only a file changed under the map
        raise SpecError(f"{file} changed while it was read, or is damaged; read it again") from None
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, OverflowError) as exc:  # mmap refusing a file that changed under it
        raise SpecError(f"cannot read {path}: {exc}") from None


def _walk(cur: _Cursor) -> tuple[dict[str, _Field], list[GgufTensor]]:
    file = cur.file
    magic = bytes(cur.buf[0:4])
    if magic != GGUF_MAGIC:
        raise SpecError(f"{file} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    cur.off = 4
    version = cur.u32("the version")
    if version == 1:
        raise SpecError(f"{file} is a GGUF version 1 file, which llama.cpp no longer reads; convert it again")
    if version == 0 or version & 0xFFFF == 0 or version > GGUF_VERSION:
        raise SpecError(f"{file}: GGUF version {version} is not one llama.cpp reads (2 or 3; a big-endian file, or "
                        "a damaged one)")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    # The least a key-value pair takes is 14 bytes (8-byte length, a 1-byte key, 4-byte type, a 1-byte value);
    # a tensor info 24 (8-byte name length, 4-byte dimension count, 4-byte type, 8-byte offset).
    left = cur.end - cur.off
    for count, least, most, what in ((n_kv, 14, MAX_KEYS, "metadata keys"), (n_tensors, 24, MAX_TENSORS, "tensors")):
        if count * least > left:
            raise SpecError(f"{file}: the header claims {count:,} {what}, more than the {left:,} bytes left can hold")
        if count > most:
            raise SpecError(f"{file}: the header claims {count:,} {what}, more than any model has (at most {most:,})")
    fields: dict[str, _Field] = {}
    strings = 0
    for i in range(n_kv):
        raw = cur.raw_string("metadata key {}", MAX_KEY_BYTES, i)
        if not raw:
            raise SpecError(f"{file}: metadata key {i} is empty (llama.cpp refuses the file)")
        key = _name_of(raw)
        if key in fields:
            raise SpecError(f"{file}: the metadata key {key} appears twice (llama.cpp refuses the file)")
        vtype = cur.u32("the type of {}", key)
        if vtype == ARRAY:
            sub = cur.u32("the element type of {}", key)
            count = cur.u64("the length of {}", key)
            if count > GGUF_MAX_ARRAY_ELEMENTS:
                raise SpecError(f"{file}: {key} claims {count:,} elements, past llama.cpp's limit of "
                                f"{GGUF_MAX_ARRAY_ELEMENTS:,} (GGUF_MAX_ARRAY_ELEMENTS in ggml/src/gguf.cpp)")
            if sub == STRING:
                strings += count
                if strings > MAX_ARRAY_STRINGS:
                    raise SpecError(f"{file}: the header's string arrays hold more than {MAX_ARRAY_STRINGS:,} strings "
                                    f"({key} alone claims {count:,}); no model's vocabulary is that large")
                cur.skip_strings(count, key)
                fields[key] = _Field(ARRAY, None, STRING, count)
                continue
            if sub not in _VALUE_TYPES:
                raise SpecError(f"{file}: {key} is an array of GGUF type {sub}, which llama.cpp does not read "
                                "(nested arrays and unknown types are refused)")
            fmt = _VALUE_TYPES[sub][1]
            nbytes = count * struct.calcsize(fmt)
            cur.need(nbytes, "{}", key)
            values = None
            if count <= LLAMA_MAX_LAYERS:  # a per-layer array, or small enough to keep; longer ones are skipped
                values = list(struct.unpack_from(f"<{count}{fmt}", cur.buf, cur.off))
            cur.off += nbytes
            fields[key] = _Field(ARRAY, values, sub, count)
        elif vtype == STRING:
            if key.startswith("general."):  # the architecture and the name (their first 4 KiB); others skipped
                fields[key] = _Field(STRING, cur.skip_string(key, keep=4096).decode("utf-8", "replace"))
            else:
                cur.skip_string(key)
                fields[key] = _Field(STRING)
        elif vtype in _VALUE_TYPES:
            fmt = _VALUE_TYPES[vtype][1]
            n = struct.calcsize(fmt)
            cur.need(n, "{}", key)
            fields[key] = _Field(vtype, struct.unpack_from("<" + fmt, cur.buf, cur.off)[0])
            cur.off += n
        else:
            raise SpecError(f"{file}: {key} has GGUF type {vtype}, which does not exist (llama.cpp refuses the file)")

    alignment = GGUF_DEFAULT_ALIGNMENT
    align = fields.get("general.alignment")
    if align is not None:
        if align.type != 4:
            raise SpecError(f"{file}: general.alignment is {align.type_name}, not u32 (llama.cpp refuses the file)")
        alignment = align.value
        if alignment == 0 or alignment & (alignment - 1):
            raise SpecError(f"{file}: general.alignment {alignment} is not a power of two (llama.cpp refuses the file)")

    tensors: list[GgufTensor] = []
    names: set[str] = set()
    expected = 0  # gguf.cpp: each tensor's offset is the previous ones' sizes, each padded to the alignment
    data_end = 0
    for i in range(n_tensors):
        name_len = cur.u64("the name of tensor {}", i)
        if name_len >= GGML_MAX_NAME:
            raise SpecError(f"{file}: tensor {i}'s name is {name_len:,} bytes long; llama.cpp's limit is "
                            f"{GGML_MAX_NAME - 1} (GGML_MAX_NAME)")
        cur.need(name_len + 4, "the name of tensor {}", i)
        name = _name_of(cur.buf[cur.off:cur.off + name_len])
        cur.off += name_len
        if name in names:
            raise SpecError(f"{file}: the tensor {name} appears twice (llama.cpp refuses the file)")
        names.add(name)
        n_dims = cur.u32("the dimensions of {}", name)
        if n_dims > GGML_MAX_DIMS:
            raise SpecError(f"{file}: tensor {name} has {n_dims:,} dimensions; ggml's limit is {GGML_MAX_DIMS}")
        tail = _TENSOR_TAILS[n_dims]  # the dimensions, the type and the offset
        cur.need(tail.size, "the shape of {}", name)
        *shape, type_id, offset = tail.unpack_from(cur.buf, cur.off)
        cur.off += tail.size
        elements = 1
        for d in shape:
            if d > INT64_MAX:
                raise SpecError(f"{file}: tensor {name} has a negative dimension (llama.cpp refuses the file)")
            elements *= d
        if elements > INT64_MAX:
            raise SpecError(f"{file}: tensor {name} of shape {tuple(shape)} has more elements than ggml can count (2^63)")
        ggml = GGML_TYPES.get(type_id)
        if ggml is None:
            raise SpecError(f"{file}: tensor {name} has ggml type {type_id}, which llama.cpp does not know "
                            "(a removed or invalid type: ggml/src/gguf.cpp refuses it)")
        type_name, block, type_size = ggml
        if (shape[0] if shape else 1) % block:
            raise SpecError(f"{file}: tensor {name} is {type_name}, whose blocks of {block} values do not divide its "
                            f"rows of {shape[0]:,} (llama.cpp refuses the file)")
        n_bytes = elements // block * type_size
        if offset != expected:
            raise SpecError(f"{file}: tensor {name} is at offset {offset:,} of the data, where llama.cpp expects "
                            f"{expected:,} (the header is damaged)")
        data_end = max(data_end, offset + n_bytes)
        expected = offset + (n_bytes + alignment - 1) // alignment * alignment
        block_name = name.split(".", 2)[1] if name.startswith("blk.") and name.count(".") >= 2 else ""
        tensors.append(GgufTensor(name, type_name, tuple(shape), n_bytes,
                                  int(block_name) if block_name.isdigit() and len(block_name) < 6 else None))
    data_start = (cur.off + alignment - 1) // alignment * alignment
    if tensors and data_start + data_end > cur.end:
        raise SpecError(f"{file} is cut short: its tensors end at byte {data_start + data_end:,}, and the file has "
                        f"{cur.end:,} bytes (an incomplete download? llama.cpp refuses it)")
    return fields, tensors


# ------------------------------------------------------------------------------------------------------------
# The hyperparameters, as llama.cpp's load_hparams reads them (src/llama-model.cpp), with its refusals.


class _Meta:
    """The header's fields for one architecture, read with llama.cpp's types and KV Scope's bounds."""

    def __init__(self, fields: dict[str, _Field], arch: str, file: str) -> None:
        self.fields, self.arch, self.file = fields, arch, file

    def field(self, key: str) -> _Field | None:
        return self.fields.get(f"{self.arch}.{key}")

    def _wrong_type(self, key: str, f: _Field, wanted: str) -> SpecError:
        return SpecError(f"{self.file}: {self.arch}.{key} is stored as {f.type_name}, not {wanted} (llama.cpp refuses "
                         "the file: src/llama-model-loader.cpp, wrong type)")

    def count(self, key: str, default: int | None = None, strict: bool = False, limit: int = MAX_COUNT) -> int:
        """A whole number at least 0 and at most ``limit``. ``strict``: stored as u32, as llama.cpp's
        ``get_key<uint32_t>`` requires of the keys it reads for every architecture; otherwise any integer type."""
        f = self.field(key)
        if f is None:
            if default is None:
                raise SpecError(f"{self.file}: the GGUF header has no {self.arch}.{key} (llama.cpp refuses the file: "
                                "key not found)")
            return default
        if f.type == ARRAY:
            raise SpecError(f"{self.file}: {self.arch}.{key} is an array, where llama.cpp reads one number")
        if strict and f.type != 4:
            raise self._wrong_type(key, f, "u32")
        if f.type not in _INT_TYPES:
            raise self._wrong_type(key, f, "an integer")
        return _count(f.value, f"{self.arch}.{key}", self.file, limit)

    def per_layer(self, key: str, n: int, default: int) -> tuple[int, ...]:
        """``get_key_or_arr``: one u32 for every layer, or an array of exactly ``n`` (bool, i32 or u32)."""
        f = self.field(key)
        if f is None:
            return (default,) * n
        if f.type != ARRAY:
            return (self.count(key, strict=True),) * n
        if f.sub not in _LAYER_ARRAY_TYPES:
            raise SpecError(f"{self.file}: {self.arch}.{key} is an {f.type_name}; llama.cpp reads a per-layer array "
                            "of i32, u32 or bool")
        if f.count != n:
            raise SpecError(f"{self.file}: {self.arch}.{key} lists {f.count:,} values for {n} layers (llama.cpp "
                            "refuses the file: wrong array length)")
        return tuple(_count(v, f"{self.arch}.{key}", self.file) for v in f.value)


def _count(value: Any, what: str, file: str, limit: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > limit:
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        raise SpecError(f"{file}: {what} is {shown} in the GGUF header, not a usable count"
                        + (f" (at most {limit:,})" if isinstance(value, int) and value > limit else ""))
    return value


@functools.lru_cache(maxsize=32)
def _read_cached(path: str, mtime_ns: int, size: int) -> GgufModel:
    return _read(Path(path))


def read_gguf(source: str | Path) -> GgufModel:
    """The header of a GGUF file (cached by path, modification time and size). Raises SpecError with one line for
    anything llama.cpp would refuse, or that no model has (module docstring)."""
    path = Path(str(source)).expanduser()
    kind = path_kind(path, str(source))
    if kind is None:
        raise SpecError(f"no such file: {source}")
    if kind != "file":
        raise SpecError(f"{source} is not a regular file")
    st = path.stat()
    return _read_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


def _read(path: Path) -> GgufModel:
    fields, tensors = _read_header(path)
    file = path.name
    arch_field = fields.get("general.architecture")
    if arch_field is None or arch_field.type != STRING or not arch_field.value:
        raise SpecError(f"{file}: the GGUF header names no general.architecture (llama.cpp refuses the file)")
    arch = arch_field.value
    if not tensors:
        raise SpecError(f"{file} holds no tensors (a vocabulary-only GGUF?); a model needs its weights")
    m = _Meta(fields, arch, file)

    n_layer_all = m.count("block_count", strict=True)
    if n_layer_all == 0:
        raise SpecError(f"{file}: block_count is 0; a model needs layers")
    if n_layer_all > LLAMA_MAX_LAYERS:
        raise SpecError(f"{file}: block_count is {n_layer_all:,}; llama.cpp loads at most {LLAMA_MAX_LAYERS} layers "
                        "(LLAMA_MAX_LAYERS in src/llama-hparams.h)")
    n_embd = m.count("embedding_length", strict=True)
    if n_embd == 0:
        raise SpecError(f"{file}: embedding_length is 0; a model needs a hidden size")
    n_ctx_train = m.count("context_length", strict=True)
    nextn = m.count("nextn_predict_layers", 0)
    if nextn >= n_layer_all:
        raise SpecError(f"{file}: nextn_predict_layers {nextn:,} leaves none of the {n_layer_all} layers to the model")
    n_head = m.per_layer("attention.head_count", n_layer_all, 0)
    n_head_kv = m.per_layer("attention.head_count_kv", n_layer_all, -1)
    n_head_kv = tuple(h if kv < 0 else kv for h, kv in zip(n_head, n_head_kv))
    h0 = n_head[0]
    # load_hparams: n_embd_head_k = n_embd / n_head(0) unless key_length says otherwise (0 heads: no attention).
    head_k = m.count("attention.key_length", n_embd // h0 if h0 else 0, strict=True)
    head_v = m.count("attention.value_length", n_embd // h0 if h0 else 0, strict=True)
    n_rot = m.count("rope.dimension_count", head_k, strict=True)
    n_swa = m.count("attention.sliding_window", 0)
    is_swa = (False,) * n_layer_all
    if n_swa > 0:
        is_swa, n_swa = _swa_layers(m, arch, n_layer_all, n_layer_all - nextn, n_swa)
    n_ff = m.per_layer("feed_forward_length", n_layer_all, 0)
    vocab_field = m.field("vocab_size")
    if vocab_field is not None:
        n_vocab = m.count("vocab_size", strict=True)
    else:
        tokens = fields.get("tokenizer.ggml.tokens")
        n_vocab = tokens.count if tokens is not None and tokens.type == ARRAY else 0
        n_vocab = _count(n_vocab, "the vocabulary", file)
    file_type = fields.get("general.file_type")
    model = GgufModel(
        path=path, arch=arch, name=str((fields.get("general.name") or _Field(STRING, "")).value or ""),
        n_layer_all=n_layer_all, n_layer_nextn=nextn, n_embd=n_embd, n_ctx_train=n_ctx_train, n_vocab=n_vocab,
        n_head=n_head, n_head_kv=n_head_kv, head_k=head_k, head_v=head_v,
        head_k_swa=m.count("attention.key_length_swa", head_k), head_v_swa=m.count("attention.value_length_swa", head_v),
        n_rot=n_rot, n_ff=n_ff, n_swa=n_swa, is_swa=is_swa, swa_chunked=arch in CHUNKED,
        kv_lora_rank=m.count("attention.kv_lora_rank", 0), q_lora_rank=m.count("attention.q_lora_rank", 0),
        head_k_mla=m.count("attention.key_length_mla", 0), head_v_mla=m.count("attention.value_length_mla", 0),
        n_layer_kv_from_start=_kv_from_start(arch, n_layer_all, _plain_int(m.field("attention.shared_kv_layers"))),
        tensors=tuple(tensors),
        file_type=(FILE_TYPES.get(file_type.value, str(file_type.value))
                   if file_type is not None and file_type.type in _INT_TYPES else ""),
    )
    _check_attention(model)
    return model


def _plain_int(f: _Field | None) -> int | None:
    return f.value if f is not None and f.type in _INT_TYPES else None


def _swa_layers(m: _Meta, arch: str, n_layer_all: int, n_layer: int, n_swa: int) -> tuple[tuple[bool, ...], int]:
    """Which layers are sliding-window ones: the file's ``sliding_window_pattern`` (an array of one flag per layer,
    or every n-th layer full), else llama.cpp's own pattern for the architecture (SWA_PATTERNS)."""
    f = m.field("attention.sliding_window_pattern")
    if f is not None and f.type == ARRAY:
        if f.count != n_layer_all or f.value is None:
            raise SpecError(f"{m.file}: sliding_window_pattern lists {f.count:,} layers of {n_layer_all}")
        return tuple(bool(v) for v in f.value), n_swa
    n_pat, dense_first = SWA_PATTERNS.get(arch, (None, False))
    if f is not None:
        n_pat = m.count("attention.sliding_window_pattern", limit=LLAMA_MAX_LAYERS)
    if n_pat is None:
        return (False,) * n_layer_all, 0  # llama.cpp's own rule for this architecture is unknown here
    return tuple((il < n_layer) and (n_pat == 0 or (il % n_pat != 0 if dense_first else il % n_pat < n_pat - 1))
                 for il in range(n_layer_all)), n_swa


def _check_attention(g: GgufModel) -> None:
    """Refuse the attention layouts llama.cpp cannot run, before any of it is predicted (one line each):

    - no head at all, or no layer with K/V heads, in an attention architecture (one whose cache is plain K/V):
      "KV 0 B" for a model that has attention;
    - K/V heads that do not divide a layer's query heads (llama.cpp repeats each K/V head over a whole group:
      ggml_mul_mat's broadcast asserts ``ne[2] % ne[2] == 0`` and aborts the process otherwise);
    - a K/V head of 0 values, or a K/V row past any real width;
    - a layer whose ``attn_k``/``attn_v`` tensor disagrees with the heads the header states (llama.cpp refuses a
      tensor of the wrong shape: "tensor ... has wrong shape" in src/llama-model-loader.cpp)."""
    file = g.path.name
    layers = range(g.n_layer)
    attention = g.arch not in OWN_CACHE
    if attention and not any(g.n_head[il] for il in layers):
        raise SpecError(f"{file}: attention.head_count is 0 in every layer; a {g.arch} model needs attention heads")
    if attention and not any(g.n_head_kv[il] for il in layers):
        raise SpecError(f"{file}: attention.head_count_kv is 0 in every layer; a {g.arch} model caches K/V in its "
                        "attention layers")
    shapes = {t.name: t.shape for t in g.tensors if t.layer is not None}
    for il in range(g.n_layer_all):
        heads, kv = g.n_head[il], g.n_head_kv[il]
        if kv == 0:
            continue
        where = f"layer {il}: " if len(set(g.n_head_kv)) > 1 or len(set(g.n_head)) > 1 else ""
        if heads == 0 or heads % kv:
            raise SpecError(f"{file}: {where}{kv:,} KV heads do not divide {heads:,} query heads (llama.cpp shares each "
                            "KV head among a whole group of query heads, and aborts otherwise)")
        if g.is_mla:
            if not (g.kv_lora_rank and g.head_k_mla and g.head_v_mla):
                raise SpecError(f"{file}: an MLA header with a zero size (kv_lora_rank {g.kv_lora_rank}, key_length_mla "
                                f"{g.head_k_mla}, value_length_mla {g.head_v_mla})")
            continue
        hk, hv = g.head_k_of(il), g.head_v_of(il)
        if hk == 0 or hv == 0:
            raise SpecError(f"{file}: {where}a K/V head of {hk} x {hv} values (key_length, value_length; embedding_length "
                            f"{g.n_embd:,} over {g.n_head[0]:,} heads when not given): llama.cpp cannot cache it")
        if max(heads * hk, g.k_width(il), g.v_width(il)) > MAX_COUNT:
            raise SpecError(f"{file}: {where}{heads:,} heads of {hk:,} values are implausible (a row of more than "
                            f"{MAX_COUNT:,})")
        if not attention or not g.has_kv(il):
            continue
        for kind, width in (("k", g.k_width(il)), ("v", g.v_width(il))):
            shape = shapes.get(f"blk.{il}.attn_{kind}.weight")
            if shape is not None and len(shape) == 2 and shape[0] == g.n_embd and shape[1] != width:
                raise SpecError(f"{file}: tensor blk.{il}.attn_{kind}.weight makes {shape[1]:,} values per token, but "
                                f"the header's {kv:,} KV heads x {hk if kind == 'k' else hv:,} say {width:,} (llama.cpp "
                                "refuses a tensor of the wrong shape)")


def _kv_from_start(arch: str, n_layer_all: int, shared: Any) -> int:
    """gemma3n keeps its own K/V in the first 20 layers (hard-coded in src/models/gemma3n.cpp); gemma4 in all
    but its ``shared_kv_layers``; every other architecture in every layer (-1)."""
    if arch == "gemma3n":
        return 20
    if arch == "gemma4" and isinstance(shared, int) and not isinstance(shared, bool) and 0 < shared < n_layer_all:
        return n_layer_all - shared
    return -1


def load_gguf_spec(source: str) -> ModelSpec:
    return read_gguf(source).spec()

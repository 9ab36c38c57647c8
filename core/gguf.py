"""GGUF files as a model source: the header read with llama.cpp's own ``gguf`` package, never by hand.

``read_gguf(path)`` gives a ``GgufModel``: the architecture and the hyperparameters llama.cpp reads from
the file (``src/llama-model.cpp`` ``load_hparams``, in the llama.cpp that llama-cpp-python 0.3.36 vendors:
commit 0c1e570), per layer where the file says so (head counts may be arrays), the sliding-window
pattern (from the file, or llama.cpp's own default for the architecture), the MLA ranks of ``deepseek2``,
and every tensor with its ggml type and exact bytes. ``GgufModel.spec()`` is the ``ModelSpec`` the rest of
KV Scope reads (``calc``'s transformers runtime, the window), with the parameter count taken from the
tensors themselves.

A GGUF is untrusted input: anything the reader cannot parse, or numbers out of any model's range, is a
``SpecError`` with the reason, never a crash. The vocabulary (often 100K+ strings) is not decoded.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.spec import (FULL_ATTENTION, MAX_COUNT, NO_KV, SLIDING_ATTENTION, ModelSpec, SpecError, path_kind)

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
#: llama.cpp's allocation for them (``core.llamacpp`` refuses with this reason).
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
        kept here and used by ``core.llamacpp``."""
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


def _key(fields: dict, key: str, default: Any = None) -> Any:
    field = fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except Exception:  # noqa: BLE001 - a malformed field is a missing one
        return default
    return default if value is None else value


def _count(value: Any, what: str, path: Path, limit: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or value != int(value) or value > limit:
        raise SpecError(f"{path.name}: {what} is {value!r} in the GGUF header, not a usable count")
    return int(value)


def _per_layer(value: Any, n: int, what: str, path: Path, default: int) -> tuple[int, ...]:
    """``get_key_or_arr``: one number for every layer, or an array of exactly ``n``."""
    if value is None:
        return (default,) * n
    if isinstance(value, list):
        if len(value) != n:
            raise SpecError(f"{path.name}: {what} lists {len(value)} values for {n} layers")
        return tuple(_count(v, what, path) for v in value)
    return (_count(value, what, path),) * n


@functools.lru_cache(maxsize=32)
def _read_cached(path: str, mtime_ns: int, size: int) -> GgufModel:
    return _read(Path(path))


def read_gguf(source: str | Path) -> GgufModel:
    """The header of a GGUF file (cached by path, modification time and size). Raises SpecError."""
    path = Path(str(source)).expanduser()
    kind = path_kind(path, str(source))
    if kind is None:
        raise SpecError(f"no such file: {source}")
    if kind != "file":
        raise SpecError(f"{source} is not a regular file")
    st = path.stat()
    return _read_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


def _read(path: Path) -> GgufModel:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise SpecError(f"{path.name} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        from gguf import GGUFReader
        reader = GGUFReader(str(path), "r")
    except ImportError:  # pragma: no cover - gguf is a dependency
        raise SpecError("the gguf package is not installed: pip install gguf==0.19.0") from None
    except Exception as exc:  # noqa: BLE001 - any parse failure of an untrusted file
        raise SpecError(f"{path.name}: not a readable GGUF file ({type(exc).__name__}: {str(exc)[:200]})") from None
    fields = reader.fields
    arch = _key(fields, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise SpecError(f"{path.name}: the GGUF header names no general.architecture")

    def key(name: str, default: Any = None) -> Any:
        return _key(fields, f"{arch}.{name}", default)

    n_layer_all = _count(key("block_count"), "block_count", path, limit=100_000)
    if n_layer_all == 0:
        raise SpecError(f"{path.name}: block_count is 0; a model needs layers")
    n_embd = _count(key("embedding_length"), "embedding_length", path)
    nextn = _count(key("nextn_predict_layers", 0), "nextn_predict_layers", path)
    n_head = _per_layer(key("attention.head_count"), n_layer_all, "attention.head_count", path, 0)
    n_head_kv = _per_layer(key("attention.head_count_kv"), n_layer_all, "attention.head_count_kv", path, -1)
    n_head_kv = tuple(h if kv < 0 else kv for h, kv in zip(n_head, n_head_kv))
    h0 = n_head[0] if n_head and n_head[0] else 0
    head_k = _count(key("attention.key_length", n_embd // h0 if h0 else 0), "attention.key_length", path)
    head_v = _count(key("attention.value_length", n_embd // h0 if h0 else 0), "attention.value_length", path)
    n_rot = _count(key("rope.dimension_count", head_k), "rope.dimension_count", path)
    n_swa = _count(key("attention.sliding_window", 0), "attention.sliding_window", path)
    pattern = key("attention.sliding_window_pattern")
    is_swa = (False,) * n_layer_all
    if n_swa > 0:
        n_layer = n_layer_all - nextn
        if isinstance(pattern, list):
            if len(pattern) != n_layer_all:
                raise SpecError(f"{path.name}: sliding_window_pattern lists {len(pattern)} layers of {n_layer_all}")
            is_swa = tuple(bool(v) for v in pattern)
        else:
            n_pat, dense_first = SWA_PATTERNS.get(arch, (None, False))
            if isinstance(pattern, int) and not isinstance(pattern, bool):
                n_pat = pattern
            if n_pat is None:
                n_swa, is_swa = 0, (False,) * n_layer_all  # llama.cpp's own rule for this arch is unknown here
            else:
                is_swa = tuple((il < n_layer) and (n_pat == 0 or (il % n_pat != 0 if dense_first else
                                                                  il % n_pat < n_pat - 1)) for il in range(n_layer_all))
    n_ff = _per_layer(key("feed_forward_length"), n_layer_all, "feed_forward_length", path, 0)
    tokens = fields.get("tokenizer.ggml.tokens")
    n_vocab = _key(fields, f"{arch}.vocab_size")
    if n_vocab is None:
        n_vocab = len(tokens.data) if tokens is not None else 0
    tensors = []
    for t in reader.tensors:
        name = str(t.name)
        block = name.split(".", 2)[1] if name.startswith("blk.") else ""
        tensors.append(GgufTensor(name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.n_bytes),
                                  int(block) if block.isdigit() else None))
    file_type = _key(fields, "general.file_type")
    try:
        from gguf import LlamaFileType
        file_type = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except (ValueError, TypeError, ImportError):
        file_type = str(file_type or "")
    return GgufModel(
        path=path, arch=arch, name=str(_key(fields, "general.name", "") or ""), n_layer_all=n_layer_all,
        n_layer_nextn=nextn, n_embd=n_embd, n_ctx_train=_count(key("context_length", 0), "context_length", path),
        n_vocab=_count(n_vocab, "vocab_size", path), n_head=n_head, n_head_kv=n_head_kv,
        head_k=head_k, head_v=head_v,
        head_k_swa=_count(key("attention.key_length_swa", head_k), "attention.key_length_swa", path),
        head_v_swa=_count(key("attention.value_length_swa", head_v), "attention.value_length_swa", path),
        n_rot=n_rot, n_ff=n_ff, n_swa=n_swa, is_swa=is_swa, swa_chunked=arch in CHUNKED,
        kv_lora_rank=_count(key("attention.kv_lora_rank", 0), "attention.kv_lora_rank", path),
        q_lora_rank=_count(key("attention.q_lora_rank", 0), "attention.q_lora_rank", path),
        head_k_mla=_count(key("attention.key_length_mla", 0), "attention.key_length_mla", path),
        head_v_mla=_count(key("attention.value_length_mla", 0), "attention.value_length_mla", path),
        n_layer_kv_from_start=_kv_from_start(arch, n_layer_all, key("attention.shared_kv_layers", 0)),
        tensors=tuple(tensors), file_type=file_type,
    )


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

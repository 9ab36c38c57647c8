"""The llama.cpp runtime: what llama.cpp allocates for the KV cache when a model loads (the prepayment).

The rules are llama.cpp's own, read in the source that llama-cpp-python 0.3.36 vendors (llama.cpp commit
0c1e570, 2026-10-01); tests/test_llamacpp.py checks them against that llama.cpp, loaded for real:

- ``src/llama-context.cpp``: n_ctx = the trained context when 0; n_ctx = GGML_PAD(n_ctx, 256); with
  ``kv_unified`` one stream of n_ctx cells, else n_seq_max streams of n_ctx_seq = GGML_PAD(n_ctx /
  n_seq_max, 256) cells each (and n_ctx = n_ctx_seq x n_seq_max). n_batch = min(n_ctx, n_batch), n_ubatch =
  min(n_batch, n_ubatch). A quantized V cache needs flash attention (auto turns it on, off refuses); a
  quantized K or V type's block must divide every layer's head size; an MLA model takes one type for K and V.
- ``src/llama-kv-cache.cpp``: per layer that has K/V, K is [n_embd_k_gqa, kv_size, n_stream] and V
  [n_embd_v_gqa, kv_size, n_stream] in the cache types (ggml row size: elements / block x block bytes);
  without flash attention V is stored transposed, padded to the widest layer's V when widths differ. MLA
  (deepseek2) caches K only: the latent plus the rotary part, kv_lora_rank + n_rot wide.
- ``src/llama-kv-cache-iswa.cpp``: a model with sliding-window layers gets two caches: the full layers'
  n_ctx_seq cells, and the window layers' GGML_PAD(min(n_ctx_seq, n_swa x (unified ? n_seq_max : 1) +
  n_ubatch), 256) cells (n_ctx_seq with ``swa_full``).
- ``src/llama-model.cpp`` ``load_tensors``: with -ngl N, the layers from n_layer + 1 - N on and the output
  layer (first of all) sit on the GPU, with their K/V when ``offload_kqv``; the token embedding stays on the
  CPU (a tied output is a second copy of it, on the GPU). A build without a GPU keeps everything on the CPU.

Every cell is allocated (and zeroed) at load and the buffer never changes size: the whole context is paid
for before the first token. "Used" bytes are the cells that hold tokens so far.

Beside the KV: the compute buffer (``kvscope.core.prediction.llamacpp_compute``: sched_reserve's graphs through ggml's allocator, the
CPU backend's, exact), the output buffer (``llama_context::output_reserve``: n_vocab x n_seq_max x 4 B) and the
model buffers per backend. ``fit_llamacpp`` mirrors llama.cpp's own ``--fit`` (``common/fit.cpp``
``common_params_fit_impl``, on by default in llama-server): keep what leaves ``--fit-target`` (1 GiB) free, else
with -c 0 interpolate the context between --fit-ctx (4,096) and the trained one, else lower -ngl to what fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.caches import kv_layout
from kvscope.core.model.gguf import OWN_CACHE, GgufModel, is_gguf_source, read_gguf
from kvscope.core.model.spec import INDEXED_ATTENTION, NO_KV, ModelSpec, human_bytes
from kvscope.core.prediction.llamacpp_compute import (CacheGeom, ComputeEstimate, estimate, graph_shape,
                                                      output_buffer_bytes, shape_of_spec)
from kvscope.core.prediction.predict import MemoryBreakdown, Prediction, last_true
from kvscope.core.prediction.table import aligned, bytes_cell

LLAMA_CPP_COMMIT = "0c1e570"
#: Said wherever a compute buffer is shown: what was checked, and what was not.
COMPUTE_NOTE = ("compute buffer: llama.cpp's CPU backend, checked byte for byte against the real llama.cpp; CUDA and "
                "Metal reserve their compute buffers through other kernels and are not checked yet")
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_VERSION = f"llama.cpp {LLAMA_CPP_COMMIT} (vendored by llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})"
#: The KV cache types llama.cpp accepts (common/arg.cpp ``kv_cache_types``), ggml's (block, bytes per block).
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
    "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}
QUANTIZED = {"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}
PAD = 256
MAX_CONTEXT = 1 << 30


def _pad(n: int, to: int = PAD) -> int:
    return (n + to - 1) // to * to


def cache_type(name: str) -> str:
    key = str(name).strip().lower()
    if key not in CACHE_TYPES:
        raise SettingsError(f"unknown llama.cpp cache type {name!r}; use one of {', '.join(CACHE_TYPES)}")
    return key


def row_bytes(ggml_type: str, elements: int) -> int:
    """``ggml_row_size``: bytes of ``elements`` values of a ggml type (a whole number of blocks)."""
    block, size = CACHE_TYPES[ggml_type]
    if elements % block:
        raise SettingsError(f"cache type {ggml_type} stores blocks of {block} values, which do not divide a row of "
                            f"{elements}")
    return elements // block * size


@dataclass(frozen=True)
class LlamaCppOptions:
    """llama.cpp's context options that decide the KV cache, spelled as llama-server's flags."""

    n_ctx: int = 4096  # -c (0: the trained context)
    n_seq_max: int = 1  # -np / --parallel
    kv_unified: bool = False  # --kv-unified
    type_k: str = "f16"  # --cache-type-k
    type_v: str = "f16"  # --cache-type-v
    flash_attn: str = "auto"  # -fa on|off|auto
    swa_full: bool = False  # --swa-full
    n_batch: int = 2048  # -b
    n_ubatch: int = 512  # -ub
    n_gpu_layers: int = -1  # -ngl (-1: every layer)
    offload_kqv: bool = True  # --no-kv-offload sets False

    def __post_init__(self) -> None:
        object.__setattr__(self, "type_k", cache_type(self.type_k))
        object.__setattr__(self, "type_v", cache_type(self.type_v))
        fa = str(self.flash_attn).strip().lower()
        fa = {"1": "on", "true": "on", "enabled": "on", "0": "off", "false": "off", "disabled": "off"}.get(fa, fa)
        if fa not in ("on", "off", "auto"):
            raise SettingsError(f"--flash-attn {self.flash_attn!r}: use on, off or auto")
        object.__setattr__(self, "flash_attn", fa)
        if not (0 <= self.n_ctx <= MAX_CONTEXT):
            raise SettingsError(f"context {self.n_ctx} is outside 0-{MAX_CONTEXT:,} tokens")
        if not (1 <= self.n_seq_max <= 256):  # LLAMA_MAX_SEQ
            raise SettingsError(f"--parallel {self.n_seq_max}: llama.cpp takes 1 to 256 sequences")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise SettingsError("batch sizes must be positive")


@dataclass(frozen=True)
class KvBuffer:
    """One of llama.cpp's KV caches (the full layers', or the window layers')."""

    name: str  # "full" or "sliding window"
    cells: int  # kv_size: cells per stream
    streams: int
    layers: tuple[int, ...]
    k_bytes: int
    v_bytes: int
    row_bytes: int  # K + V bytes of one cell over this cache's layers
    layer_rows: tuple[int, ...]  # the same, per layer
    window: int = 0

    @property
    def total(self) -> int:
        return self.k_bytes + self.v_bytes


def cells_held(tokens: int, window: int, cells: int) -> int:
    """The cells of one stream that ``tokens`` tokens of a sequence occupy: every token, or in a window cache the
    window and the token being decoded; never more than the stream has."""
    return min(tokens if not window else min(tokens, window + 1), cells)


@dataclass(frozen=True)
class LlamaCppPlan:
    model: str
    options: LlamaCppOptions
    n_ctx: int  # after llama.cpp's padding
    n_ctx_seq: int
    n_ubatch: int
    flash_attn: bool
    buffers: tuple[KvBuffer, ...]
    n_layer: int
    weights: int | None  # bytes of the file's tensors (None: not a GGUF)
    weights_gpu: int | None
    gpu_layers: tuple[int, ...]  # layers whose weights (and K/V with offload_kqv) sit on the GPU
    notes: tuple[str, ...] = ()
    compute: "ComputeEstimate | None" = None  # the compute buffer (kvscope.core.prediction.llamacpp_compute), CPU backend
    output_bytes: int | None = None  # the output buffer at creation (logits for n_seq_max outputs)
    weights_duplicated: int = 0  # a tied output's second copy of the token embedding, on the GPU

    @property
    def model_buffers(self) -> dict[str, int] | None:
        """llama.cpp's model buffers per backend: on a GPU build with this -ngl, the GPU's and the CPU's (the token
        embedding and the layers left there); on a CPU build, one CPU buffer of every tensor (llama.cpp logs
        "CPU_Mapped model buffer size", equal to the file's tensor bytes)."""
        if self.weights is None:
            return None
        return {"gpu_build_gpu": self.weights_gpu,
                "gpu_build_cpu": self.weights - (self.weights_gpu - self.weights_duplicated),
                "cpu_build_cpu": self.weights}

    @property
    def compute_bytes(self) -> int | None:
        return self.compute.bytes if self.compute is not None else None

    @property
    def total_bytes(self) -> int | None:
        """Weights + KV + compute + output buffers: every buffer llama.cpp allocates for this context (None where
        a part is unknown)."""
        if self.weights is None or self.compute_bytes is None or self.output_bytes is None:
            return None
        return self.weights + self.kv_bytes + self.compute_bytes + self.output_bytes

    @property
    def kv_bytes(self) -> int:
        return sum(b.total for b in self.buffers)

    @property
    def kv_gpu_bytes(self) -> int:
        """The K/V of the layers on the GPU (none with --no-kv-offload)."""
        if not self.options.offload_kqv:
            return 0
        on = set(self.gpu_layers)
        return sum(sum(r for il, r in zip(b.layers, b.layer_rows) if il in on) * b.cells * b.streams for b in self.buffers)

    def used_bytes(self, tokens: int, sequences: int = 1) -> int:
        """Bytes of the cells that hold ``tokens`` tokens in each of ``sequences`` sequences: every token in a
        full layer, at most the window (plus the batch being decoded) in a window layer."""
        used = 0
        for b in self.buffers:
            if b.streams > 1:  # a stream per sequence
                used += b.row_bytes * cells_held(tokens, b.window, b.cells) * min(sequences, b.streams)
            else:  # one stream shared by the sequences
                used += b.row_bytes * min(cells_held(tokens, b.window, b.cells) * sequences, b.cells)
        return used

    def to_json(self) -> dict:
        o = self.options
        return {
            "runtime": "llama.cpp", "llama_cpp_version": LLAMA_CPP_VERSION, "n_ctx": self.n_ctx,
            "n_ctx_seq": self.n_ctx_seq, "n_seq_max": o.n_seq_max, "kv_unified": o.kv_unified, "type_k": o.type_k,
            "type_v": o.type_v, "flash_attn": self.flash_attn, "swa_full": o.swa_full, "n_ubatch": self.n_ubatch,
            "n_gpu_layers": len(self.gpu_layers), "kv_cache_bytes": self.kv_bytes, "kv_gpu_bytes": self.kv_gpu_bytes,
            "weights_bytes": self.weights, "weights_gpu_bytes": self.weights_gpu,
            "compute_buffer_bytes": self.compute_bytes, "output_buffer_bytes": self.output_bytes,
            "model_buffers_bytes": self.model_buffers,
            "compute_graphs": {name: n for name, n in self.compute.graphs} if self.compute else {},
            "compute_buffer_note": (self.compute.why_not if self.compute and self.compute.bytes is None else
                                    COMPUTE_NOTE),
            "caches": [{"name": b.name, "cells": b.cells, "streams": b.streams, "layers": len(b.layers),
                        "k_bytes": b.k_bytes, "v_bytes": b.v_bytes, "bytes_per_cell": b.row_bytes,
                        "window": b.window or None} for b in self.buffers],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class _Layer:
    il: int
    k: int  # elements of one K row
    v: int  # elements of one V row (0: MLA, K only)
    head_k: int
    head_v: int
    swa: bool


def _layers_of(source) -> tuple[list[_Layer], int, int, str, str]:
    """(layers with K/V, n_layer, n_swa, architecture, name) of a GgufModel or a ModelSpec."""
    if isinstance(source, GgufModel):
        g = source
        if g.arch in OWN_CACHE:
            raise SettingsError(f"{g.path.name}: llama.cpp gives {g.arch} a cache of its own (recurrent, hybrid, "
                                "indexed or compressed), whose allocation KV Scope does not follow yet")
        if g.swa_chunked and g.n_swa:
            raise SettingsError(f"{g.path.name}: {g.arch}'s chunked attention cache is not followed by KV Scope yet")
        layers = []
        for il in range(g.n_layer):
            if not g.has_kv(il) or g.n_head_kv[il] == 0:
                continue
            # n_embd_k_gqa(il); an MLA file stores key_length = kv_lora_rank + n_rot and one KV head, and no V.
            layers.append(_Layer(il, g.k_width(il), 0 if g.is_mla else g.v_width(il), g.head_k_of(il), g.head_v_of(il),
                                 g.is_swa[il]))
        return layers, g.n_layer, g.n_swa, g.arch, g.path.name
    spec: ModelSpec = source

    if any(kind == INDEXED_ATTENTION for kind in spec.layer_types):
        raise SettingsError(f"{spec.label}: llama.cpp gives indexed (DSA) attention a cache of its own, whose "
                            "allocation KV Scope does not follow yet")
    layers = []
    kv_layers = [il for il, kind in enumerate(spec.layer_types) if kind != NO_KV]
    if spec.is_mla:
        rope = spec.qk_rope_head_dim or 0
        layers = [_Layer(il, spec.kv_lora_rank + rope, 0, spec.kv_lora_rank + rope, spec.kv_lora_rank, False)
                  for il in kv_layers]
    else:  # each layer as transformers' config describes it (per-layer heads and widths where they differ)
        for il, shape in zip(kv_layers, kv_layout(spec)):
            layers.append(_Layer(il, shape.heads * shape.k_dim, shape.heads * shape.v_dim, shape.k_dim, shape.v_dim,
                                 shape.window is not None))
    return layers, spec.num_layers, spec.sliding_window or 0, spec.model_type, spec.label


def plan(source, options: LlamaCppOptions | None = None, n_ctx_train: int | None = None, with_buffers: bool = True
         ) -> LlamaCppPlan:
    """What llama.cpp allocates for ``source`` (a ``kvscope.core.model.gguf.GgufModel`` or a ``ModelSpec``) under ``options``
    (``with_buffers`` False: the KV and weights only, without replaying the compute graph)."""
    o = options or LlamaCppOptions()
    layers, n_layer, n_swa, arch, name = _layers_of(source)
    trained = n_ctx_train or (source.n_ctx_train if isinstance(source, GgufModel) else source.max_position_embeddings)
    n_ctx_user = o.n_ctx or trained
    if not n_ctx_user:
        raise SettingsError(f"{name}: no context given and the file names no trained context (context_length)")
    notes = []
    n_batch = min(n_ctx_user, o.n_batch)
    n_ubatch = min(n_batch, o.n_ubatch)
    n_ctx = _pad(n_ctx_user)
    if o.kv_unified:
        n_ctx_seq, streams = n_ctx, 1
    else:
        n_ctx_seq = _pad(n_ctx // o.n_seq_max)
        if n_ctx_seq == 0:
            raise SettingsError(f"context {n_ctx_user} is too small for {o.n_seq_max} sequences")
        n_ctx, streams = n_ctx_seq * o.n_seq_max, o.n_seq_max
    if n_ctx != n_ctx_user:
        notes.append(f"context {n_ctx_user:,} becomes {n_ctx:,} cells: llama.cpp pads it to a multiple of {PAD}"
                     + ("" if o.kv_unified or o.n_seq_max == 1 else
                        f" per sequence ({o.n_seq_max} x {n_ctx_seq:,})"))
    quant_v = o.type_v in QUANTIZED
    if o.flash_attn == "off" and quant_v:
        raise SettingsError(f"a quantized V cache ({o.type_v}) needs flash attention: llama.cpp refuses it with "
                            "-fa off (use -fa on or auto)")
    flash = o.flash_attn != "off"
    if o.flash_attn == "auto":
        notes.append("flash attention auto: llama.cpp turns it on where the device supports it (assumed here)")
    is_mla = any(layer.v == 0 for layer in layers)
    if is_mla and o.type_k != o.type_v:
        raise SettingsError(f"an MLA model takes one cache type for K and V: llama.cpp refuses K {o.type_k} with "
                            f"V {o.type_v} (give both the same)")
    for layer in layers:
        for kind, head, typ in (("K", layer.head_k, o.type_k), ("V", layer.head_v, o.type_v)):
            block = CACHE_TYPES[typ][0]
            if flash and typ in QUANTIZED and head % block and (kind == "K" or not is_mla):
                raise SettingsError(f"{kind} cache type {typ} stores blocks of {block}, which do not divide the head "
                                    f"size {head} of layer {layer.il}: llama.cpp refuses this context")
    v_trans = not flash
    v_max = max((layer.v for layer in layers), default=0)
    if v_trans and len({layer.v for layer in layers}) > 1:
        notes.append(f"V widths differ between layers and flash attention is off: llama.cpp pads every V row to {v_max}")
    groups: list[tuple[str, list[_Layer], int, int]] = []
    swa_layers = [layer for layer in layers if layer.swa]
    full_layers = [layer for layer in layers if not layer.swa]
    if swa_layers and n_swa:
        size_swa = n_ctx_seq if o.swa_full else _pad(min(n_ctx_seq, n_swa * (o.n_seq_max if o.kv_unified else 1) + n_ubatch))
        groups = [("full", full_layers, n_ctx_seq, 0), ("sliding window", swa_layers, size_swa, n_swa)]
        if not o.swa_full:
            notes.append(f"{len(swa_layers)} window layers keep {size_swa:,} cells (window {n_swa:,} + ubatch "
                         f"{n_ubatch}, padded to {PAD}); --swa-full would give them {n_ctx_seq:,}")
    else:
        groups = [("full", layers, n_ctx_seq, 0)]
    buffers = []
    for label, group, cells, window in groups:
        k_rows = [row_bytes(o.type_k, layer.k) for layer in group]
        v_rows = [row_bytes(o.type_v, v_max if v_trans else layer.v) if layer.v else 0 for layer in group]
        buffers.append(KvBuffer(label, cells, streams, tuple(layer.il for layer in group), sum(k_rows) * cells * streams,
                                sum(v_rows) * cells * streams, sum(k_rows) + sum(v_rows),
                                tuple(k + v for k, v in zip(k_rows, v_rows)), window))
    if is_mla:
        notes.append("MLA: llama.cpp caches the latent and the rotary key (K only, no V)")
    # llama_model::load_tensors: i_gpu_start = max(n_layer_all + 1 - ngl, 0); layers from there, and the output
    # layer (index n_layer_all) first of all, go to the GPU; the input layer (token embedding) never does.
    n_all = source.n_layer_all if isinstance(source, GgufModel) else n_layer
    ngl = n_all + 1 if o.n_gpu_layers < 0 else min(o.n_gpu_layers, n_all + 1)
    gpu_start = max(n_all + 1 - ngl, 0)
    gpu_layers = tuple(range(gpu_start, n_all))
    output_on_gpu = ngl >= 1
    weights = weights_gpu = None
    dup = 0
    if isinstance(source, GgufModel):
        weights = source.weight_bytes
        by_layer = source.bytes_by_layer
        weights_gpu = sum(by_layer.get(il, 0) for il in gpu_layers)
        if output_on_gpu:
            embd = sum(t.n_bytes for t in source.tensors if t.name == "token_embd.weight")
            weights_gpu += by_layer.get(None, 0) - embd  # the output layer and norms, not the input layer
            if not any(t.name == "output.weight" for t in source.tensors):  # tied: TENSOR_DUPLICATED, a GPU copy
                dup = embd
                weights_gpu += dup
                if o.n_gpu_layers != 0:
                    notes.append(f"tied output: llama.cpp loads the token embedding twice, {dup:,} B more on the GPU")
    compute, output = (_compute_and_output(source, o, n_batch, n_ubatch, flash, buffers, v_trans, v_max)
                       if with_buffers else (None, None))
    return LlamaCppPlan(name, o, n_ctx, n_ctx_seq, n_ubatch, flash, tuple(buffers), n_layer, weights, weights_gpu,
                        gpu_layers, tuple(notes), compute, output, dup)


def _compute_and_output(source, o: LlamaCppOptions, n_batch: int, n_ubatch: int, flash: bool, buffers, v_trans: bool,
                        v_max: int):
    """The compute buffer (``kvscope.core.prediction.llamacpp_compute``: llama.cpp's reserved graphs through its allocator) and the
    output buffer (``llama_context::output_reserve(n_seq_max)``: n_vocab x n_seq_max f32 logits)."""
    if isinstance(source, GgufModel):
        shape, n_vocab = graph_shape(source), source.n_vocab
    else:
        shape, n_vocab = shape_of_spec(source), source.vocab_size
    caches = {("swa" if b.window else "full"): CacheGeom(b.cells, b.streams, o.type_k, o.type_v, v_trans, v_max)
              for b in buffers}
    try:
        compute = estimate(shape, n_ubatch=n_ubatch, n_batch=n_batch, n_seq_max=o.n_seq_max, flash=flash,
                           unified=o.kv_unified, caches=caches)
    except (ArithmeticError, IndexError, KeyError, ValueError) as exc:  # a shape the replay cannot build: unknown
        compute = ComputeEstimate(None, (), f"the graph could not be replayed for this model ({type(exc).__name__})")
    return compute, output_buffer_bytes(n_vocab, o.n_seq_max) if n_vocab else None


#: ggml-cpu's extra buffer type CPU_REPACK (ggml/src/ggml-cpu/repack.cpp ``ggml_repack_get_optimal_repack_type``): per
#: CPU feature set, the ggml types whose weights llama.cpp re-lays in interleaved rows at load, each with the row
#: count that must divide the tensor's ne[1]. Checked against llama.cpp's dry run on AVX-512 (Q4_0, MXFP4: the types
#: the ``gguf`` package can write); the others are the source's, not checked here.
REPACK_TYPES: dict[str, dict[str, int]] = {
    "avx2": {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8},
    "avx512": {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8, "Q2_K": 8},
    "neon-i8mm": {"Q4_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8, "IQ4_NL": 4, "MXFP4": 4, "Q8_0": 4},
    "neon-dotprod": {"Q4_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8, "IQ4_NL": 4, "MXFP4": 4, "Q8_0": 4},
    "none": {},
}
#: Weights llama.cpp reads by row (GGML_OP_GET_ROWS), never by a matrix product: the repack buffer cannot take them.
_GET_ROWS = ("token_embd.weight", "pos_embd.weight", "token_types.weight", "per_layer_token_embd.weight")
#: ggml's CPU buffer alignment (TENSOR_ALIGNMENT), and a GGUF's default tensor alignment in the file.
CPU_ALIGNMENT = 32


@dataclass(frozen=True)
class CpuModelBuffers:
    """llama.cpp's model buffers on a CPU build (``llama_model::load_tensors``, ``select_weight_buft``: the CPU's extra
    buffer types first): the tensors CPU_REPACK takes (a 2-D matrix-product weight, or 3-D experts under MUL_MAT_ID,
    of a type the CPU repacks, with ne[1] a multiple of its rows), and the rest in the default CPU buffer: with mmap
    (llama.cpp's default) the file's range from the first of them to the end of the last, ``CPU_Mapped`` (repacked
    tensors between them included); without mmap their bytes, each padded to 32, ``CPU``."""

    isa: str
    cpu: int  # the default buffer's tensors, padded (a load without mmap: "CPU")
    mapped: int  # the file range that holds them (a load with mmap: "CPU_Mapped")
    repack: int  # CPU_REPACK
    repacked: tuple[str, ...]  # the tensors in CPU_REPACK (a tied output's copy of the token embedding included)

    def by_type(self, mmap: bool = True) -> dict[str, int]:
        """The buffers llama.cpp logs (``load_tensors: X model buffer size``), per type, with or without mmap."""
        out = {("CPU_Mapped" if mmap else "CPU"): self.mapped if mmap else self.cpu}
        if self.repack:
            out["CPU_REPACK"] = self.repack
        return out


def cpu_model_buffers(g: GgufModel, isa: str = "avx2") -> CpuModelBuffers:
    """The model buffers per type of ``g`` on a CPU build whose CPU has ``isa`` (a key of ``REPACK_TYPES``)."""
    rules = REPACK_TYPES.get(isa)
    if rules is None:
        raise SettingsError(f"unknown CPU feature set {isa!r}; use one of {', '.join(REPACK_TYPES)}")

    def pad(n: int) -> int:
        return (n + CPU_ALIGNMENT - 1) // CPU_ALIGNMENT * CPU_ALIGNMENT

    def repacks(t, as_output: bool = False) -> bool:
        rows = rules.get(t.ggml_type)
        if not rows or len(t.shape) < 2 or t.shape[1] % rows:
            return False
        if t.name.endswith("_exps.weight"):  # MUL_MAT_ID
            return len(t.shape) == 3
        return len(t.shape) == 2 and (as_output or t.name not in _GET_ROWS)

    repacked = [t for t in g.tensors if repacks(t)]
    names = {t.name for t in repacked}
    rest = [t for t in g.tensors if t.name not in names]
    extra = 0
    embd = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
    if embd is not None and not any(t.name == "output.weight" for t in g.tensors) and repacks(embd, as_output=True):
        extra = pad(embd.n_bytes)  # a tied output: the token embedding again, as the output layer's matrix product
    offsets, at = {}, 0
    for t in g.tensors:  # gguf.cpp: each tensor at the previous ones' sizes, padded to the alignment
        offsets[t.name] = at
        at += pad(t.n_bytes)
    mapped = (max(offsets[t.name] + t.n_bytes for t in rest) - min(offsets[t.name] for t in rest)) if rest else 0
    return CpuModelBuffers(isa, sum(pad(t.n_bytes) for t in rest), mapped,
                           sum(pad(t.n_bytes) for t in repacked) + extra,
                           tuple(t.name for t in repacked) + (("token_embd.weight (output)",) if extra else ()))


def render(p: LlamaCppPlan, trained: int | None = None) -> list[str]:
    """Lines for ``calc --runtime llama.cpp``: the settings as llama.cpp takes them, each cache, the totals."""
    o = p.options
    lines = [
        f"llama.cpp's KV allocation ({LLAMA_CPP_VERSION}: src/llama-context.cpp, src/llama-kv-cache.cpp, "
        "src/llama-kv-cache-iswa.cpp):",
        f"  -c {o.n_ctx or trained or p.n_ctx} -np {o.n_seq_max}{' --kv-unified' if o.kv_unified else ''} "
        f"--cache-type-k {o.type_k} --cache-type-v {o.type_v} -fa {o.flash_attn}{' --swa-full' if o.swa_full else ''} "
        f"-b {o.n_batch} -ub {o.n_ubatch} -ngl {'all' if o.n_gpu_layers < 0 else o.n_gpu_layers}",
        f"  n_ctx {p.n_ctx:,}, n_ctx_seq {p.n_ctx_seq:,}, flash attention {'on' if p.flash_attn else 'off'}",
    ]
    for b in p.buffers:
        lines.append(f"  {b.name:>14} cache: {b.cells:,} cells x {b.streams} stream{'s' if b.streams != 1 else ''} x "
                     f"{b.row_bytes:,} B per cell ({len(b.layers)} layers) = {b.total:,} B ({human_bytes(b.total)})")
    lines.append(f"  KV cache allocated at load: {p.kv_bytes:,} B ({human_bytes(p.kv_bytes)}), the same from the "
                 "first token to the last (prepaid)")
    if p.weights is not None:
        lines.append(f"  weights (the file's tensors): {p.weights:,} B ({human_bytes(p.weights)})")
        if o.n_gpu_layers >= 0:
            out = "the output layer and " if o.n_gpu_layers >= 1 else ""
            lines.append(f"  -ngl {o.n_gpu_layers} (a GPU build): {out}{len(p.gpu_layers)} of {p.n_layer} repeating layers "
                         f"on the GPU: weights {p.weights_gpu:,} B, KV {p.kv_gpu_bytes:,} B there; the rest in system "
                         "memory")
    lines += render_buffers(p)
    for note in p.notes:
        lines.append(f"  {note}")
    return lines


def render_buffers(p: LlamaCppPlan) -> list[str]:
    """The compute and output buffers, with what each is and how far it was checked."""
    lines = []
    c = p.compute
    if c is not None and c.bytes is not None:
        graphs = ", ".join(f"{name} graph {n:,} B" for name, n in c.graphs)
        lines.append(f"  compute buffer (sched_reserve, CPU backend): {c.bytes:,} B ({human_bytes(c.bytes)}), the "
                     f"largest of its reserved graphs ({graphs}; n_ubatch {p.n_ubatch}, flash attention "
                     f"{'on' if p.flash_attn else 'off'})")
        lines.append(f"  ({COMPUTE_NOTE})")
    else:
        lines.append(f"  compute buffer: n/a ({c.why_not if c is not None else 'not predicted'})")
    if p.output_bytes is not None:
        lines.append(f"  output buffer (output_reserve, host memory): {p.output_bytes:,} B ({human_bytes(p.output_bytes)}): "
                     f"logits for {p.options.n_seq_max} output{'s' if p.options.n_seq_max != 1 else ''} x n_vocab x 4 B")
    return lines


# --------------------------------------------------------------------------------------------
# calc --runtime llama.cpp


@dataclass(frozen=True)
class LlamaCppCalc:
    model: str
    gguf: bool  # weights are the file's tensors (else the spec's parameters in fp16, as an F16 conversion)
    plans: tuple[LlamaCppPlan, ...]
    contexts: tuple[int, ...]
    weights: int
    gpu_memory: int | None
    max_context: int | None
    trained: int
    by_type: tuple[tuple[str, int], ...] = ()  # a GGUF's tensor bytes per ggml type, largest first

    fit: "LlamaCppFit | None" = None
    fit_auto: "LlamaCppFit | None" = None  # the same with -c 0 (llama-server's default: the trained context)
    source: str = ""  # the model as given (a .gguf path where ``gguf``)

    def rows(self) -> list[dict]:
        """One row per context: weights, KV, compute and output buffers; total_bytes is their sum (None where the
        compute buffer is not predicted: unknown, never counted as 0)."""
        rows = []
        for c, p in zip(self.contexts, self.plans):
            parts = (self.weights, p.kv_bytes, p.compute_bytes, p.output_bytes)
            rows.append({"context": c, "kv_cache_bytes": p.kv_bytes, "weights_bytes": self.weights,
                         "compute_buffer_bytes": p.compute_bytes, "output_buffer_bytes": p.output_bytes,
                         "activation_bytes": p.compute_bytes,
                         "total_bytes": None if any(x is None for x in parts) else sum(parts)})
        return rows


def gpu_bytes(p: LlamaCppPlan, weights: int) -> int | None:
    """What one GPU holds for plan ``p``: its layers' weights (``weights`` where the model is not a GGUF) and K/V, and
    the compute buffer where any layer is there (the CPU backend's figure: CUDA's follows other kernels). The output
    buffer is host memory. None where the compute buffer is not predicted."""
    if p.compute_bytes is None:
        return None
    w = p.weights_gpu
    if w is None:  # a config's spec: its weights split by the repeating layers on the GPU (a GGUF splits exactly)
        w = weights if p.options.n_gpu_layers < 0 else weights * len(p.gpu_layers) // max(1, p.n_layer)
    on_gpu = p.options.n_gpu_layers != 0
    return w + p.kv_gpu_bytes + (p.compute_bytes if on_gpu else 0)


def largest_context_on_gpu(model, options_for, memory: int, weights: int, limit: int = MAX_CONTEXT) -> int | None:
    """The largest context whose GPU total (weights and KV on the GPU, by ``plan``'s -ngl split, plus the compute
    buffer; ``weights`` where the model is not a GGUF) fits in ``memory``; None if not even one token does. Where the
    compute buffer is not predicted, weights + KV only (and the caller says so)."""
    def weights_kv(n: int) -> int:
        p = plan(model, options_for(n), with_buffers=False)
        return (p.weights_gpu if p.weights_gpu is not None else weights) + p.kv_gpu_bytes

    def fits(n: int) -> bool:
        p = plan(model, options_for(n))
        total = gpu_bytes(p, weights)
        return (total if total is not None else weights_kv(n)) <= memory

    if not fits(1):
        return None
    # Bounds from the cheap part (weights + KV): the answer is at most where they alone fill the memory, and at least
    # where they fill it less the compute buffer of that upper bound (the buffer grows with the context).
    hi = last_true(lambda n: weights_kv(n) <= memory, 1, limit)
    top = plan(model, options_for(hi)).compute_bytes
    if top is None:
        return hi
    lo = last_true(lambda n: weights_kv(n) + top <= memory, 1, hi) if weights_kv(1) + top <= memory else 1
    # llama.cpp pads the context to 256 cells: search whole steps, then within the last one
    step = 256
    k = last_true(lambda i: fits(max(lo, min(hi, i * step))), lo // step, hi // step + 1)
    base = max(lo, min(hi, k * step))
    return last_true(fits, base, min(hi, base + step))


#: common/common.h: llama.cpp's --fit defaults (on; 1 GiB left free per device; contexts down to 4,096).
FIT_TARGET_BYTES = 1 << 30
FIT_MIN_CTX = 4096


@dataclass(frozen=True)
class LlamaCppFit:
    """What llama.cpp's ``--fit`` (common/fit.cpp ``common_params_fit_impl``, one GPU) settles on."""

    free: int  # the device memory given
    target: int  # free - the --fit-target margin: what the projection must stay under
    n_ctx: int
    n_gpu_layers: int  # -ngl (n_layer + 1: everything, the output layer included)
    n_layer: int
    projected: int  # the device bytes at that n_ctx and -ngl
    steps: tuple[str, ...]


def fit_llamacpp(model, options: LlamaCppOptions, free: int, weights: int = 0, target_margin: int = FIT_TARGET_BYTES,
                 n_ctx_min: int = FIT_MIN_CTX) -> LlamaCppFit | None:
    """llama.cpp's own fitting for one GPU with ``free`` bytes (common/fit.cpp, the llama.cpp llama-cpp-python 0.3.36
    vendors): (1) project weights + context + compute at the given -c and every layer on the GPU: if it leaves
    ``target_margin`` free, nothing changes; (2) only with -c 0 (the trained context): the context is interpolated
    linearly between --fit-ctx (4,096) and the trained context on the projected bytes, rounded down to 256 x streams;
    (3) -ngl (if not given) is the most layers whose projection stays under free - margin. None where the compute
    buffer is not predicted."""
    n_all = model.n_layer_all if isinstance(model, GgufModel) else model.num_layers
    trained = model.n_ctx_train if isinstance(model, GgufModel) else model.max_position_embeddings
    streams = 1 if options.kv_unified else max(1, options.n_seq_max)
    target = free - target_margin
    steps = []

    def used(n_ctx: int, ngl: int) -> int | None:
        from dataclasses import replace

        return gpu_bytes(plan(model, replace(options, n_ctx=n_ctx, n_gpu_layers=ngl)), weights)

    ctx_auto = options.n_ctx == 0
    n_ctx = trained * streams if ctx_auto else options.n_ctx
    ngl_all = n_all + 1
    full = used(n_ctx, ngl_all if options.n_gpu_layers < 0 else options.n_gpu_layers)
    if full is None:
        return None
    if full <= target:
        steps.append(f"projected {full:,} B at -c {n_ctx:,} with every layer on the GPU leaves at least "
                     f"{human_bytes(target_margin)} free: no change")
        ngl = ngl_all if options.n_gpu_layers < 0 else options.n_gpu_layers
        return LlamaCppFit(free, target, n_ctx, ngl, n_all, full, tuple(steps))
    if ctx_auto and n_ctx > n_ctx_min * streams:
        lo_ctx = n_ctx_min * streams
        at_min = used(lo_ctx, ngl_all)
        if target > at_min:
            n_new = lo_ctx + (n_ctx - lo_ctx) * (target - at_min) // (full - at_min)
            align = 256 * streams
            n_new = max(n_new - n_new % align, lo_ctx)
            steps.append(f"context reduced from {n_ctx:,} to {n_new:,} (linear between {lo_ctx:,} and {n_ctx:,} on the "
                         f"projected bytes, rounded down to {align})")
            proj = used(n_new, ngl_all)
            return LlamaCppFit(free, target, n_new, ngl_all, n_all, proj, tuple(steps))
        steps.append(f"even -c {lo_ctx:,} does not fit with every layer on the GPU")
        n_ctx = lo_ctx
    elif not ctx_auto:
        steps.append(f"context set by the user ({n_ctx:,}): not changed")
    if options.n_gpu_layers >= 0:
        proj = used(n_ctx, options.n_gpu_layers)
        steps.append(f"-ngl set by the user ({options.n_gpu_layers}): llama.cpp's fit stops here (does not fit)")
        return LlamaCppFit(free, target, n_ctx, options.n_gpu_layers, n_all, proj, tuple(steps))
    # step 3, one device, a dense model: the largest number of layers whose projection meets the target
    def fits(ngl: int) -> bool:  # monotone: every added layer adds its weights and K/V
        proj = used(n_ctx, ngl)
        return proj is not None and proj <= target

    best = last_true(fits, 0, ngl_all) if fits(0) else 0
    proj = used(n_ctx, best)
    steps.append(f"-ngl {best}: the most layers (of {ngl_all}, the output layer first) whose projection stays under "
                 f"{human_bytes(target)}")
    return LlamaCppFit(free, target, n_ctx, best, n_all, proj, tuple(steps))


def calculate_llamacpp(source: str, spec: ModelSpec, contexts: list[int], options_for, gpu_memory: int | None = None,
                       fit_target: int = 1 << 30) -> LlamaCppCalc:
    """One llama.cpp plan per context (``options_for(n_ctx)`` gives the options); with ``gpu_memory``, the largest
    context whose GPU total (weights, KV and compute buffer there) fits in it, and what llama.cpp's --fit settles on
    for the last context (``fit_llamacpp``)."""
    model = read_gguf(source) if is_gguf_source(source) else spec
    plans = tuple(plan(model, options_for(n)) for n in contexts)
    gguf = model is not spec
    weights = model.weight_bytes if gguf else int(spec.num_parameters * 2)
    trained = model.n_ctx_train if gguf else spec.max_position_embeddings
    fits = largest_context_on_gpu(model, options_for, gpu_memory, weights) if gpu_memory else None
    by_type = tuple(model.bytes_by_type().items()) if gguf else ()
    fit = fit_llamacpp(model, options_for(contexts[-1]), gpu_memory, weights, fit_target) if gpu_memory else None
    from dataclasses import replace

    fit_auto = (fit_llamacpp(model, replace(options_for(contexts[-1]), n_ctx=0), gpu_memory, weights, fit_target)
                if gpu_memory else None)
    return LlamaCppCalc(spec.label, gguf, plans, tuple(contexts), weights, gpu_memory, fits, trained, by_type, fit,
                        fit_auto, source)


def _fit_json(f: "LlamaCppFit | None") -> dict | None:
    if f is None:
        return None
    return {"n_ctx": f.n_ctx, "n_gpu_layers": f.n_gpu_layers, "n_layer": f.n_layer, "projected_bytes": f.projected,
            "target_bytes": f.target, "steps": list(f.steps)}


def render_llamacpp_json(r: LlamaCppCalc) -> str:
    import json

    return json.dumps({"model": r.model, "runtime": "llama.cpp", "llama_cpp_version": LLAMA_CPP_VERSION,
                       "weights_exact": r.gguf, "weights_by_type": dict(r.by_type), "rows": r.rows(), "llama_cpp": [p.to_json() for p in r.plans],
                       "gpu_memory": r.gpu_memory, "max_context": r.max_context,
                       "fit": _fit_json(r.fit), "fit_context_auto": _fit_json(r.fit_auto),
                       "compute_buffer_note": COMPUTE_NOTE})


def render_llamacpp_table(r: LlamaCppCalc, totals: dict[int, str] | None = None) -> str:
    """The table and the last context's allocation in words; ``totals``: a context's total cell where the replay
    has none and another source does (llama.cpp's dry run, said in the cell)."""
    lines = [f"{safe_text(r.model, limit=NAME_LIMIT)}: llama.cpp runtime ({LLAMA_CPP_VERSION})",
             "weights: the GGUF file's tensors, exact: " + ", ".join(f"{t} {human_bytes(n)}" for t, n in r.by_type)
             if r.gguf else
             "weights: the parameters at 2 bytes (an F16 GGUF); give a .gguf file for its exact tensor bytes", ""]
    header = ("context", "cells", "KV allocated at load", "compute buffer", "output", "weights", "total")
    table = [header]
    beyond = False
    for c, p, row in zip(r.contexts, r.plans, r.rows()):
        cells = " + ".join(f"{b.cells:,}" + (f" x{b.streams}" if b.streams > 1 else "") for b in p.buffers)
        mark = "*" if r.trained and c > r.trained else ""
        beyond = beyond or bool(mark)
        total = row["total_bytes"]
        table.append((f"{c:,}{mark}", cells, bytes_cell(p.kv_bytes),
                      bytes_cell(p.compute_bytes) if p.compute_bytes is not None else "n/a",
                      bytes_cell(p.output_bytes) if p.output_bytes is not None else "n/a", bytes_cell(r.weights),
                      bytes_cell(total) if total is not None else (totals or {}).get(c, "n/a")))
    lines += aligned(table)
    lines.append("")
    if beyond:
        lines += [f"* beyond the model's trained context of {r.trained:,} tokens (llama.cpp warns, and allocates it)", ""]
    lines += render(r.plans[-1], r.trained)[1:]
    if r.gpu_memory is not None:
        counted = ("weights, KV and compute buffer" if r.plans[-1].compute_bytes is not None else
                   "weights and KV (the compute buffer is not predicted for this model: it comes on top)")
        if r.max_context is None:
            lines.append(f"Does not fit in {human_bytes(r.gpu_memory)} even at 1 token.")
        else:
            lines.append(f"Largest context whose GPU {counted} fit in {human_bytes(r.gpu_memory)}: "
                         f"{r.max_context:,} tokens.")
        if r.fit is not None:
            f = r.fit
            lines.append(f"llama.cpp's --fit (common/fit.cpp, --fit-target {human_bytes(f.free - f.target)} left free) "
                         f"with {human_bytes(f.free)}: -c {f.n_ctx:,} -ngl {f.n_gpu_layers} (of {f.n_layer + 1}), "
                         f"projected {f.projected:,} B ({human_bytes(f.projected)}) on the GPU:")
            lines += [f"  {step}" for step in f.steps]
        if r.fit_auto is not None:
            f = r.fit_auto
            lines.append(f"With -c 0 (llama-server's default, the trained {r.trained:,}), --fit settles on -c {f.n_ctx:,} "
                         f"-ngl {f.n_gpu_layers}: " + "; ".join(f.steps))
        if not r.gguf:
            lines.append("(a config's weights are split between GPU and CPU by layer count; give a .gguf for the "
                         "exact split)")
    lines.append("llama.cpp allocates the whole context's KV cache when the model loads: the context is paid for "
                 "before the first token.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The calculator's llama.cpp runtime: a Prediction per context, as kvscope.core.prediction.predict gives for transformers.


def gguf_of(spec: ModelSpec):
    """The GgufModel a spec was read from (``kvscope.core.model.gguf``), or None for a config's spec."""
    path = spec.config.get("gguf") if isinstance(spec.config, dict) else None
    return read_gguf(path) if path else None


def options_for(context: int, cache: str = "f16", n_seq_max: int = 1) -> LlamaCppOptions:
    """llama-server's defaults with one cache type for K and V (flash attention auto: a quantized V takes it on)."""
    return LlamaCppOptions(n_ctx=context, type_k=cache, type_v=cache, n_seq_max=n_seq_max)


def predict_llamacpp(spec: ModelSpec, context: int, cache: str = "f16", n_seq_max: int = 1):
    """What llama.cpp puts on the GPU for ``context`` (-ngl all) as a ``kvscope.core.prediction.predict.Prediction``: the weights there
    (a GGUF's tensors but the token embedding, plus a tied output's copy; else the parameters at 2 bytes), the KV
    allocated at load, and the compute buffer as the activations (the CPU backend's, ``kvscope.core.prediction.llamacpp_compute``; None
    where the graph is not replayed). The prompt graph's mark is the prefill peak, the one-token graph's the decode
    step's."""
    model = gguf_of(spec) or spec
    p = plan(model, options_for(context, cache, n_seq_max))
    weights = p.weights_gpu if p.weights_gpu is not None else int(spec.num_parameters * 2)
    graphs = dict(p.compute.graphs) if p.compute is not None else {}
    return Prediction(context=context, breakdown=MemoryBreakdown(weights=weights, kv_cache=p.kv_bytes,
                                                                 activations=p.compute_bytes),
                      activations_prefill=graphs.get("prompt", 0), activations_decode=graphs.get("token", 0),
                      kv_bytes_per_token=sum(b.row_bytes for b in p.buffers))  # one cell in each cache per token


def max_context_llamacpp(spec: ModelSpec, memory: int, cache: str = "f16", limit: int = MAX_CONTEXT) -> int | None:
    """The largest context whose GPU weights, allocated KV and compute buffer fit in ``memory`` (None: not even one
    token), by the same rule as ``calc --runtime llama.cpp --gpu-memory`` (``largest_context_on_gpu``)."""
    return largest_context_on_gpu(gguf_of(spec) or spec, lambda n: options_for(n, cache), memory,
                                  int(spec.num_parameters * 2), limit)


def formula_llamacpp(spec: ModelSpec, context: int, cache: str = "f16") -> str:
    """The allocation in words, one line per cache: cells x layers x bytes per layer per cell."""
    p = plan(gguf_of(spec) or spec, options_for(context, cache))
    lines = [f"{b.cells:,} cells \u00d7 {b.row_bytes:,} B per cell ({len(b.layers)} layers, {b.name}) = {b.total:,} B"
             for b in p.buffers]
    lines.append(f"allocated at load: {p.kv_bytes:,} B ({human_bytes(p.kv_bytes)}), prepaid for all {p.n_ctx:,} cells")
    return "\n".join(lines)

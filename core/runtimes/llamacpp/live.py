"""The real llama.cpp, through llama-cpp-python's C API: load a GGUF with given context options, and read back
what llama.cpp allocated for its KV cache.

llama-cpp-python 0.3.36 has no function that returns the KV bytes. What llama.cpp does say, exactly:

- its log, at context creation: per cache ``llama_kv_cache: size = X MiB (C cells, L layers, S/N seqs),
  K (type): X MiB, V (type): X MiB`` (cells and layers exact, sizes to 0.01 MiB) and per device
  ``CPU KV buffer size = X MiB``;
- ``llama_state_seq_get_size``: a sequence's state grows, per token, by the K/V bytes of one cell in every
  cache plus 12 bytes of cell metadata per cache (position, sequence count, sequence id:
  ``llama_kv_cache::state_write_meta``), so two sizes one token apart give the bytes per cell exactly;
- ``llama_memory_seq_pos_max``: the cells a sequence uses.

``observe()`` puts them together: cells x streams x bytes per cell is the allocation, byte for byte, and
each logged MiB figure must agree with it to the log's rounding. The log callback is process-wide in
llama.cpp, so one capture serves every load in the process (a lock keeps loads one at a time).
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from kvscope.core.model.attention import SettingsError
from kvscope.core.prediction.llamacpp import LlamaCppOptions

MIB = 1024 * 1024
#: ``llama_kv_cache::state_write_meta`` per cell of one sequence: pos (int32), n_seq_id (uint32), seq_id (int32).
CELL_META_BYTES = 12
#: ``io_magic`` of src/llama-context.cpp, first in a sequence's state (then the sequence id).
STATE_IO_MAGIC = 0xAF143CD8
_SIZE_LINE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\), "
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")
_BUFFER_LINE = re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size =\s*([\d.]+) MiB")

_lock = threading.Lock()
_log: list[str] = []
_errors: list[tuple[int, str]] = []  # (index in _log, text) of llama.cpp's error-level lines
GGML_LOG_LEVEL_ERROR = 4
_callback = None


def available() -> str | None:
    """None if llama-cpp-python imports, else why not (for the window and the CLI to say)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken build raises OSError, not ImportError
        return (f"llama-cpp-python is not installed ({type(exc).__name__}); install it with "
                "pip install 'llama-cpp-python==0.3.36' (builds llama.cpp from source, a few minutes)")
    return None


def _capture():
    global _callback
    import llama_cpp

    if _callback is None:
        @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        def callback(level, text, user):  # noqa: ARG001
            if text:
                line = text.decode("utf-8", "replace")
                if level == GGML_LOG_LEVEL_ERROR:
                    _errors.append((len(_log), line.strip()))
                _log.append(line)

        _callback = callback
        llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


@dataclass(frozen=True)
class LoggedCache:
    """One ``llama_kv_cache: size = ...`` line."""

    size_mib: float
    cells: int
    layers: int
    n_seq_max: int
    streams: int
    type_k: str
    k_mib: float
    type_v: str
    v_mib: float


def parse_log(text: str) -> tuple[list[LoggedCache], list[tuple[str, float]]]:
    caches = [LoggedCache(float(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6], float(m[7]), m[8], float(m[9]))
              for m in _SIZE_LINE.finditer(text)]
    buffers = [(m[1], float(m[2])) for m in _BUFFER_LINE.finditer(text)]
    return caches, buffers


_FA = {"on": "LLAMA_FLASH_ATTN_TYPE_ENABLED", "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED", "auto": "LLAMA_FLASH_ATTN_TYPE_AUTO"}


def _ggml_type(name: str) -> int:
    """ggml's type number (gguf's GGMLQuantizationType is the same enum; llama_cpp names only some of them)."""
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[name.upper()])


class LlamaCppContext:
    """A GGUF loaded into llama.cpp with ``options``: the model, one context, and what its load logged."""

    def __init__(self, path: str | Path, options: LlamaCppOptions | None = None, n_threads: int = 1):
        self.options = o = options or LlamaCppOptions()
        self.path = Path(path)
        llama_cpp = _capture()
        self._ll = llama_cpp
        with _lock:
            start = len(_log)
            mp = llama_cpp.llama_model_default_params()
            mp.n_gpu_layers = o.n_gpu_layers if o.n_gpu_layers >= 0 else 999
            self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mp)
            if not self.model:
                raise SettingsError(f"llama.cpp could not load {self.path.name}: {self._last_error(start)}")
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_seq_max, cp.kv_unified = o.n_ctx, o.n_seq_max, o.kv_unified
            cp.n_batch, cp.n_ubatch = o.n_batch, o.n_ubatch
            cp.type_k, cp.type_v = _ggml_type(o.type_k), _ggml_type(o.type_v)
            cp.flash_attn_type = getattr(llama_cpp, _FA[o.flash_attn])
            cp.swa_full, cp.offload_kqv = o.swa_full, o.offload_kqv
            cp.n_threads = cp.n_threads_batch = n_threads
            self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
            if not self.ctx:
                reason = self._last_error(start)
                llama_cpp.llama_model_free(self.model)
                self.model = None
                raise SettingsError(f"llama.cpp refused the context for {self.path.name}: {reason}")
            self.log = "".join(_log[start:])
        self.caches, self.buffers = parse_log(self.log)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    @staticmethod
    def _last_error(start: int) -> str:
        """llama.cpp's own reason: its last error-level line since ``start`` (without the function name)."""
        lines = [text for i, text in _errors if i >= start and text]
        if not lines:
            return "llama.cpp gave no reason"
        return lines[-1].split(": ", 1)[-1] if ": " in lines[-1] else lines[-1]

    @property
    def n_ctx(self) -> int:
        return int(self._ll.llama_n_ctx(self.ctx))

    def decode(self, tokens: list[int], pos: int, seq: int = 0) -> None:
        """Feed ``tokens`` at positions ``pos``... of sequence ``seq``; raise on llama.cpp's refusal."""
        ll = self._ll
        batch = ll.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            rc = ll.llama_decode(self.ctx, batch)
        finally:
            ll.llama_batch_free(batch)
        if rc != 0:
            raise SettingsError(f"llama.cpp could not decode ({'the context is full' if rc == 1 else f'code {rc}'})")

    def decode_all(self, tokens: list[int], pos: int, seq: int = 0) -> None:
        """Feed ``tokens`` from position ``pos`` in batches llama.cpp takes (at most n_batch tokens per call)."""
        step = max(1, min(self.options.n_batch, self.n_ctx))
        for start in range(0, len(tokens), step):
            self.decode(tokens[start:start + step], pos + start, seq)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """``text`` as the GGUF's tokenizer splits it (``llama_tokenize``; the BOS token first where the vocabulary
        adds one)."""
        ll = self._ll
        data = text.encode("utf-8", "replace")
        room = len(data) + 8
        buf = (ll.llama_token * room)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, room, add_special, False)
        if n < 0:  # too small: llama.cpp says how many it needs
            room = -n
            buf = (ll.llama_token * room)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, room, add_special, False)
        return list(buf[:max(0, n)])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (``llama_token_to_piece``; special tokens as nothing): a character may span two."""
        buf = ctypes.create_string_buffer(64)
        n = self._ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:max(0, n)]

    def measure_bytes_per_cell(self) -> int:
        """K + V bytes of one cell over every cache, from the state of sequence 0 one token apart (as ``observe``);
        the memory is cleared afterwards."""
        self.clear()
        self.decode([1], 0)
        one = self.state_size()
        self.decode([1], 1)
        two = self.state_size()
        self.clear()
        return two - one - CELL_META_BYTES * len(self.caches)

    def state_bytes(self, seq: int = 0) -> bytes:
        """``llama_state_seq_get_data``: sequence ``seq``'s saved state, as llama.cpp writes it."""
        size = self.state_size(seq)
        buf = (ctypes.c_uint8 * size)()
        n = int(self._ll.llama_state_seq_get_data(self.ctx, buf, size, seq))
        return bytes(buf[:n])

    def measure_cell_bytes(self) -> tuple[int, ...]:
        """Per cache, K + V bytes of one cell over its layers, read from llama.cpp's own state of a one-token
        sequence (``parse_cell_rows``); falls back to one total split by the log's sizes where the state holds
        what this reader does not know. The memory is cleared afterwards."""
        self.clear()
        self.decode([1], 0)
        state = self.state_bytes()
        self.clear()
        rows = parse_cell_rows(state, [c.v_mib > 0 for c in self.caches])
        if rows is not None and len(rows) == len(self.caches):
            return tuple(rows)
        total = self.measure_bytes_per_cell()
        shares = [round(c.size_mib * MIB / max(1, c.cells * c.streams)) for c in self.caches]
        return tuple([total - sum(shares[1:])] + shares[1:]) if len(self.caches) > 1 else (total,)

    def weights_bytes(self) -> int:
        """``llama_model_size``: the bytes of the model's tensors as llama.cpp loaded them."""
        return int(self._ll.llama_model_size(self.model))

    def used_cells(self, seq: int = 0) -> int:
        return int(self._ll.llama_memory_seq_pos_max(self.memory, seq)) + 1

    def state_size(self, seq: int = 0) -> int:
        return int(self._ll.llama_state_seq_get_size(self.ctx, seq))

    def clear(self) -> None:
        self._ll.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self._ll.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Sampler:
    """llama.cpp's sampler chain: ``top_k`` then a seeded draw (``llama_sampler_init_dist``), or greedy with
    ``top_k=0``. Independent of any context, so a context reloaded mid-run keeps the same random stream."""

    def __init__(self, top_k: int = 40, seed: int = 0) -> None:
        ll = _capture()
        self._ll = ll
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if top_k > 0:
            ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_top_k(top_k))
            # uint32 seeds; 0xFFFFFFFF (LLAMA_DEFAULT_SEED) would mean "random", so it never reaches llama.cpp
            ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_dist(int(seed) % 0xFFFFFFFF))
        else:
            ll.llama_sampler_chain_add(self.chain, ll.llama_sampler_init_greedy())

    def sample(self, ctx: LlamaCppContext) -> int:
        """The next token from the last decoded position's logits (the chain accepts it)."""
        return int(self._ll.llama_sampler_sample(self.chain, ctx.ctx, -1))

    def close(self) -> None:
        if getattr(self, "chain", None):
            self._ll.llama_sampler_free(self.chain)
            self.chain = None


def parse_cell_rows(state: bytes, has_v: list[bool]) -> list[int] | None:
    """The bytes of one cell in each cache, from a one-sequence state (``llama_context::state_seq_get_data``:
    a magic number and the sequence id, then ``llama_kv_cache::state_write`` per cache: the streams, each stream's cell count, 12 bytes of metadata per cell, then per layer the K type and
    row size and the rows, then the V rows, or with V transposed the element size and width). ``has_v`` says,
    per cache, whether it stores V (MLA caches K only). Without flash attention a cache whose layers' V widths
    differ allocates every V row at the widest (``n_embd_v_gqa_max``): so do the rows returned. None when the
    bytes do not parse exactly (a layout this reader does not know, such as M-RoPE's cell extension)."""
    import struct

    at, rows, v_widths = 0, [], []

    def take(fmt: str):
        nonlocal at
        values = struct.unpack_from("<" + fmt, state, at)
        at += struct.calcsize("<" + fmt)
        return values

    try:
        magic, _seq = take("Ii")  # llama_context::state_seq_get_data: io_magic, then the sequence id
        if magic != STATE_IO_MAGIC:
            return None
        for v_present in has_v:
            (n_stream,) = take("I")
            row = None
            for _ in range(n_stream):
                (cells,) = take("I")
                if cells == 0:
                    continue
                for _ in range(cells):
                    _pos, n_seq = take("iI")
                    at += 4 * n_seq
                v_trans, n_layer = take("II")
                k_rows, v_rows = [], []
                for _ in range(n_layer):
                    _type, k_row = take("iQ")
                    at += k_row * cells
                    k_rows.append(k_row)
                for _ in range(n_layer if v_present else 0):
                    if v_trans:
                        _type, el, width = take("iII")
                        at += el * width * cells
                        v_rows.append((el, width))
                    else:
                        _type, v_row = take("iQ")
                        at += v_row * cells
                        v_rows.append((1, v_row))
                row = (k_rows, v_rows, bool(v_trans))
            if row is None:
                return None
            rows.append(row)
            v_widths += [w for _, w in row[1]] if row[2] else []
    except (struct.error, OverflowError):
        return None
    if at != len(state):
        return None
    widest = max(v_widths, default=0)
    return [sum(k) + sum(el * (widest if trans else w) for el, w in v) for k, v, trans in rows]


@dataclass(frozen=True)
class Observed:
    """What llama.cpp allocated, from its own figures."""

    caches: tuple[LoggedCache, ...]
    bytes_per_cell: int  # K + V of one cell over every cache (state growth per token, metadata removed)
    buffers: tuple[tuple[str, float], ...]
    cell_bytes: tuple[int, ...] = ()  # per cache, from llama.cpp's own state bytes (parse_cell_rows)

    @property
    def cells(self) -> tuple[int, ...]:
        return tuple(c.cells for c in self.caches)


def observe(path: str | Path, options: LlamaCppOptions | None = None) -> Observed:
    """Load ``path`` into llama.cpp, read its KV log lines, and measure the bytes per cell from two tokens."""
    with LlamaCppContext(path, options) as ctx:
        return Observed(tuple(ctx.caches), ctx.measure_bytes_per_cell(), tuple(ctx.buffers), ctx.measure_cell_bytes())

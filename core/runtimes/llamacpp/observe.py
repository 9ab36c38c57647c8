"""What the real llama.cpp allocated for a context's compute and output buffers, read back from llama.cpp itself.

Two sources, both llama.cpp's own (the llama.cpp that llama-cpp-python 0.3.36 vendors):

- its log at context creation: ``sched_reserve: CPU compute buffer size = X MiB`` and ``llama_context: CPU
  output buffer size = X MiB`` (2 decimals: 0.01 MiB);
- exact bytes: ``llama_get_memory_breakdown(ctx)`` (``src/llama-ext.h``; ``llama_context::memory_breakdown``:
  per buffer type, ``ggml_backend_sched_get_buffer_size`` of the scheduler for ``compute``). It is a C++ function
  returning a ``std::map<ggml_backend_buffer_type_t, llama_memory_breakdown_data>``, exported by libllama under
  its mangled name; called here through ctypes with the Itanium C++ ABI (the map is returned through a hidden
  pointer) and the map read in libstdc++'s red-black tree layout. The map's few nodes are not freed (no
  destructor is exported): a few hundred bytes per call, in tests and tools only.

The output buffer has no exact reader; its size is n_vocab x n_seq_max x 4 by ``output_reserve``, which the log's
MiB figure confirms to its rounding.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from kvscope.core.prediction.llamacpp import LlamaCppOptions
from kvscope.core.runtimes.llamacpp.live import LlamaCppContext

_COMPUTE_LINE = re.compile(r"(\S+) compute buffer size =\s*([\d.]+) MiB")
_OUTPUT_LINE = re.compile(r"(\S+)\s+output buffer size =\s*([\d.]+) MiB")
BREAKDOWN_SYMBOL = "_Z26llama_get_memory_breakdownPK13llama_context"


@dataclass(frozen=True)
class ObservedBuffers:
    compute_bytes: int | None  # exact, from llama_get_memory_breakdown (None: the symbol is not there)
    compute_mib: float  # the log's figure
    output_mib: float
    model_bytes: int | None
    context_bytes: int | None


def _lib():
    import llama_cpp.llama_cpp as ll

    return getattr(ll, "_lib", None)


def memory_breakdown(ctx) -> list[tuple[int, int, int]] | None:
    """(model, context, compute) bytes per buffer type of a live ``llama_context *``; None if not exported."""
    lib = _lib()
    fn = getattr(lib, BREAKDOWN_SYMBOL, None) if lib is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    out = (ctypes.c_uint8 * 64)()  # std::map: key compare (8, padded) + header node (32) + node count (8)
    base = ctypes.addressof(out)
    fn(base, ctypes.cast(ctx, ctypes.c_void_p).value)
    header = base + 8  # _Rb_tree_node_base: color (int, padded), parent (the root), left, right
    root = ctypes.c_void_p.from_address(header + 8).value
    count = ctypes.c_size_t.from_address(header + 32).value
    rows = []
    stack = [root] if root else []
    while stack:
        node = stack.pop()
        left = ctypes.c_void_p.from_address(node + 16).value
        right = ctypes.c_void_p.from_address(node + 24).value
        # the value after the 32-byte node base: key (a pointer), then model, context, compute (size_t each)
        model, context, compute = (ctypes.c_size_t.from_address(node + 40 + 8 * i).value for i in range(3))
        rows.append((model, context, compute))
        stack += [n for n in (left, right) if n]
    if len(rows) != count:
        raise RuntimeError(f"llama_get_memory_breakdown: read {len(rows)} entries, the map holds {count}")
    return rows


def observe_buffers(path: str | Path, options: LlamaCppOptions) -> ObservedBuffers:
    """Load ``path`` into llama.cpp with ``options`` and read back its compute and output buffers."""
    with LlamaCppContext(path, options) as ctx:
        rows = memory_breakdown(ctx.ctx)
        log = ctx.log
    compute_mib = sum(float(m[2]) for m in _COMPUTE_LINE.finditer(log))
    output_mib = sum(float(m[2]) for m in _OUTPUT_LINE.finditer(log))
    if rows is None:
        return ObservedBuffers(None, compute_mib, output_mib, None, None)
    return ObservedBuffers(sum(r[2] for r in rows), compute_mib, output_mib, sum(r[0] for r in rows),
                           sum(r[1] for r in rows))

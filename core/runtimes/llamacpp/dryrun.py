"""llama.cpp's own dry run: a GGUF loaded with ``no_alloc`` in a child process, a context created per setting, and
llama.cpp's memory breakdown read back per buffer type (model, KV, compute), without reading the weights.

``llama_model_params.no_alloc`` ("only load metadata and simulate memory allocations", llama-cpp-python 0.3.36)
sizes every buffer as a real load would and allocates none of the big ones. Checked against real allocations
(tests/test_llamacpp_dryrun.py; docs/llamacpp.md has the table): the model buffers per type, the KV cache and the
compute buffer are the same bytes. Two limits of this llama.cpp, both worked around here:

- ``no_alloc`` with the file memory-mapped (llama.cpp's default load mode) ends in ``GGML_ASSERT(!ml.no_alloc)``
  (src/llama-model.cpp, the mmap branch of ``load_tensors``): the dry run loads without mmap
  (``LLAMA_LOAD_MODE_NONE``), so the default CPU buffer is reported as ``CPU`` (its tensors, each padded to
  the buffer's alignment) where a mapped load says ``CPU_Mapped`` (the file's range that holds them). The other
  buffer types (``CPU_REPACK``, a GPU's) are the same in both modes.
- the output buffer is not in the breakdown: its figure is the log's (``output buffer size = X MiB``, 0.01 MiB).

The breakdown is ``llama_get_memory_breakdown`` (a C++ ``std::map``, read as ``observe.memory_breakdown`` reads it)
with each key's name and host flag from ggml (``ggml_backend_buft_name``, ``ggml_backend_buft_is_host``).

llama.cpp aborts on files it cannot take (``GGML_ASSERT`` -> SIGABRT), so the dry run runs in a child
(``python -m kvscope.core.runtimes.llamacpp.dryrun``): a request on its stdin, one JSON line back, a timeout, an
address-space limit, and any failure said in one line (``DryRunError``). This module imports neither llama_cpp nor
anything heavy on the asking side; only the child imports llama_cpp.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.core.base.errors import UNAVAILABLE, KVScopeError
from kvscope.core.base.safe_text import safe_text
from kvscope.core.prediction.llamacpp import LlamaCppOptions

#: How long one dry run (a load and every context asked) may take before the child is killed (seconds).
TIMEOUT_S = 120.0
#: The child's address space (RLIMIT_AS): a hostile header that makes llama.cpp allocate without bound fails in
#: the child with bad_alloc instead of taking the machine's memory.
ADDRESS_SPACE_BYTES = 16 << 30
#: The child's answer is the one stdout line that starts with this.
MARK = "KVSCOPE-DRYRUN "
MIB = 1024 * 1024


class DryRunError(KVScopeError, RuntimeError):
    """llama.cpp's dry run gave no answer (not installed, the file refused, an abort, a timeout): one line."""

    category = UNAVAILABLE


@dataclass(frozen=True)
class DryRunContext:
    """One context as llama.cpp sized it under ``no_alloc``."""

    n_ctx: int  # llama_n_ctx: after llama.cpp's padding
    kv: dict[str, int]  # KV cache bytes per buffer type
    compute: dict[str, int]  # compute buffer bytes per buffer type (sched_reserve)
    output_mib: float | None  # the log's output buffer (0.01 MiB); None: not logged
    model: dict[str, int] = dataclasses.field(default_factory=dict)  # model buffer bytes per type (this -ngl)
    error: str = ""  # llama.cpp refused this context (then the figures are empty)

    @property
    def kv_bytes(self) -> int:
        return sum(self.kv.values())

    @property
    def compute_bytes(self) -> int:
        return sum(self.compute.values())


@dataclass(frozen=True)
class DryRun:
    """llama.cpp's own figures for one GGUF: its model buffers (loaded without mmap) and one entry per context."""

    file: str
    model: dict[str, int]  # model buffer bytes per buffer type (CPU, CPU_REPACK, CUDA0...)
    host: dict[str, bool]  # per buffer type: host memory (ggml_backend_buft_is_host)
    model_size: int  # llama_model_size: the bytes of the model's tensors
    n_vocab: int
    contexts: tuple[DryRunContext, ...]
    version: str = ""  # llama_cpp.__version__ of the child
    mode: str = "no_alloc, no mmap"  # or "allocated, mmap" (``dry_run(allocate=True)``: a real load)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "llama_cpp_python": self.version, "load_mode": self.mode,
                "model_buffers_bytes": dict(self.model), "host_buffer_types": sorted(k for k, v in self.host.items() if v),
                "model_size_bytes": self.model_size, "n_vocab": self.n_vocab,
                "contexts": [{"n_ctx": c.n_ctx, "model_buffers_bytes": c.model, "kv_bytes": c.kv, "compute_bytes": c.compute,
                              "output_mib_logged": c.output_mib, **({"error": c.error} if c.error else {})}
                             for c in self.contexts]}


def available() -> str | None:
    """None when llama-cpp-python is installed (found without importing it), else why not."""
    from kvscope.core.runtimes.llamacpp.switches import llamacpp_missing

    return llamacpp_missing()


def _options_json(o: LlamaCppOptions) -> dict[str, Any]:
    return dataclasses.asdict(o)


def dry_run(path: str | Path, options: list[LlamaCppOptions], timeout_s: float = TIMEOUT_S,
            allocate: bool = False) -> DryRun:
    """llama.cpp's dry run of ``path`` for each of ``options`` (one load per distinct -ngl, one context each), in a
    child process; ``DryRunError`` in one line when it gives no answer. ``allocate``: a real load instead, with
    llama.cpp's default load mode (mmap), every buffer allocated and the weights read: what the dry run is checked
    against (tests), never what ``calc`` asks."""
    path = Path(path)
    why = available()
    if why:
        raise DryRunError(f"llama.cpp's dry run is not available: {why}")
    if not path.is_file():
        raise DryRunError(f"llama.cpp's dry run needs a local .gguf file, and {safe_text(str(path))} is not one")
    request = json.dumps({"path": str(path.resolve()), "options": [_options_json(o) for o in options],
                          "allocate": bool(allocate)})
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # an abort's backtrace through gdb: seconds, and pages of it
    try:
        done = subprocess.run([sys.executable, "-m", "kvscope.core.runtimes.llamacpp.dryrun"], input=request,
                              capture_output=True, text=True, timeout=timeout_s, env=env,
                              errors="replace")
    except subprocess.TimeoutExpired:
        raise DryRunError(safe_text(f"llama.cpp's dry run of {path.name} gave no answer within {timeout_s:g} s "
                                    "(stopped)")) from None
    except OSError as exc:
        raise DryRunError(f"llama.cpp's dry run could not start: {exc}") from None
    answer = next((line[len(MARK):] for line in reversed(done.stdout.splitlines()) if line.startswith(MARK)), None)
    if answer is None:
        said = _last_words(done.stderr)
        how = _signal_name(done.returncode)
        raise DryRunError(safe_text(f"llama.cpp's dry run of {path.name} ended with {how}" + (f": {said}" if said else ""),
                                    limit=400))
    reply = json.loads(answer)
    if "error" in reply:
        # llama.cpp's own words can quote the file (a key, a name): shown escaped, on one line
        raise DryRunError(safe_text(f"llama.cpp's dry run of {path.name}: {reply['error']}", limit=400))
    return DryRun(file=path.name, model=reply["model"], host=reply["host"], model_size=reply["model_size"],
                  n_vocab=reply["n_vocab"], version=reply.get("version", ""),
                  mode="allocated, mmap" if allocate else "no_alloc, no mmap",
                  contexts=tuple(DryRunContext(c["n_ctx"], c["kv"], c["compute"], c["output_mib"], c.get("model", {}),
                                               c.get("error", "")) for c in reply["contexts"]))


def _signal_name(code: int) -> str:
    import signal

    if code >= 0:
        return f"exit status {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _last_words(stderr: str) -> str:
    """llama.cpp's assertion (or last error line) from the child's stderr, from the source file's name on."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    for words in (("GGML_ASSERT", "GGML_ABORT"), ("error", "Error", "failed", "terminate")):
        for line in reversed(lines):
            if any(word in line for word in words) and not line.startswith("#"):
                line = line[line.rfind("/", 0, line.find(": ")) + 1:] if ": " in line else line
                return safe_text(" ".join(line.split())[:200])
    return ""


# ---------------------------------------------------------------------------------------------------- the child


def _breakdown(lib, base, ctx) -> dict[str, tuple[int, int, int, bool]]:
    """{buffer type name: (model, context, compute, is_host)} of a live ``llama_context *``: the std::map that
    ``llama_get_memory_breakdown`` returns, read as ``kvscope.core.runtimes.llamacpp.observe.memory_breakdown``
    reads it, with each key (a ``ggml_backend_buffer_type_t``) named by ggml."""
    import ctypes

    from kvscope.core.runtimes.llamacpp.observe import BREAKDOWN_SYMBOL

    fn = getattr(lib, BREAKDOWN_SYMBOL, None)
    if fn is None:
        raise RuntimeError(f"this libllama does not export {BREAKDOWN_SYMBOL} (the memory breakdown)")
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    out = (ctypes.c_uint8 * 64)()
    at = ctypes.addressof(out)
    fn(at, ctypes.cast(ctx, ctypes.c_void_p).value)
    header = at + 8
    root = ctypes.c_void_p.from_address(header + 8).value
    count = ctypes.c_size_t.from_address(header + 32).value
    rows: dict[str, tuple[int, int, int, bool]] = {}
    stack, seen = ([root] if root else []), 0
    while stack:
        node = stack.pop()
        seen += 1
        left = ctypes.c_void_p.from_address(node + 16).value
        right = ctypes.c_void_p.from_address(node + 24).value
        key = ctypes.c_void_p.from_address(node + 32).value
        model, context, compute = (ctypes.c_size_t.from_address(node + 40 + 8 * i).value for i in range(3))
        name = (base.ggml_backend_buft_name(key) or b"?").decode("utf-8", "replace")
        old = rows.get(name, (0, 0, 0, False))
        rows[name] = (old[0] + model, old[1] + context, old[2] + compute, bool(base.ggml_backend_buft_is_host(key)))
        stack += [n for n in (left, right) if n]
    if seen != count:
        raise RuntimeError(f"llama_get_memory_breakdown: read {seen} entries, the map holds {count}")
    return rows


def _ggml_base(lib):
    """libggml-base, beside libllama (already loaded by it: the same handle), with the two functions typed."""
    import ctypes

    here = Path(lib._name).parent  # noqa: SLF001
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll", "libggml.so", "libggml.dylib"):
        if (here / name).exists():
            found = ctypes.CDLL(str(here / name))
            if hasattr(found, "ggml_backend_buft_name"):
                lib = found
                break
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_is_host.restype = ctypes.c_bool
    lib.ggml_backend_buft_is_host.argtypes = [ctypes.c_void_p]
    return lib  # else libllama itself: a static build exports ggml from it


def _child(request: dict[str, Any]) -> dict[str, Any]:
    """Load once per -ngl with no_alloc and no mmap, create each context, read the breakdown; free everything."""
    import re

    from kvscope.core.runtimes.llamacpp import live

    ll = live._capture()  # noqa: SLF001 - the process-wide log capture, as every load of llama.cpp uses
    import llama_cpp
    import llama_cpp.llama_cpp as low

    lib = low._lib  # noqa: SLF001 - the one libllama llama_cpp loaded
    base = _ggml_base(lib)
    options = [LlamaCppOptions(**o) for o in request["options"]]
    path = request["path"].encode()
    out: dict[str, Any] = {"version": getattr(llama_cpp, "__version__", ""), "contexts": [None] * len(options)}
    by_ngl: dict[int, list[int]] = {}
    for i, o in enumerate(options):
        by_ngl.setdefault(o.n_gpu_layers, []).append(i)
    output_line = re.compile(r"(\S+)\s+output buffer size =\s*([\d.]+) MiB")
    for ngl, indices in by_ngl.items():
        start = len(live._log)  # noqa: SLF001
        mp = ll.llama_model_default_params()
        if not request.get("allocate"):
            mp.no_alloc = True
            mp.load_mode = ll.LLAMA_LOAD_MODE_NONE  # no_alloc with mmap: GGML_ASSERT(!ml.no_alloc) in load_tensors
        mp.n_gpu_layers = ngl if ngl >= 0 else 999
        model = ll.llama_model_load_from_file(path, mp)
        if not model:
            return {"error": f"llama.cpp could not load it: {_reason(live, start)}"}
        try:
            out["model_size"] = int(ll.llama_model_size(model))
            out["n_vocab"] = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model)))
            for i in indices:
                o = options[i]
                start = len(live._log)  # noqa: SLF001
                cp = ll.llama_context_default_params()
                cp.n_ctx, cp.n_seq_max, cp.kv_unified = o.n_ctx, o.n_seq_max, o.kv_unified
                cp.n_batch, cp.n_ubatch = o.n_batch, o.n_ubatch
                cp.type_k, cp.type_v = live._ggml_type(o.type_k), live._ggml_type(o.type_v)  # noqa: SLF001
                cp.flash_attn_type = getattr(ll, live._FA[o.flash_attn])  # noqa: SLF001
                cp.swa_full, cp.offload_kqv = o.swa_full, o.offload_kqv
                cp.n_threads = cp.n_threads_batch = 1
                ctx = ll.llama_init_from_model(model, cp)
                if not ctx:
                    out["contexts"][i] = {"n_ctx": 0, "kv": {}, "compute": {}, "output_mib": None,
                                          "error": f"llama.cpp refused the context: {_reason(live, start)}"}
                    continue
                try:
                    rows = _breakdown(lib, base, ctx)
                    n_ctx = int(ll.llama_n_ctx(ctx))
                finally:
                    ll.llama_free(ctx)
                log = "".join(live._log[start:])  # noqa: SLF001
                outputs = [float(m[2]) for m in output_line.finditer(log)]
                out["model"] = {k: v[0] for k, v in rows.items() if v[0]}
                out["host"] = {k: v[3] for k, v in rows.items()}
                out["contexts"][i] = {"n_ctx": n_ctx, "kv": {k: v[1] for k, v in rows.items() if v[1]},
                                      "compute": {k: v[2] for k, v in rows.items() if v[2]},
                                      "output_mib": sum(outputs) if outputs else None, "model": out["model"]}
        finally:
            ll.llama_model_free(model)
    out.setdefault("model", {})
    out.setdefault("host", {})
    return out


def _reason(live, start: int) -> str:
    """llama.cpp's reason among its error lines since ``start``: the loader's own ("error loading model: missing
    tensor ...") before its summary ("failed to load model"), else the last one."""
    lines = [text for i, text in live._errors if i >= start and text]  # noqa: SLF001
    for line in lines:
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip()
    return live.LlamaCppContext._last_error(start)  # noqa: SLF001


def _limit_memory() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = ADDRESS_SPACE_BYTES if hard == resource.RLIM_INFINITY else min(ADDRESS_SPACE_BYTES, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass  # not on this platform: the timeout still bounds the child


def main() -> int:
    """The child: a JSON request on stdin, one ``MARK`` line of JSON on stdout."""
    _limit_memory()
    try:
        reply = _child(json.loads(sys.stdin.read()))
    except Exception as exc:  # noqa: BLE001 - said to the parent in one line
        reply = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    sys.stdout.write(MARK + json.dumps(reply) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

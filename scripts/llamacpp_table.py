"""Print KV Scope's llama.cpp prediction beside what the real llama.cpp allocates, for tiny GGUFs of three layouts.

    .venv/bin/python scripts/llamacpp_table.py [--markdown]

The same comparison tests/test_llamacpp.py asserts, as a table for a reader (and the issue's note).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvscope.core.model.gguf import read_gguf  # noqa: E402
from kvscope.core.prediction.llamacpp import LLAMA_CPP_VERSION, LlamaCppOptions, plan  # noqa: E402
from kvscope.core.runtimes.llamacpp.live import observe  # noqa: E402
from tests import gguf_models  # noqa: E402

SETTINGS = [
    LlamaCppOptions(n_ctx=4096),
    LlamaCppOptions(n_ctx=4096, type_k="q8_0", type_v="q8_0", flash_attn="on"),
    LlamaCppOptions(n_ctx=1000, type_k="q4_0", type_v="q4_0", flash_attn="on"),
    LlamaCppOptions(n_ctx=4096, flash_attn="off"),
    LlamaCppOptions(n_ctx=4096, n_seq_max=3),
    LlamaCppOptions(n_ctx=4096, n_seq_max=3, kv_unified=True),
    LlamaCppOptions(n_ctx=4096, swa_full=True),
]


def describe(o: LlamaCppOptions) -> str:
    return (f"-c {o.n_ctx} -ctk {o.type_k} -ctv {o.type_v} -fa {o.flash_attn}"
            + (f" -np {o.n_seq_max}" if o.n_seq_max > 1 else "") + (" --kv-unified" if o.kv_unified else "")
            + (" --swa-full" if o.swa_full else ""))


def main() -> int:
    md = "--markdown" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        from kvscope.core.model.gguf_write import embedded_gguf

        models = {"embedded demo model (MHA, 4 layers)": embedded_gguf(),
                  "llama (GQA 4:2)": gguf_models.llama(root / "l.gguf"),
                  "gemma3 (window 128, 6 of 7 layers)": gguf_models.gemma3(root / "g.gguf"),
                  "deepseek2 (MLA, rank 64 + rope 32)": gguf_models.deepseek2(root / "d.gguf")}
        rows = [("model", "settings", "predicted cells", "llama.cpp cells", "predicted B/cell", "llama.cpp B/cell",
                 "predicted bytes", "llama.cpp MiB (log)", "equal")]
        for name, path in models.items():
            g = read_gguf(path)
            for o in SETTINGS:
                p = plan(g, o)
                seen = observe(path, o)
                cells_p = " + ".join(f"{b.cells}x{b.streams}" for b in p.buffers)
                cells_o = " + ".join(f"{c.cells}x{c.streams}" for c in seen.caches)
                per_p = sum(b.row_bytes for b in p.buffers)
                logged = " + ".join(f"{c.size_mib:.2f}" for c in seen.caches)
                same = cells_p == cells_o and per_p == seen.bytes_per_cell and all(
                    f"{b.total / 2**20:.2f}" == f"{c.size_mib:.2f}" for b, c in zip(p.buffers, seen.caches))
                rows.append((name, describe(o), cells_p, cells_o, f"{per_p:,}", f"{seen.bytes_per_cell:,}",
                             f"{p.kv_bytes:,}", logged, "yes" if same else "NO"))
    print(f"KV Scope vs {LLAMA_CPP_VERSION}")
    if md:
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for r in rows[1:]:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)))
    return 0 if all(r[-1] == "yes" for r in rows[1:]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Print a Markdown table: tiny GGUF x llama.cpp settings x KV Scope's predicted compute and output buffers x what the
real llama.cpp (llama-cpp-python 0.3.36) reserved and logged, with the worst difference.

    .venv/bin/python scripts/llamacpp_buffers_table.py            # the table (about 20 s on 2 cores)

Exact bytes come from llama.cpp's own llama_get_memory_breakdown (core/runtimes/llamacpp/observe.py); the MiB columns are its
log lines ("CPU compute buffer size", "CPU output buffer size"). The files are written to a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvscope.core.model.attention import SettingsError  # noqa: E402
from kvscope.core.model.gguf import read_gguf  # noqa: E402
from kvscope.core.model.gguf_write import embedded_gguf  # noqa: E402
from kvscope.core.prediction.llamacpp import LlamaCppOptions, plan  # noqa: E402
from kvscope.core.runtimes.llamacpp.observe import observe_buffers  # noqa: E402
from tests import gguf_models  # noqa: E402

SETTINGS = [
    ("-c 4096 -fa off", LlamaCppOptions(n_ctx=4096, flash_attn="off")),
    ("-c 4096 -fa on", LlamaCppOptions(n_ctx=4096, flash_attn="on")),
    ("-c 2000 -np 3 -fa off", LlamaCppOptions(n_ctx=2000, n_seq_max=3, flash_attn="off")),
    ("-c 2000 -np 3 --kv-unified -fa on", LlamaCppOptions(n_ctx=2000, n_seq_max=3, kv_unified=True, flash_attn="on")),
    ("-c 1000 -ctk q8_0 -ctv q8_0 -fa on", LlamaCppOptions(n_ctx=1000, type_k="q8_0", type_v="q8_0", flash_attn="on")),
    ("-c 2000 -b 300 -ub 100 -ctk f32 -ctv bf16 -fa off",
     LlamaCppOptions(n_ctx=2000, n_batch=300, n_ubatch=100, type_k="f32", type_v="bf16", flash_attn="off")),
    ("-c 1000 --swa-full -fa off", LlamaCppOptions(n_ctx=1000, swa_full=True, flash_attn="off")),
]


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="kvscope-buffers-"))
    models = {
        "embedded (llama, 4 layers)": embedded_gguf(),
        "llama GQA": gguf_models.llama(root / "llama.gguf"),
        "llama MHA untied, 3 layers": gguf_models.llama(root / "mha.gguf", n_head_kv=4, tied=False, n_layer=3),
        "gemma3 (5 window : 1 full)": gguf_models.gemma3(root / "gemma3.gguf"),
        "deepseek2 MLA": gguf_models.deepseek2(root / "ds.gguf"),
    }
    vocab, gguf_models.VOCAB = gguf_models.VOCAB, 60_000  # a vocabulary whose logits the log's 0.01 MiB shows
    try:
        models["llama, 1 layer, vocab 60,000"] = gguf_models.llama(root / "bigvocab.gguf", n_layer=1)
    finally:
        gguf_models.VOCAB = vocab
    print("| model | settings | predicted compute | llama.cpp compute (exact) | logged | predicted output | logged |")
    print("|---|---|---:|---:|---:|---:|---:|")
    worst = loads = 0
    for name, path in models.items():
        g = read_gguf(path)
        for label, options in SETTINGS:
            try:
                p = plan(g, options)
            except SettingsError as why:  # e.g. MLA takes one cache type for K and V: llama.cpp refuses it too
                refused = "refuses it too"
                try:
                    observe_buffers(path, options)
                    refused = "LOADED IT"
                except SettingsError:
                    pass
                print(f"| {name} | `{label}` | refused: {why} | llama.cpp {refused} | | | |")
                continue
            loads += 1
            seen = observe_buffers(path, options)
            worst = max(worst, abs(p.compute_bytes - seen.compute_bytes))
            print(f"| {name} | `{label}` | {p.compute_bytes:,} B | {seen.compute_bytes:,} B | {seen.compute_mib:.2f} MiB "
                  f"| {p.output_bytes:,} B | {seen.output_mib:.2f} MiB |")
    print(f"\nworst compute-buffer difference: {worst:,} B over {loads} loads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

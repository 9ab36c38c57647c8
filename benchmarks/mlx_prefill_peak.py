"""MLX's prefill peak on the CPU, measured (``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``, less what was
active before) against ``kvscope.core.runtimes.mlx.predict.prefill_peak``, for prompts of 1 to 2,100 tokens of the embedded
model fed as ``mlx_lm.generate_step`` feeds them. Prints one row per prompt: observed, predicted, error.

    .venv/bin/python benchmarks/mlx_prefill_peak.py [1,16,256,2000]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = (1, 16, 64, 128, 255, 256, 257, 512, 1000, 2000, 2100)


def main() -> int:
    from kvscope.core.model.embedded import embedded_model_dir
    from kvscope.core.runtimes.mlx.engine import MlxEngine

    prompts = [int(p) for p in sys.argv[1].split(",")] if len(sys.argv) > 1 else PROMPTS
    folder = embedded_model_dir()
    print(f"{'prompt':>7} {'observed B':>14} {'predicted B':>14} {'error':>8}")
    for n in prompts:
        engine = MlxEngine(folder, "kv")
        try:
            ids = [(i * 7) % 1000 + 3 for i in range(n)]
            first = engine.prefill(engine.tokenizer.decode(ids))  # the text of n tokens, re-encoded
            obs, pred = first.peak_bytes_observed, first.peak_bytes_predicted
            print(f"{first.context_tokens:>7,} {obs:>14,} {pred:>14,} {100 * (pred - obs) / obs:>+7.1f}%")
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The prefill peak, predicted (core.predict.prefill_peak) and measured (core.peak, the CPU allocator's events
through the PyTorch profiler), as a Markdown table: tiny random-weight models of several architectures
(tests/archs.py, built offline) x prompt lengths x eager/sdpa x fp32/bf16.

    .venv/bin/python scripts/prefill_peak_table.py [--lengths 16,190,1322] [--types llama,phi]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import archs  # noqa: E402
from tests.test_prefill_peak import EXACT, _measure  # noqa: E402


def main() -> int:
    import torch

    from core.peak import matmul_scratch
    from core.predict import prefill_peak
    from core.settings import RunSettings
    from core.spec import spec_from_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="16,190,740,1322")
    parser.add_argument("--types", default=",".join(EXACT))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    print("| architecture | tokens | kernel | dtype | predicted (B) | measured (B) | error | peak at |")
    print("|---|---:|---|---|---:|---:|---:|---|")
    worst = (0.0, "")
    for model_type in args.types.split(","):
        base = archs.build_tiny_model(model_type)
        base.eval()
        for dtype in args.dtypes.split(","):
            model = base.to(getattr(torch, dtype))
            spec = spec_from_config(model.config.to_dict(), model_type)
            for impl in ("eager", "sdpa"):
                for n in lengths:
                    try:
                        measured = _measure(model, n, impl)
                    except ValueError as e:  # a kernel transformers refuses for this model (Gemma 2: no sdpa)
                        print(f"| {model_type} | {n:,} | {impl} | {dtype} | | | refused: {str(e)[:60]} | |")
                        break
                    predicted = prefill_peak(spec, RunSettings(weight_dtype=dtype, attn_impl=impl), n,
                                             cpu_threads=torch.get_num_threads(),
                                             matmul_scratch=matmul_scratch(getattr(torch, dtype)))
                    error = (predicted.peak - measured.peak) / measured.peak
                    row = f"{model_type} {impl} {dtype} {n}"
                    if abs(error) > abs(worst[0]):
                        worst = (error, row)
                    print(f"| {model_type} | {n:,} | {impl} | {dtype} | {predicted.peak:,} | {measured.peak:,} | "
                          f"{error:+.2%} | {predicted.where} |", flush=True)
    print(f"\nworst: {worst[1]} {worst[0]:+.2%} ({torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

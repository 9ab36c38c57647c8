"""The prefill and decode-step peaks, predicted (kvscope.core.prediction.predict.prefill_peak / decode_peak) and measured (kvscope.core.runtimes.transformers.peak, the
CPU allocator's events through the PyTorch profiler), as a Markdown table: tiny random-weight models of several
architectures (tests/archs.py, built offline) x prompt lengths x eager/sdpa x fp32/bf16; for each length a prefill
of that many tokens and one decode step on a cache of that many.

    .venv/bin/python scripts/prefill_peak_table.py [--lengths 16,190,1322] [--types llama,phi] [--no-decode]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import archs  # noqa: E402
from tests.test_prefill_peak import EXACT, _measure, _measure_step  # noqa: E402


def main() -> int:
    import torch

    from kvscope.core.model.hf_config import spec_from_config
    from kvscope.core.model.settings import RunSettings
    from kvscope.core.prediction.predict import decode_peak, prefill_peak
    from kvscope.core.runtimes.transformers.peak import matmul_scratch

    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="16,190,740,1322")
    parser.add_argument("--types", default=",".join(EXACT))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-decode", action="store_true")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    print("| architecture | pass | tokens | kernel | dtype | predicted (B) | measured (B) | error | peak at |")
    print("|---|---|---:|---|---|---:|---:|---:|---|")
    worst = (0.0, "")
    rows = 0
    for model_type in args.types.split(","):
        base = archs.build_tiny_model(model_type)
        base.eval()
        for dtype in args.dtypes.split(","):
            model = base.to(getattr(torch, dtype))
            spec = spec_from_config(model.config.to_dict(), model_type)
            scratch = matmul_scratch(getattr(torch, dtype))
            for impl in ("eager", "sdpa"):
                settings = RunSettings(weight_dtype=dtype, attn_impl=impl)
                for n in lengths:
                    passes = [("prefill", lambda: _measure(model, n, impl),
                               lambda: prefill_peak(spec, settings, n, cpu_threads=torch.get_num_threads(),
                                                    matmul_scratch=scratch))]
                    if not args.no_decode:
                        passes.append(("decode", lambda: _measure_step(model, n, impl),
                                       lambda: decode_peak(spec, settings, n, cpu_threads=torch.get_num_threads(),
                                                           matmul_scratch=scratch)))
                    for name, measure, predict in passes:
                        try:
                            measured = measure()
                        except ValueError as e:  # a kernel transformers refuses for this model (Gemma 2: no sdpa)
                            print(f"| {model_type} | {name} | {n:,} | {impl} | {dtype} | | | refused: {str(e)[:50]} | |")
                            break
                        if measured is None:
                            print(f"| {model_type} | {name} | {n:,} | {impl} | {dtype} | | | not measured: "
                                  "sliding-window cache | |")
                            continue
                        predicted = predict()
                        error = (predicted.peak - measured.peak) / measured.peak
                        rows += 1
                        row = f"{model_type} {name} {impl} {dtype} {n}"
                        if abs(error) > abs(worst[0]) or not worst[1]:
                            worst = (error, row)
                        where = predicted.where + ("" if predicted.exact else " (not followed: exact False)")
                        print(f"| {model_type} | {name} | {n:,} | {impl} | {dtype} | {predicted.peak:,} | "
                              f"{measured.peak:,} | {error:+.4%} | {where} |", flush=True)
    print(f"\n{rows} rows; worst: {worst[1]} {worst[0]:+.4%} ({torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

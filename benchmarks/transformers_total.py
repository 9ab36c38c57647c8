"""Where a transformers run's process memory goes, measured stage by stage (issue 35, items 3 and 4).

One fresh process per model: the resident set (RSS) is read after Python starts, after ``import torch``, after the
engine's imports (transformers, KV Scope's engine), after the model and its tokenizer load, after the prefill,
after decode steps and after a switch; glibc's ``mallinfo2`` says what the C allocator keeps of freed memory
(``retained``: free bytes in its arenas, resident until trimmed). Each stage's Sample goes through the breakdown
(``kvscope.core.live.breakdown.memory_breakdown``) with the measured runtime baseline, so the table shows what
"rest" remains and the predicted total of calc (``kvscope.core.prediction.calc``) beside the allocator's peak.

    .venv/bin/python benchmarks/transformers_total.py [embedded|smollm2] [--tokens N] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="embedded")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps after the prefill (default 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--switch", default="cache=static", help="a switch after the steps, key=value")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from kvscope.core.base.host_memory import process_memory

    stages = [("python started", process_memory())]
    import torch

    torch.set_num_threads(args.threads)
    stages.append(("import torch", process_memory()))
    from kvscope.core.live.breakdown import memory_breakdown
    from kvscope.core.model.settings import RunSettings
    from kvscope.core.prediction.calc import calculate
    from kvscope.core.runtimes.transformers.engine import Engine
    from kvscope.core.runtimes.transformers.loading import load_model

    baseline = process_memory()
    stages.append(("engine imported (runtime baseline)", baseline))
    if args.model == "smollm2":
        from tests import real_models

        source = str(real_models.smollm2_folder())
    else:
        source = args.model
    loaded = load_model(source, device="cpu")
    stages.append(("model and tokenizer loaded", process_memory()))
    from kvscope.core.runtimes.probes import MemoryProbe

    engine = Engine(loaded, RunSettings(attn_impl="sdpa"), probe=MemoryProbe(device="cpu"), seed=0)
    prompt = torch.randint(0, min(loaded.spec.vocab_size, 1000), (1, args.tokens),
                           generator=torch.Generator().manual_seed(1))
    samples = [("prefill", engine.prefill(prompt, "prompt"))]
    stages.append(("prefill", process_memory()))
    for _ in range(args.steps):
        last = engine.step()
    samples.append((f"{args.steps} decode steps", last))
    stages.append((f"{args.steps} decode steps", process_memory()))
    key, _, value = args.switch.partition("=")
    samples.append((f"switch {args.switch}", engine.apply(key, value)))
    stages.append((f"switch {args.switch}", process_memory()))
    for _ in range(4):
        last = engine.step()
    samples.append(("4 steps after the switch", last))
    stages.append(("4 steps after the switch", process_memory()))

    rows = []
    at_load = stages[3][1]
    for (name, s), (_, host) in zip(samples, stages[4:]):
        b = memory_breakdown(s)
        rest = host.rss - baseline.rss - s.weights_bytes - s.kv_bytes_held
        rows.append({"stage": name, "rss": s.process_rss, "weights": s.weights_bytes, "kv": s.kv_bytes_held,
                     "activations_predicted": s.activations_predicted,
                     "load_less_weights": at_load.rss - s.weights_bytes - baseline.rss,
                     "retained_growth": host.malloc_retained - at_load.malloc_retained,
                     "rest_after_baseline_weights_kv": rest,
                     "parts": {p.name: (p.bytes, p.source) for p in b.parts}, "unattributed": b.unattributed})
    first = samples[0][1]
    calc_row = calculate(loaded.spec, RunSettings(weight_dtype=loaded.dtype, attn_impl="sdpa"), [args.tokens],
                         device="cpu", cpu_threads=args.threads).to_json()["rows"][0]
    out = {"model": loaded.spec.label, "dtype": loaded.dtype, "threads": args.threads,
           "stages": [{"stage": n, **m.to_json()} for n, m in stages], "samples": rows,
           "prefill_peak_observed": first.peak_bytes_observed, "prefill_peak_predicted": first.peak_bytes_predicted,
           "weights_observed": first.weights_bytes, "calc": calc_row}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']} ({out['dtype']}, {args.threads} thread(s), {args.tokens}-token prompt)")
    prev = 0
    for n, m in stages:
        print(f"  {n:<38} RSS {m.rss / 2**20:9.1f} MiB  (+{(m.rss - prev) / 2**20:7.1f})  "
              f"malloc in use {m.malloc_in_use / 2**20 if m.malloc_in_use is not None else float('nan'):8.1f} MiB, "
              f"retained free {m.malloc_retained / 2**20 if m.malloc_retained is not None else float('nan'):7.1f} MiB")
        prev = m.rss
    print(f"  prefill peak: observed {first.peak_bytes_observed:,} B, predicted {first.peak_bytes_predicted:,} B")
    print(f"  calc --device cpu --cpu-threads {args.threads}: total {calc_row['total_bytes']:,} B = weights "
          f"{calc_row['weights_bytes']:,} + KV {calc_row['kv_cache_bytes']:,} + activations "
          f"{calc_row['activation_bytes']:,} ({calc_row['activations_source']}); weights + observed prefill peak "
          f"{first.weights_bytes + first.peak_bytes_observed:,} B")
    for r in rows:
        parts = ", ".join(f"{k} {v[0] / 2**20:.1f} MiB ({v[1]})" for k, v in r["parts"].items() if v[0] is not None)
        print(f"  {r['stage']}: RSS {r['rss'] / 2**20:.1f} MiB = {parts}")
        print(f"      RSS - baseline - weights - KV = {r['rest_after_baseline_weights_kv'] / 2**20:.1f} MiB; of it the load "
              f"beyond its weights {r['load_less_weights'] / 2**20:.1f} MiB, malloc's retained free pages grown "
              f"{r['retained_growth'] / 2**20:.1f} MiB since the load")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())

"""Tokens/s of KV Scope's measuring loop vs plain `model.generate`, same model, same token count, one run.

    .venv/bin/python benchmarks/overhead.py [--tokens 256] [--rounds 5] [--model embedded] [--device auto]

Both sample top-k 40 with a fixed seed and generate exactly --tokens tokens after the same prompt.
Rounds alternate (generate, loop, generate, loop...) so machine noise hits both; the median of each
is compared. Target: loop / generate >= 0.98.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvscope.core.model.request import DEFAULT_PROMPT  # noqa: E402
from kvscope.core.model.settings import RunSettings  # noqa: E402
from kvscope.core.runtimes.probes import MemoryProbe  # noqa: E402
from kvscope.core.runtimes.transformers.engine import Engine  # noqa: E402
from kvscope.core.runtimes.transformers.loading import load_model  # noqa: E402
from kvscope.core.runtimes.transformers.runtime import limit_cpu_threads  # noqa: E402


def time_generate(loaded, ids, tokens: int) -> float:
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_k=40,
                                    top_p=1.0, temperature=1.0, pad_token_id=0)
    dt = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + tokens
    return tokens / dt


def time_loop(loaded, ids, tokens: int, probe) -> float:
    engine = Engine(loaded, RunSettings(), probe=probe, seed=0)
    t = time.perf_counter()
    engine.prefill(ids, "prompt")
    for _ in range(tokens):
        engine.step()
    dt = time.perf_counter() - t
    return tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    loaded = load_model(args.model, device=args.device)
    limit_cpu_threads(loaded.device)  # the app's own CPU thread policy, for both sides
    ids = loaded.tokenizer(DEFAULT_PROMPT, return_tensors="pt")["input_ids"].to(loaded.device)
    probe = MemoryProbe(device=loaded.device)
    time_generate(loaded, ids, 16)  # warm-up both paths
    time_loop(loaded, ids, 16, probe)
    gen, loop = [], []
    for _ in range(args.rounds):
        gen.append(time_generate(loaded, ids, args.tokens))
        loop.append(time_loop(loaded, ids, args.tokens, probe))
    g, lp = statistics.median(gen), statistics.median(loop)
    print(f"model {loaded.label} on {loaded.device}, {args.tokens} tokens x {args.rounds} rounds")
    print(f"model.generate   : {g:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in gen)})")
    print(f"measuring loop   : {lp:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in loop)})")
    print(f"ratio loop/generate = {lp / g:.3f} (target >= 0.98)")


if __name__ == "__main__":
    main()

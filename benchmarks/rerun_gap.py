"""A switch that re-runs the tokens so far: the longest gap between two tokens around it, before and after
issue 25's item 1 (kvscope.core.runtimes.transformers.rerun), side by side in one run.

before: ``Engine.apply`` between two tokens (the one batched pass on the token path: the run waits for it).
after:  ``Engine.begin_switch`` / ``advance_switch`` (the pass on a shadow engine's thread, the run going on under
        the current settings, the tokens generated meanwhile caught up a few per token, the switch applied at a
        later token).

For each switch (to MLA; to h2o) at tokens 100, 500 and 2,000 of a run of the embedded model on the CPU: the
longest gap between two consecutive tokens from the press until 5 tokens after the switch applied, the median
gap before the press, and before/after. Run from the project root:

    .venv/bin/python benchmarks/rerun_gap.py [--at 100,500,2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SWITCHES = [("attention", "mla"), ("cache", "h2o:64+64")]


def _engine(tokens: int):
    from kvscope.core.model.settings import RunSettings
    from kvscope.core.runtimes.transformers.engine import Engine
    from kvscope.core.runtimes.transformers.loading import load_model
    from kvscope.core.runtimes.transformers.runtime import encode_prompt

    loaded = load_model("embedded", device="cpu")
    engine = Engine(loaded, RunSettings(), seed=0)
    engine.prefill(encode_prompt(loaded.tokenizer, "The KV cache grows with every token "), "p")
    times = []
    for _ in range(tokens):
        engine.step()
        times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times[-41:], times[-40:])]
    return engine, statistics.median(gaps)


def before(tokens: int, key: str, value: str) -> tuple[float, float, int]:
    engine, median = _engine(tokens)
    last = time.perf_counter()
    event = engine.apply(key, value)
    engine.step()
    gap = time.perf_counter() - last
    assert event.event == "switch" and event.tokens_rerun, event.text
    return gap, median, 0


def after(tokens: int, key: str, value: str) -> tuple[float, float, int]:
    from kvscope.core.runtimes.transformers.rerun import PreparedSwitch

    engine, median = _engine(tokens)
    last = time.perf_counter()
    prepared = engine.begin_switch(key, value)
    assert isinstance(prepared, PreparedSwitch), prepared
    gaps, meanwhile, applied = [], 0, None
    while applied is None or len(gaps) < meanwhile + 5:
        if applied is None:
            event = engine.advance_switch(prepared)
            if event is not None:
                applied = event
                assert event.event == "switch" and event.kv_bytes_held == event.kv_bytes_predicted, event.text
        if applied is None:
            meanwhile += 1
        engine.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return max(gaps), median, meanwhile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", default="100,500,2000", help="tokens generated before the press")
    args = parser.parse_args()
    from kvscope.core.runtimes.transformers.runtime import limit_cpu_threads

    limit_cpu_threads("cpu")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; "
          f"{os.cpu_count()} cores")
    print(f"{'switch':18} {'at token':>8} {'median gap':>10} {'before: longest':>15} {'after: longest':>14} "
          f"{'before/after':>12} {'tokens while prepared':>21}")
    for key, value in SWITCHES:
        for tokens in (int(t) for t in args.at.split(",")):
            old, median, _ = before(tokens, key, value)
            new, _, meanwhile = after(tokens, key, value)
            print(f"{key + '=' + value:18} {tokens:8,} {median * 1e3:8.1f}ms {old:14.3f}s {new:13.3f}s "
                  f"{old / new:11.1f}x {meanwhile:21,}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the quality probe costs per token: KV Scope's loop with and without ``--quality-probe``, same model, one run.

    .venv/bin/python benchmarks/quality_probe.py [--tokens 128] [--rounds 3] [--device cpu]
        [--models embedded,smollm2,gemma3]

For each model (the embedded demo model, SmolLM2-135M-Instruct and Gemma 3 270M from ``tests/real_models.py``: their
converted folders, built once per machine), the engine generates exactly --tokens tokens after the same prompt, with
the probe off and on, rounds alternating (off, on, off, on...) so machine noise hits both; the median tokens/s of
each and their ratio are printed side by side, with the probe's own cache at the last token. The probe runs one
decode step of the model as loaded per token (``kvscope.core.runtimes.transformers.reference``), so the ratio is
about 1/2 where the model's own step is the time; the window turns it on by default only for small models
(``ui/controls.py``, ``PROBE_DEFAULT_MAX_BYTES``), where half of their tokens/s is still quick.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvscope.core.model.request import DEFAULT_PROMPT  # noqa: E402
from kvscope.core.model.settings import RunSettings  # noqa: E402
from kvscope.core.model.spec import human_bytes  # noqa: E402
from kvscope.core.runtimes.probes import MemoryProbe  # noqa: E402
from kvscope.core.runtimes.transformers.engine import Engine  # noqa: E402
from kvscope.core.runtimes.transformers.loading import load_model  # noqa: E402
from kvscope.core.runtimes.transformers.runtime import limit_cpu_threads  # noqa: E402


def time_loop(loaded, ids, tokens: int, probe, quality: bool) -> tuple[float, int | None]:
    """Tokens/s of the engine's loop over ``tokens`` decode steps (the prefill not timed), and the probe's cache
    bytes at the end (None with the probe off)."""
    engine = Engine(loaded, RunSettings(), probe=probe, seed=0, quality_probe=quality)
    engine.prefill(ids, "prompt")
    t = time.perf_counter()
    for _ in range(tokens):
        last = engine.step()
    dt = time.perf_counter() - t
    assert (last.quality_top1 is not None) == quality
    return tokens / dt, last.quality_kv_bytes


def load(name: str, device: str):
    """The embedded model, "smollm2" or "gemma3" (tests/real_models.py's real weights), or any model source."""
    if name in ("smollm2", "gemma3"):
        from tests import real_models

        folder = real_models.smollm2_folder() if name == "smollm2" else real_models.gemma3_folder()
        return load_model(str(folder), device=device)
    return load_model(name, device=device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="embedded,smollm2")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        loaded = load(name.strip(), args.device)
        limit_cpu_threads(loaded.device)  # the app's own CPU thread policy, for both sides
        ids = loaded.tokenizer(DEFAULT_PROMPT, return_tensors="pt")["input_ids"].to(loaded.device)
        probe = MemoryProbe(device=loaded.device)
        time_loop(loaded, ids, 8, probe, False)  # warm-up both paths
        time_loop(loaded, ids, 8, probe, True)
        off, on, held = [], [], None
        for _ in range(args.rounds):
            off.append(time_loop(loaded, ids, args.tokens, probe, False)[0])
            rate, held = time_loop(loaded, ids, args.tokens, probe, True)
            on.append(rate)
        params = sum(p.numel() for p in loaded.model.parameters())
        rows.append((loaded.label, params, statistics.median(off), statistics.median(on), held, off, on))
    print(f"{args.tokens} tokens x {args.rounds} rounds on {args.device}, medians (rounds in brackets)")
    print(f"{'model':<34} {'params':>8} {'probe off':>10} {'probe on':>10} {'on/off':>7}  probe's cache at the end")
    for label, params, off_m, on_m, held, off, on in rows:
        print(f"{label[:34]:<34} {params / 1e6:7.1f}M {off_m:7.1f}/s {on_m:7.1f}/s {on_m / off_m:7.2f}  "
              f"{human_bytes(held)}  [off {', '.join(f'{x:.1f}' for x in off)}; on {', '.join(f'{x:.1f}' for x in on)}]")


if __name__ == "__main__":
    main()

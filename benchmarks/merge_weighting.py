"""Does weighting the aligned merge's key fit by how the queries read each head beat the unweighted fit? (issue 34)

Teacher-forced against the model as loaded, as tests/test_merge.py measures: the real engine prefills ``--prefix``
tokens of tests/real_models.TEXT, switches to ``--to`` (MQA by default), and the next ``--block`` tokens are forced;
each token's next-token choice (top-1) and KL(loaded || switched) are compared with the loaded model's on the same
tokens. Variants: the mean (``:mean``), the aligned merge unweighted (``KEY_WEIGHTING = "none"``), weighted by the
query energy the query projection's weights imply (``queries`` with no measured queries), and weighted by the
queries the prefix really computed (captured on each layer's q_proj during the prefill).

    python benchmarks/merge_weighting.py --model smollm2 --prefix 24 --block 24
    python benchmarks/merge_weighting.py --model smollm2 --prefix 64 --block 64 --json out.json

Measured on this 2-core machine (one thread), top-1 % / KL nats per token:

| model, prefix+block | mean | aligned | + queries of the weights | + queries measured |
|---|---|---|---|---|
| SmolLM2, 24+24 | 12.5 / 6.51 | 37.5 / 2.02 | 37.5 / 2.49 | 37.5 / 2.06 |
| SmolLM2, 64+64 | 3.1 / 6.13 | 25.0 / 1.70 | 23.4 / 1.72 | 31.2 / 1.49 |
| SmolLM2, 96+96 | 1.0 / 7.52 | 22.9 / 2.57 | 24.0 / 2.59 | 24.0 / 2.44 |
| embedded, 64+64 | 76.6 / 0.46 | 84.4 / 0.31 | 81.2 / 0.31 | 79.7 / 0.32 |

Not adopted (merge.KEY_WEIGHTING stays "none"): the weights' estimate is no better anywhere, the measured queries
help SmolLM2 on longer calibrations and cost it on the short one and the embedded model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(name: str, prefix: int, block: int, to: str) -> list[dict]:
    import torch

    from kvscope.core.runtimes.transformers import convert, merge
    from tests import real_models
    from kvscope.core.model.settings import RunSettings
    from kvscope.core.runtimes.transformers.engine import Engine
    from tests.test_merge import _quality

    torch.set_num_threads(1)
    loaded = real_models.load(name)
    ids = loaded.tokenizer(real_models.TEXT + " " + real_models.TEXT, return_tensors="pt")["input_ids"]
    ids = ids[:, :prefix + block + 1]
    with torch.inference_mode():
        reference = loaded.model(input_ids=ids, use_cache=False).logits[0].float()
    rows = []
    for label, weighting, measured in (("mean", None, False), ("aligned", "none", False),
                                       ("aligned, queries of the weights", "queries", False),
                                       ("aligned, queries measured", "queries", True)):
        merge.KEY_WEIGHTING = weighting or "none"
        captured: list = []
        fresh = real_models.load(name)
        hooks = []
        if measured:  # each layer's queries of the prefill, on its q_proj
            heads = fresh.model.config.num_attention_heads
            for attn in convert._attention_modules(fresh.model):
                hooks.append(attn.q_proj.register_forward_hook(
                    lambda m, a, out, h=heads: captured.append(out.detach().reshape(
                        out.shape[0], out.shape[1], h, -1).transpose(1, 2))))
        engine = Engine(fresh, RunSettings(), seed=0)
        engine._sample_next = lambda engine=engine: ids[:, engine.seq_len:engine.seq_len + 1]
        engine.prefill(ids[:, :prefix], "p")
        for h in hooks:
            h.remove()
        original = merge.calibrate
        if measured:
            queries = iter(captured[:len(convert._attention_modules(engine.base_model))])

            def calibrate(keys, values, layout, _orig=original):
                cal = _orig(keys, values, layout)
                cal.queries = merge.query_energy(next(queries), layout)
                return cal

            merge.calibrate = calibrate
        try:
            t = time.perf_counter()
            event = engine.apply("attention", to + (":mean" if weighting is None else ""))
            fit_s = time.perf_counter() - t
        finally:
            merge.calibrate = original
        top1, kl = _quality(engine, reference, block)
        rows.append({"model": name, "variant": label, "to": to, "prefix": prefix, "block": block,
                     "top1": round(100 * top1, 1), "kl": round(kl, 4), "switch_s": round(fit_s, 2),
                     "event": event.text})
        print(f"{name:9} {to:6} {label:34} top-1 {100 * top1:5.1f}%  KL {kl:.4f}  ({fit_s:.2f} s)", flush=True)
    merge.KEY_WEIGHTING = "none"
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "embedded"))
    parser.add_argument("--prefix", type=int, default=24)
    parser.add_argument("--block", type=int, default=24)
    parser.add_argument("--to", default="mqa")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = measure(args.model, args.prefix, args.block, args.to)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

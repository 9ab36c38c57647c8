"""Issue 34's table: per switch, the KV bytes per token it holds and what the quality probe reports against the model
as loaded, on a real pretrained model, through ``main.py run`` as a user runs it.

For each setting, one run: ``--prefix`` tokens as the model is built, then ``--switch PREFIX:KEY=VALUE`` and
``--after`` more tokens, ``--quality-probe`` on (every token teacher-forced through the model as loaded beside the
run). From its recording: the KV bytes per token after the switch (the held bytes' growth per token; a full window
or sink: held / context), held == predicted at every token, and the mean top-1 agreement and KL over the tokens
after the switch; and the text after it.

    .venv/bin/python benchmarks/switch_quality.py [--model smollm2|embedded|DIR] [--prefix 64] [--after 64]

SmolLM2-135M-Instruct (3 K/V heads: 46,080 B per token of its own), 64 tokens, the switch, 64 more; measured
2026-12-04 on the 2-core machine; held == predicted at every token of every row:

| switch | KV B/token | top-1 % | KL nats | text after the switch |
|---|---|---|---|---|
| mqa:mean | 15,360 | 12.5 | 4.412 | 'TheRight:_-X(__ Trackleve  the_1 Huron...' |
| mqa (aligned) | 15,360 | 51.6 | 1.210 | 'The key idea is: decorators with a decorator...' |
| mla:32 | 3,840 | 54.7 | 0.766 | "The cache uses a function stores a copy..." |
| mla:96 | 11,520 | 67.2 | 0.387 | 'The Python team discovered that each layer...' |
| mla (rank 192, half) | 23,040 | 100.0 | 0.000 | the same: under 192 tokens the latent holds every token exactly |
| window:16 | 4,734 (held / context) | 59.4 | 1.584 | 'The DecO-cache.     < &## &&&+&&&&&&...' |
| quantized:4 | 46,080 (the residual tokens) | 92.2 | 0.013 | 'The reason is that when one function...' |
| quantized:2 | 46,080 (the residual tokens) | 64.1 | 1.184 | "The problem at a: If you would like..." |

Past the rank the default latent compresses: ``run --tokens 512 --quality-probe --switch 64:attention=mla`` gives
top-1 100% / KL 0 over tokens 65-128, 80.5% / 0.155 over 129-256 and 81.6% / 0.149 over 257-512, and its text
from token 300 on loops ("only only and only so only"), where the loaded model's stays English.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = ["attention=mqa:mean", "attention=mqa", "attention=mla:32", "attention=mla:96", "attention=mla",
            "attention=window:16", "cache=quantized:4", "cache=quantized:2"]


def folder(name: str) -> str:
    if name == "smollm2":
        from tests.real_models import smollm2_folder

        return str(smollm2_folder())
    return name


def one(model: str, setting: str, prefix: int, after: int, out: Path) -> dict:
    record = out / (setting.replace("=", "-").replace(":", "_") + ".jsonl")
    cmd = [sys.executable, str(ROOT / "main.py"), "run", "--model", model, "--device", "cpu", "--tokens",
           str(prefix + after), "--quality-probe", "--switch", f"{prefix}:{setting}", "--record", str(record),
           "--force"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode != 0:
        return {"setting": setting, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in record.read_text().splitlines()[1:]]
    tokens = [r for r in rows if r.get("phase") == "decode"]
    later = [r for r in tokens if r["token"] > prefix]
    judged = [r for r in later if r.get("quality_top1") is not None]
    first, last = later[0], later[-1]
    grown = (last["kv_bytes_held"] - first["kv_bytes_held"]) / max(last["token"] - first["token"], 1)
    per_token = grown if grown > 0 else last["kv_bytes_held"] / last["context_tokens"]
    own = tokens[prefix - 1] if len(tokens) >= prefix else tokens[-1]
    own_per_token = own["kv_bytes_held"] / own["context_tokens"]
    return {"setting": setting, "kv_per_token": per_token, "own_per_token": own_per_token,
            "exact": all(r["kv_bytes_held"] == r["kv_bytes_predicted"] for r in tokens),
            "top1": 100 * sum(r["quality_top1"] for r in judged) / max(len(judged), 1),
            "kl": sum(r["quality_kl"] for r in judged) / max(len(judged), 1), "judged": len(judged),
            "text": "".join(r.get("text") or "" for r in later)[:70]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefix", type=int, default=64)
    parser.add_argument("--after", type=int, default=64)
    args = parser.parse_args()
    model = folder(args.model)
    print(f"{args.model}: {args.prefix} tokens as built, then the switch and {args.after} more, probe on\n")
    print("| switch | KV B/token (own) | held == predicted | top-1 % | KL nats | text after the switch |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for setting in SETTINGS:
            r = one(model, setting, args.prefix, args.after, Path(tmp))
            if "error" in r:
                print(f"| {setting} | refused: {r['error'][:90]} | | | | |", flush=True)
                continue
            text = r["text"].replace("\n", " ").replace("|", "/")
            print(f"| {setting} | {r['kv_per_token']:,.0f} ({r['own_per_token']:,.0f}) | {r['exact']} | "
                  f"{r['top1']:.1f} | {r['kl']:.3f} | {text!r} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How readable is the embedded demo model's text, before and after GQA/MQA switches?

Runs ``main.py run`` (the engine as the terminal runs it: the default prompt, the app's sampling,
top-k 40 at temperature 1, seed 0) with the switches below, reads the recording it writes, and
prints, per attention mode, the share of generated words that are words of the corpus
(``kvscope.core.model.embedded.corpus_word_share``) and the text itself. ``--random`` does the same with the
random-weight fallback (the shipped weights file pointed at a path that does not exist), for
comparison.

    .venv/bin/python benchmarks/embedded_text.py                 # trained weights
    .venv/bin/python benchmarks/embedded_text.py --random        # the fallback
    .venv/bin/python benchmarks/embedded_text.py --tokens 600 --switch 200:attention=gqa:2 --switch 400:attention=mqa
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvscope.core.model.embedded import corpus_word_share, corpus_words  # noqa: E402

RUN = """
import sys
from pathlib import Path
import kvscope.core.model.embedded as embedded
if {random!r}:
    embedded.WEIGHTS_PATH = Path({missing!r})
from kvscope import main
sys.exit(main.main({argv!r}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--switch", action="append", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random", action="store_true", help="the random-weight fallback instead")
    args = parser.parse_args(argv)
    switches = args.switch or ["100:attention=gqa:2", "200:attention=mqa"]

    with tempfile.TemporaryDirectory(prefix="kvscope-text-") as tmp:
        record = Path(tmp) / "run.jsonl"
        run_argv = ["run", "--device", "cpu", "--tokens", str(args.tokens), "--seed", str(args.seed),
                    "--record", str(record)] + [a for s in switches for a in ("--switch", s)]
        env = dict(os.environ)
        if args.random:
            env["KVSCOPE_CACHE"] = str(Path(tmp) / "cache")  # the fallback's folder, not the user's
        code = RUN.format(random=args.random, missing=str(Path(tmp) / "missing.safetensors"), argv=run_argv)
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-2000:], sep="\n")
            return done.returncode
        lines = [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines()[1:]]

    segments: list[tuple[str, list[str]]] = []
    label = next((s["text"] for s in lines if s.get("event") == "load"), "?")
    for s in lines:
        if s.get("phase") != "decode":
            continue
        mode = s.get("attention", "?")
        if not segments or segments[-1][0] != mode:
            segments.append((mode, []))
        segments[-1][1].append(s.get("text", ""))
    words = corpus_words()
    print(label)
    total_in = total = 0
    for mode, pieces in segments:
        text = "".join(pieces)
        share, n = corpus_word_share(text, words)
        total_in += round(share * n)
        total += n
        print(f"\n{mode}: {len(pieces)} tokens, {n} words, {share:.1%} corpus words")
        print("    " + " ".join(text.split()))
    print(f"\nall: {total} words, {total_in / max(1, total):.1%} corpus words")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

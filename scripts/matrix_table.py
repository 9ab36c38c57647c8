"""The architecture matrix's outcome of every switch, as a table: how many architectures applied or refused each.

    KVSCOPE_MATRIX_OUTCOMES=/tmp/outcomes.jsonl .venv/bin/python -m pytest -q tests/test_arch_matrix.py
    .venv/bin/python scripts/matrix_table.py /tmp/outcomes.jsonl [--markdown]

Each switch from the model's own settings counts once (the switch back after an applied one is left out);
"no change" is a switch to what the model already runs.
"""

from __future__ import annotations

import collections
import json
import sys

SWITCHES = ("attention=mha", "attention=gqa:2", "attention=mqa", "attention=mla", "attention=window:8",
            "attn-impl=eager", "attn-impl=sdpa", "attn-impl=flash", "cache=static", "cache=quantized:4",
            "cache=quantized:hqq:4", "cache=quantized:fp8", "cache=dynamic")


def main() -> int:
    path = sys.argv[1]
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seen: dict[tuple[str, str], bool] = {}
    archs = set()
    for r in rows:
        archs.add(r["model_type"])
        switch = f"{r['key']}={r['value']}"
        first = (r["model_type"], switch)
        if first in seen:  # the switch back to the model's own setting
            continue
        seen[first] = True
        outcome = r["outcome"]
        if outcome == "note":
            outcome = "no change"
        counts[switch][outcome] += 1
    cols = ("switch", "applied", "refused", "no change")
    table = [cols] + [(sw, str(counts[sw]["switch"]), str(counts[sw]["refused"]), str(counts[sw]["no change"]))
                      for sw in SWITCHES if sw in counts]
    print(f"{len(archs)} architectures, {len(seen)} switches")
    if "--markdown" in sys.argv:
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for row in table[1:]:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
        for row in table:
            print("  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(row)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time and memory of reading a GGUF header (target: well under a second and a few MB, whatever the header holds):
KV Scope's bounded reader (kvscope.core.model.gguf.read_gguf) against gguf-py's GGUFReader (what kvscope.core.model.gguf used before issue 29),
each in a fresh process, on genuine large headers and on hostile ones.

    .venv/bin/python benchmarks/gguf_header.py [--timeout 60]

Each reader runs with 4 GiB of address space at most (gguf-py on the 10^9-element claim would otherwise grow until
the machine has no memory left).

Prints, per file: its size, each reader's wall time and peak RSS (``ru_maxrss`` of the child), what it ended with,
and the ratio of the times. A reader still running at --timeout is stopped and shown as "> N s".
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_gguf_fuzz import ARR, F32, I32, STR, U32, gstr, model  # noqa: E402

KVSCOPE = """
import sys, time
sys.path.insert(0, {root!r})
t = time.perf_counter()
from kvscope.core.model.gguf import read_gguf
from kvscope.core.model.spec import SpecError
try:
    g = read_gguf(sys.argv[1])
    what = f"{{g.n_layer}} layers, {{len(g.tensors)}} tensors, vocabulary {{g.n_vocab:,}}"
except SpecError as exc:
    what = "refused: " + str(exc)[:70]
import resource
print(f"{{time.perf_counter() - t:.3f}}|{{what}}|{{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}")
"""
GGUF_PY = """
import sys, time
t = time.perf_counter()
from gguf import GGUFReader
try:
    r = GGUFReader(sys.argv[1])
    what = f"{{len(r.tensors)}} tensors, {{len(r.fields)}} fields"
except Exception as exc:
    what = f"{{type(exc).__name__}}: {{str(exc)[:60]}}"
import resource
print(f"{{time.perf_counter() - t:.3f}}|{{what}}|{{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}")
"""


def files(root: Path) -> list[tuple[str, Path]]:
    made = []

    def write(name: str, data: bytes) -> None:
        path = root / f"{name}.gguf"
        path.write_bytes(data)
        made.append((name, path))

    g, _ = model(vocab=40)
    write("tiny llama (40 tokens)", g.to_bytes())
    g, _ = model(vocab=40)  # a Gemma-3-sized vocabulary and Llama-3-sized merges, scores and types
    g.set("tokenizer.ggml.tokens", ARR, [f"<tok{j}>" for j in range(262_144)], STR)
    g.set("tokenizer.ggml.scores", ARR, [0.0] * 262_144, F32)
    g.set("tokenizer.ggml.token_type", ARR, [1] * 262_144, I32)
    g.set("tokenizer.ggml.merges", ARR, [f"a{j} b{j}" for j in range(280_147)], STR)
    write("262K tokens + 280K merges", g.to_bytes())
    g, _ = model(vocab=40)
    g.set("tokenizer.ggml.token_type", ARR, [1] * 1_000_000, I32)
    g.set("tokenizer.ggml.merges", ARR, ["ab cd"] * 300_000, STR)
    write("4 MB i32 + 300K merges", g.to_bytes())
    g, _ = model(vocab=40)  # the most strings KV Scope walks (MAX_ARRAY_STRINGS), all empty
    g.set("tokenizer.ggml.merges", ARR, [""] * ((1 << 21) - 40), STR)
    write("2,097,112 empty strings (the cap)", g.to_bytes())
    tiny = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + gstr("general.architecture") + struct.pack("<I", STR) + gstr("llama")
    tiny += gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARR, U32, 10**9) + b"\0" * 12
    write("126 B claiming 10^9 u32", tiny)
    g, _ = model(vocab=40)
    g.set("llama.block_count", U32, 100_000)
    write("block_count 100,000", g.to_bytes())
    return made


def run(code: str, path: Path, timeout: float) -> tuple[str, int, str]:
    """(time, peak RSS in KiB, what the reader ended with) of one reader in a fresh process."""
    proc = subprocess.Popen([sys.executable, "-c", code.format(root=str(ROOT)), str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_limit_memory)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        peak = _peak_kib(proc.pid)
        proc.kill()
        proc.communicate()
        return f"> {timeout:.0f} s", peak, "still reading (stopped)"
    seconds, _, rest = (out.strip().rpartition("\n")[2] or "?|0|").partition("|")
    what, _, peak = rest.rpartition("|")
    if proc.returncode:
        what = (err.strip().splitlines() or ["?"])[-1][:70]
    return f"{float(seconds or 0):.3f} s", int(peak or 0), what


def _limit_memory() -> None:
    """4 GiB of address space per reader: gguf-py on a claim of 10^9 elements would take all the machine has."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _peak_kib(pid: int) -> int:
    """The peak RSS of a running process (Linux: VmHWM), read before it is stopped."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'file':<36}{'size':>12}  {'KV Scope':>10} {'RSS':>8}  {'gguf-py':>10} {'RSS':>8}  {'ratio':>7}")
        for name, path in files(Path(tmp)):
            ours, our_rss, our_what = run(KVSCOPE, path, args.timeout)
            theirs, their_rss, their_what = run(GGUF_PY, path, args.timeout)
            ratio = "-"
            if not ours.startswith(">") and not theirs.startswith(">"):
                ratio = f"{float(theirs.split()[0]) / max(float(ours.split()[0]), 1e-4):.0f}x"
            elif theirs.startswith(">"):
                ratio = f"> {float(theirs.split()[1]) / max(float(ours.split()[0]), 1e-4):.0f}x"
            print(f"{name:<36}{path.stat().st_size:>12,}  {ours:>10} {our_rss // 1024:>5} MB  {theirs:>10} "
                  f"{their_rss // 1024:>5} MB  {ratio:>7}", flush=True)
            print(f"{'':<36}{'':>12}  KV Scope: {our_what}")
            print(f"{'':<36}{'':>12}  gguf-py:  {their_what}")


if __name__ == "__main__":
    main()

"""What llama.cpp's own process costs per token: the embedded GGUF decoded in this process (LlamaCppEngine) and
through the runtime that keeps it in a child process (kvscope.core.runtimes.llamacpp.runtime: one pipe round trip per token).

    python benchmarks/llamacpp_child.py [tokens]

Prints the seconds per token both ways and their ratio (child / in-process), and the child's start-up.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvscope.core.model.gguf_write import embedded_gguf  # noqa: E402
from kvscope.core.model.request import RunRequest  # noqa: E402
from kvscope.core.prediction.llamacpp import LlamaCppOptions  # noqa: E402
from kvscope.core.runtimes.llamacpp.engine import LlamaCppEngine  # noqa: E402
from kvscope.core.runtimes.llamacpp.runtime import LlamaCppRuntime  # noqa: E402


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    options = LlamaCppOptions(n_ctx=tokens + 64)
    path = embedded_gguf(lambda text: None)
    engine = LlamaCppEngine(path, options)
    engine.prefill("Every token keeps a key and a value")
    t = time.perf_counter()
    for _ in range(tokens):
        engine.step()
    here = (time.perf_counter() - t) / tokens
    engine.close()

    request = RunRequest(runtime="llama.cpp", source=str(path), options={"llama.cpp": options}, max_new_tokens=tokens)
    runtime = LlamaCppRuntime(request, lambda text: None)
    t = time.perf_counter()
    runtime.load()
    start = time.perf_counter() - t
    runtime.prefill(request)
    t = time.perf_counter()
    for _ in range(tokens):
        runtime.step()
    child = (time.perf_counter() - t) / tokens
    runtime.close()
    print(f"{tokens} tokens of the embedded GGUF: in this process {here * 1e3:.3f} ms/token, in its child "
          f"{child * 1e3:.3f} ms/token (ratio {child / here:.2f}, +{(child - here) * 1e6:.0f} us per token); "
          f"the child's start and load {start:.2f} s")


if __name__ == "__main__":
    main()

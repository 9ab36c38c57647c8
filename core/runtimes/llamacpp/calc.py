"""The calculator's rules for llama.cpp: what it allocates at load, as ``python main.py calc --runtime llama.cpp``.

The KV cache is the whole context's, padded to 256 cells (``kvscope.core.prediction.llamacpp.plan``); the compute buffer is what
llama.cpp reserves (``kvscope.core.prediction.llamacpp_compute``); a GGUF model's weights are its tensors on the GPU. The largest
context that fits is calc's own search (``largest_context_on_gpu`` up to ``MAX_CONTEXT``). One sequence, the
file's weights, the model's own attention: the batch, dtype, attention and GPU inputs do not apply.
"""

from __future__ import annotations

from kvscope.core.model.settings import RunSettings
from kvscope.core.model.spec import ModelSpec
from kvscope.core.prediction.llamacpp import (CACHE_TYPES, MAX_CONTEXT, formula_llamacpp, max_context_llamacpp,
                                              predict_llamacpp)
from kvscope.core.runtimes.calculator import CalcFigures, CalcInputs, CalcRow

TIPS = {
    "weights": "The weights llama.cpp puts on the GPU: a GGUF's tensors (the token embedding stays in host memory), "
               "else the parameters at 2 bytes (an F16 GGUF).",
    "kv": "What llama.cpp allocates for the KV cache when the model loads: the whole context, padded to 256 cells.",
    "activations": "llama.cpp's compute buffer (sched_reserve: the largest of its reserved graphs through its "
                   "allocator), exact for the CPU backend; CUDA and Metal follow other kernels, not checked yet",
    "total": "weights + KV + compute buffer on the GPU (the output buffer is host memory).",
    "per_token": "KV bytes per cell: one cell in each cache per token.",
}


class LlamaCppCalc:
    """``kvscope.core.runtimes.calculator.CalcRules`` for llama.cpp (the KV cache allocated at load)."""

    label = "llama.cpp (allocated at load)"
    tip = ("llama.cpp (LM Studio, Ollama): the whole context's KV cache is allocated when the model loads, padded "
           "to 256 cells; a .gguf model gives its exact weights.")
    inputs: frozenset[str] = frozenset()
    unused_note = "(llama.cpp: not used; one sequence, the file's weights, the model's own attention)"
    default_cache = "f16"

    def caches(self, spec: ModelSpec | None) -> list[str]:
        """llama.cpp's cache types (the same for K and V)."""
        return list(CACHE_TYPES)

    def settings(self, spec: ModelSpec, inputs: CalcInputs) -> RunSettings:
        return RunSettings(weight_dtype=inputs.weight_dtype)

    def fit(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int | None, int]:
        return max_context_llamacpp(spec, inputs.memory, inputs.cache or self.default_cache, MAX_CONTEXT), MAX_CONTEXT

    def figures(self, spec: ModelSpec, inputs: CalcInputs, fit: tuple[int | None, int]) -> CalcFigures:
        cache = inputs.cache or self.default_cache
        p = predict_llamacpp(spec, inputs.context, cache)
        b = p.breakdown
        rows = (CalcRow("weights", "Weights", b.weights, TIPS["weights"]),
                CalcRow("kv", "KV cache", b.kv_cache, TIPS["kv"]),
                CalcRow("activations", "Compute buffer", b.activations, TIPS["activations"]),
                CalcRow("total", "Total", p.total, TIPS["total"]),
                CalcRow("per_token", "KV per token", p.kv_bytes_per_token, TIPS["per_token"]))
        return CalcFigures(inputs, self.settings(spec, inputs), rows, p.total, fit[0], fit[1],
                           formula_llamacpp(spec, inputs.context, cache), 1, spec.max_position_embeddings, spec.label)

    def stack(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int, int, int]:
        b = predict_llamacpp(spec, inputs.context, inputs.cache or self.default_cache).breakdown
        return b.weights or 0, b.kv_cache or 0, b.activations or 0


RULES = LlamaCppCalc()

"""The calculator's rules for transformers: the predictor's numbers, as ``python main.py calc`` prints them.

One GPU: ``kvscope.core.prediction.predict.predict`` per context and ``max_context_that_fits`` up to calc's ``SEARCH_LIMIT``;
several (tensor x pipeline parallel, vLLM's split): the busiest GPU's share (``kvscope.core.prediction.parallel``) and what fits
on every one. No torch: the spec is a description, nothing is loaded.
"""

from __future__ import annotations

import os

from kvscope.core.model.attention import parse_attention
from kvscope.core.model.caches import parse_cache
from kvscope.core.model.settings import RunSettings, cache_choices
from kvscope.core.model.spec import ModelSpec
from kvscope.core.prediction.calc import SEARCH_LIMIT, kv_formula
from kvscope.core.prediction.parallel import max_context_per_gpu, predict_parallel
from kvscope.core.prediction.predict import Prediction, kv_bytes, max_context_that_fits, predict
from kvscope.core.runtimes.calculator import TIMES, CalcFigures, CalcInputs, CalcRow

TIPS = {
    "weights": "Parameters x bytes per element (parameter count from a meta-device build of the config).",
    "kv": "Exact bytes of the KV cache for this context, mirroring transformers' cache classes.",
    "activations": "What the largest moment holds beyond the weights and the KV: the prefill's peak or a decode "
                   "step's, each replayed allocation by allocation as transformers runs it (on a GPU).",
    "total": "weights + KV + activations: the allocator's peak for this context, what must fit on the GPU (plus the "
             "runtime's own: the CUDA context and libraries, a few hundred MiB).",
    "per_token": "KV bytes added per token of context.",
}


def _env_threads(name: str) -> int:
    """A positive thread count from the environment variable ``name``, else 0."""
    try:
        value = int(os.environ.get(name, "").strip() or 0)
    except ValueError:
        return 0
    return max(value, 0)


def _physical_cores() -> int:
    """The CPU's cores (not its hardware threads), as torch counts them for its default thread count: the distinct
    (physical id, core id) pairs of /proc/cpuinfo, else os.cpu_count()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            text = fh.read(1 << 22)
    except OSError:
        text = ""
    cores, package = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "physical id":
            package = value.strip()
        elif key.strip() == "core id":
            cores.add((package, value.strip()))
    return len(cores) or os.cpu_count() or 1


def app_cpu_threads() -> int:
    """The torch threads the app's engine runs a CPU model with, found without torch: torch's default (OMP_NUM_THREADS,
    else MKL_NUM_THREADS, else the CPU's cores), lowered to one less than the CPUs unless OMP_NUM_THREADS is set (the
    rule of ``kvscope.core.runtimes.transformers.runtime.limit_cpu_threads``). calc's default for ``--cpu-threads``:
    the CPU sdpa kernel's scratch is per thread."""
    omp = _env_threads("OMP_NUM_THREADS")
    if omp:
        return omp
    default = _env_threads("MKL_NUM_THREADS") or _physical_cores()
    return max(1, min(default, (os.cpu_count() or 2) - 1))


class TransformersCalc:
    """``kvscope.core.runtimes.calculator.CalcRules`` for transformers' caches (they grow per token)."""

    label = "transformers (grows per token)"
    tip = "transformers: the cache holds the tokens so far (a dynamic cache)."
    inputs = frozenset({"batch", "weight_dtype", "kv_dtype", "attention", "gpus"})
    unused_note = ""
    default_cache = "dynamic"

    def caches(self, spec: ModelSpec | None) -> list[str]:
        """The cache strategies (the sink and h2o sizes follow the model's context)."""
        return [key for key, _ in cache_choices(spec=spec)]

    def settings(self, spec: ModelSpec, inputs: CalcInputs) -> RunSettings:
        """As calc reads its flags: a static cache preallocates the context; h2o runs (and is predicted) eager."""
        cache = parse_cache(inputs.cache or self.default_cache)
        return RunSettings(batch=inputs.batch, weight_dtype=inputs.weight_dtype, kv_dtype=inputs.kv_dtype,
                           attention=parse_attention(inputs.attention) if inputs.attention else None, cache=cache,
                           max_context=inputs.context if cache.name == "static" else None,
                           attn_impl="eager" if cache.needs_attention_weights else "sdpa")

    def prediction(self, spec: ModelSpec, inputs: CalcInputs) -> Prediction:
        """The model's prediction, or with several GPUs the busiest GPU's share (calc's per-GPU rows)."""
        settings = self.settings(spec, inputs)
        parallel = inputs.parallelism
        if parallel.single:
            return predict(spec, settings, inputs.context)
        shares = predict_parallel(spec, settings, parallel, inputs.context).per_gpu()
        return max(shares, key=lambda share: share.total)

    def fit(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int | None, int]:
        """calc's search (``kvscope.core.prediction.calc.calculate``): up to ``SEARCH_LIMIT``, on every GPU with several."""
        settings = self.settings(spec, inputs).with_(max_context=None)
        parallel = inputs.parallelism
        if parallel.single:
            return max_context_that_fits(spec, settings, inputs.memory, limit=SEARCH_LIMIT), SEARCH_LIMIT
        return max_context_per_gpu(spec, settings, parallel, inputs.memory, SEARCH_LIMIT), SEARCH_LIMIT

    def figures(self, spec: ModelSpec, inputs: CalcInputs, fit: tuple[int | None, int]) -> CalcFigures:
        settings = self.settings(spec, inputs)
        p = self.prediction(spec, inputs)
        b = p.breakdown
        gpus = inputs.parallelism.gpus
        # With several GPUs the four sizes are the busiest GPU's share; KV per token and the formula are totals.
        each = " per GPU" if gpus > 1 else ""
        per_token = kv_bytes(spec, settings.with_(cache=parse_cache("dynamic")), 1)
        rows = (CalcRow("weights", "Weights" + each, b.weights, TIPS["weights"]),
                CalcRow("kv", "KV cache" + each, b.kv_cache, TIPS["kv"]),
                CalcRow("activations", "Activations (peak)" + each, b.activations, TIPS["activations"]),
                CalcRow("total", "Total" + each, p.total, TIPS["total"]),
                CalcRow("per_token", "KV per token" + (" (all GPUs)" if gpus > 1 else ""), per_token,
                        TIPS["per_token"]))
        formula = kv_formula(spec, settings, inputs.context, times=TIMES)
        return CalcFigures(inputs, settings, rows, p.total, fit[0], fit[1],
                           formula if gpus == 1 else f"All GPUs: {formula}", gpus, spec.max_position_embeddings,
                           spec.label)

    def stack(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int, int, int]:
        b = self.prediction(spec, inputs).breakdown
        return b.weights or 0, b.kv_cache or 0, b.activations or 0


RULES = TransformersCalc()

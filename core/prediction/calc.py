"""`python main.py calc`: what will this context cost? A table (or JSON) from the predictor alone."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.model.caches import TokenSelecting, kv_layout
from kvscope.core.model.settings import RunSettings, effective_spec
from kvscope.core.model.spec import ModelSpec, SettingsError, human_bytes
from kvscope.core.prediction.parallel import (Parallelism, ParallelPrediction, describe, gpu_rows, max_context_per_gpu,
                                              predict_parallel)
from kvscope.core.prediction.predict import (Prediction, decode_peak, kv_bytes, kv_elem_bytes, kv_overtakes_weights_at,
                                             max_context_that_fits, predict, prefill_peak)
from kvscope.core.prediction.serving import ServingCapacity, render as render_serving
from kvscope.core.prediction.table import aligned, bytes_cell

#: Largest context the "what fits" search considers (the model's own maximum may be smaller; we
#: still answer, and say it is beyond what the model was trained for).
SEARCH_LIMIT = 1 << 24


@dataclass(frozen=True)
class CalcResult:
    spec: ModelSpec
    settings: RunSettings
    rows: tuple[Prediction, ...]
    gpu_memory: int | None
    max_context: int | None
    overtakes_at: int | None
    parallelism: Parallelism = Parallelism()
    #: Per GPU, one per row (multi-GPU only); ``max_context`` is then what fits on every GPU.
    parallel: tuple[ParallelPrediction, ...] = ()
    #: ``--runtime vllm``: the KV blocks and concurrency under vLLM's rules (``kvscope.core.prediction.serving``).
    serving: ServingCapacity | None = None
    #: Where the JSON's prefill and decode peaks run: "cuda" (a GPU) or "cpu" with ``cpu_threads`` torch threads.
    device: str = "cuda"
    cpu_threads: int = 1

    def to_json(self) -> dict[str, Any]:
        """The documented JSON shape: {"model", "rows": [{context, kv_cache_bytes, ...}], "max_context"}.

        On several GPUs each row's bytes are summed over the GPUs and ``per_gpu`` lists every GPU's;
        ``gpu_memory`` and ``max_context`` are per GPU. ``--runtime vllm`` adds ``serving``."""
        out = self._json()
        if self.serving is not None:
            out["serving"] = self.serving.to_json()
        return out

    def _json(self) -> dict[str, Any]:
        if self.parallel:
            return {
                "model": self.spec.name,
                "tensor_parallel": self.parallelism.tensor,
                "pipeline_parallel": self.parallelism.pipeline,
                "gpus": self.parallelism.gpus,
                "rows": [
                    {
                        "context": p.context,
                        "kv_cache_bytes": p.total("kv_cache"),
                        "weights_bytes": p.total("weights"),
                        "activation_bytes": p.total("activations"),
                        "total_bytes": p.total("total"),
                        "largest_gpu_total_bytes": p.largest_gpu_total,
                        "per_gpu": gpu_rows(p),
                    }
                    for p in self.parallel
                ],
                "gpu_memory": self.gpu_memory,
                "max_context": self.max_context,
                "notes": list(self.parallel[0].layout.notes) if self.parallel else [],
            }
        return {
            "model": self.spec.name,
            "rows": [
                {
                    "context": p.context,
                    "kv_cache_bytes": p.breakdown.kv_cache,
                    "weights_bytes": p.breakdown.weights,
                    "activation_bytes": p.breakdown.activations,
                    "total_bytes": p.total,
                    "activations_source": p.activations_source,
                    **prefill_peak_json(self.spec, self.settings, p.context, self.device, self.cpu_threads),
                }
                for p in self.rows
            ],
            "max_context": self.max_context,
        }


def prefill_peak_json(spec: ModelSpec, settings: RunSettings, context: int, device: str = "cuda",
                      cpu_threads: int = 1) -> dict[str, Any]:
    """``prefill_peak_bytes``: the most bytes the prefill of ``context`` tokens holds at once beyond the weights
    (KV written and last-position logits included; ``kvscope.core.prediction.predict.prefill_peak``, on a GPU, or on
    the CPU with the sdpa flash kernel's buffers for ``cpu_threads`` threads; oneDNN's bf16/fp16 matmul scratch is
    left out, asking for it needs torch; a model type the replay does not follow gets a Llama layer's). ``decode_peak_bytes``: the most bytes one decode step on a cache of ``context`` tokens
    holds at once beyond the weights and that cache (``kvscope.core.prediction.predict.decode_peak``). Both checked
    against the allocator on the CPU (tests/test_prefill_peak.py); not yet on a GPU."""
    s = settings.with_(max_context=settings.max_context or context) if settings.cache.name == "static" else settings
    peak = prefill_peak(spec, s, context, device=device, cpu_threads=cpu_threads)
    step = decode_peak(spec, s, context, device=device, cpu_threads=cpu_threads)
    return {"prefill_peak_bytes": peak.peak, "decode_peak_bytes": step.peak}


def calculate(spec: ModelSpec, settings: RunSettings, contexts: list[int], gpu_memory: int | None = None,
              parallelism: Parallelism | None = None, device: str = "cuda", cpu_threads: int = 1) -> CalcResult:
    """Predict every context; with ``gpu_memory``, also the largest context that fits in it (on every GPU
    of ``parallelism``, which splits the model vLLM's way: ``kvscope.core.prediction.parallel``). ``device`` and
    ``cpu_threads``: where the forward passes run, for the activations, the totals and the largest context (the
    replayed peaks, ``kvscope.core.prediction.predict.predict``) and the JSON's prefill and decode peaks."""
    effective_spec(spec, settings)  # validates the attention mode against the model before any row
    if settings.cache.name == "static" and settings.max_context and max(contexts, default=0) > settings.max_context:
        # issue 38: a 16-slot static cache was predicted for 4,096 tokens (transformers' StaticCache refuses it)
        raise SettingsError(f"a static cache of --max-context {settings.max_context:,} tokens cannot hold a context of "
                            f"{max(contexts):,}: raise --max-context to at least that, or leave it out (each context's own)")
    if settings.cache.needs_attention_weights:
        settings = settings.with_(attn_impl="eager")  # as the engine runs h2o: its activations are eager's
    rows = []
    for context in contexts:
        s = settings.with_(max_context=settings.max_context or context) if settings.cache.name == "static" else settings
        rows.append(predict(spec, s, context, device=device, cpu_threads=cpu_threads))
    parallelism = parallelism or Parallelism()
    if not parallelism.single:
        per_gpu = []
        for context in contexts:
            s = settings.with_(max_context=settings.max_context or context) if settings.cache.name == "static" else settings
            per_gpu.append(predict_parallel(spec, s, parallelism, context))
        fits = (max_context_per_gpu(spec, settings, parallelism, gpu_memory, limit=SEARCH_LIMIT, plan=per_gpu[0].layout)
                if gpu_memory else None)
        return CalcResult(spec, settings, tuple(rows), gpu_memory, fits, kv_overtakes_weights_at(spec, settings),
                          parallelism, tuple(per_gpu))
    fits = (max_context_that_fits(spec, settings, gpu_memory, limit=SEARCH_LIMIT, device=device, cpu_threads=cpu_threads)
            if gpu_memory else None)
    return CalcResult(spec, settings, tuple(rows), gpu_memory, fits, kv_overtakes_weights_at(spec, settings),
                      device=device, cpu_threads=cpu_threads)


def kv_formula(spec: ModelSpec, settings: RunSettings, tokens: int | None = None, times: str = " x ") -> str:
    """The KV formula with this model's numbers substituted: per token (``tokens`` None, the CLI's
    line), or for ``tokens`` tokens, ending in the product's bytes and, where the cache holds other
    than the classic product (windows, static preallocation, quantized codes), what it holds.

    The classic product is exact for a dynamic cache of full-attention layers.
    """
    eff = effective_spec(spec, settings)
    elem = kv_elem_bytes(spec, settings)
    n = 1 if tokens is None else tokens
    token_factor = [] if tokens is None else [f"{tokens:,} tokens"]
    layers = kv_layout(eff)  # the layers that cache K/V (linear-attention and state-space layers do not)
    if not layers:
        width, factors = 0, ["0 layers with K/V"]
    elif eff.latent_rank is not None and not eff.is_mla and all(layer.window is None for layer in layers):
        width = eff.latent_rank
        factors = [f"{len(layers)} layers", f"{eff.latent_rank} latent (KV Scope's MLA of its own K/V)"]
    elif eff.is_mla:
        rank, rope = eff.kv_lora_rank, eff.qk_rope_head_dim
        width = rank + rope
        factors = [f"{len(layers)} layers", f"({rank} latent + {rope} rope)"]
    else:
        layer = layers[0]
        width = layer.width
        if layer.k_dim == layer.v_dim:
            factors = ["2 (K,V)" if tokens is None else "2", f"{len(layers)} layers", f"{layer.heads} KV heads",
                       f"{layer.k_dim} head_dim"]
        else:
            factors = [f"{len(layers)} layers", f"{layer.heads} KV heads", f"({layer.k_dim} K + {layer.v_dim} V)"]
    factors += token_factor + [f"{settings.batch} batch", f"{elem:g} B"]
    product = len(layers) * width * n * settings.batch * elem
    if tokens is None:
        return times.join(factors) + f" = {product:,.0f} B per token"
    product = int(math.ceil(product))
    text = times.join(factors) + f"\n= {product:,} B  ({human_bytes(product)})"
    notes = []
    windows = {layer.window for layer in layers if layer.window}
    if windows:
        n_sliding = sum(1 for layer in layers if layer.window)
        notes.append(f"{n_sliding} of {len(layers)} layers keep only a window of {min(windows):,} tokens")
    stateful = sum(1 for st in eff.layer_states or () if st.elements or st.fixed_bytes)
    if stateful:
        notes.append(f"{stateful} of {eff.num_layers} layers keep fixed-size linear-attention, state-space or "
                     "convolution states")
    basis = sum(layer.fixed for layer in layers)
    if basis:
        notes.append(f"the latent's bases, {basis:,} elements held once")
    if settings.cache.name == "static":
        notes.append(f"static cache preallocates {settings.max_context or tokens:,} tokens")
    if settings.cache.name == "quantized":
        notes.append(f"{settings.cache.key} stores packed codes + scales, residual tokens unquantized")
    exact = kv_bytes(spec, settings, tokens)
    if exact != product or notes:
        text += f"\ncache holds {exact:,} B  ({human_bytes(exact)})" + (f": {'; '.join(notes)}" if notes else "")
    return text


def render_table(result: CalcResult) -> str:
    spec, settings = result.spec, result.settings
    eff = effective_spec(spec, settings)
    wdtype = settings.weight_dtype or spec.dtype
    kvdtype = settings.kv_dtype or wdtype
    lines = [
        f"{safe_text(spec.label, limit=NAME_LIMIT)}: {spec.num_layers} layers, {spec.num_query_heads} query heads, "
        f"{spec.num_kv_heads} KV heads, "
        f"head_dim {spec.head_dim}, {spec.num_parameters:,} parameters",
        f"attention {settings.attention_key(spec)}, weights {wdtype}, KV {kvdtype}, batch {settings.batch}, "
        f"cache {settings.cache.key}, attn-impl {_kernel_text(spec, settings.attn_impl)}",
    ]
    if eff.sliding_window:
        wider = result.rows and eff.sliding_window > max(p.context for p in result.rows)
        lines.append(f"sliding window {eff.sliding_window} tokens on {eff.num_sliding_layers} of {eff.num_layers} layers"
                     + (" (wider than every context here: the cache keeps every token)" if wider else ""))
    lines.append("KV per token: " + kv_formula(spec, settings))
    if isinstance(settings.cache, TokenSelecting) and eff.num_full_layers:
        cap = settings.cache.capacity
        what = (f"{settings.cache.sinks} sinks + {settings.cache.window} recent" if settings.cache.name == "sink" else
                f"{settings.cache.budget} heavy hitters + {settings.cache.window} recent, with a float32 score each "
                "per KV head; predicted with eager attention, which h2o needs")
        lines.append(f"cache {settings.cache.key}: {eff.num_full_layers} full-attention layer"
                     f"{'' if eff.num_full_layers == 1 else 's'} hold at most {cap:,} tokens ({what}): the KV cache "
                     f"is flat from {cap:,} tokens on")
    if result.parallel:
        lines += describe(result.parallel[0].layout)
    lines.append("")
    header = ("context", "KV cache", "weights", "activations (peak)", "total")
    if result.parallel:
        header = ("context", "GPU", *(f"{h} per GPU" for h in header[1:]))
    table = [header]
    beyond = False
    for i, p in enumerate(result.rows):
        mark = ""
        if p.context > spec.max_position_embeddings:
            mark, beyond = "*", True
        if result.parallel:
            par = result.parallelism
            for st, sp in zip(result.parallel[i].layout.stages, result.parallel[i].per_stage):
                b = sp.breakdown
                gpus = (f"{st.index * par.tensor}-{(st.index + 1) * par.tensor - 1}" if par.tensor > 1 else str(st.index))
                table.append((f"{p.context:,}{mark}" if st.index == 0 else "", gpus, bytes_cell(b.kv_cache or 0),
                              bytes_cell(b.weights or 0), bytes_cell(b.activations or 0), bytes_cell(sp.total)))
            continue
        b = p.breakdown
        table.append((f"{p.context:,}{mark}", bytes_cell(b.kv_cache or 0), bytes_cell(b.weights or 0),
                      bytes_cell(b.activations or 0), bytes_cell(p.total)))
    lines += aligned(table)
    lines.append("")
    if beyond:
        lines.append(f"* beyond the model's trained maximum of {spec.max_position_embeddings:,} tokens")
    if result.overtakes_at is not None:
        lines.append(f"The KV cache overtakes the weights at {result.overtakes_at:,} tokens.")
    else:
        lines.append("The KV cache stays smaller than the weights at every context up to 16M tokens.")
    if result.gpu_memory is not None:
        if result.max_context is None:
            weights = (max(sp.breakdown.weights or 0 for sp in result.parallel[0].per_stage) if result.parallel
                       else result.rows[0].breakdown.weights or 0 if result.rows else None)
            per = " per GPU" if result.parallel else ""
            lines.append(f"Does not fit in {human_bytes(result.gpu_memory)}{per} even at 1 token (the weights alone need "
                         f"{human_bytes(weights) if weights is not None else '?'}{per}).")
        else:
            note = ""
            if result.max_context > spec.max_position_embeddings:
                note = f" (beyond the model's trained maximum of {spec.max_position_embeddings:,})"
            per = f" on each of {result.parallelism.gpus} GPUs" if result.parallel else ""
            if result.max_context >= SEARCH_LIMIT:  # issue 38: the search's own limit was shown as the answer
                note = f" or more (the search stops there){note}"
            lines.append(f"Largest context that fits in {human_bytes(result.gpu_memory)} ({result.gpu_memory:,} B){per}: "
                         f"{result.max_context:,} tokens{note}.")
    if result.serving is not None:
        lines += ["", *render_serving(result.serving)]
    return "\n".join(lines)


def render_json(result: CalcResult) -> str:
    return json.dumps(result.to_json())


def _kernel_text(spec, attn_impl: str) -> str:
    actual = spec.kernel_for(attn_impl)
    if actual == attn_impl:
        return attn_impl
    return f"{actual} ({attn_impl} asked; transformers runs {spec.model_type} with eager attention only)"

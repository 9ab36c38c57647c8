"""The memory predictor: bytes of weights, KV cache and activations for a spec and run settings.

KV bytes are exact (they mirror transformers' cache classes, see ``kvscope.core.model.caches``). Weight bytes are
exact for the parameters (count from a meta-device build). Activations are what the largest moment of reaching the
context holds beyond the weights and the KV: the prefill's and the last decode step's peaks as the activation replay
follows them allocation by allocation (``kvscope.core.prediction.replay``, checked against the allocator), on a GPU
or on the CPU for a thread count; the older rough sum (``activation_bytes``) only where the replay cannot go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvscope.core.model.caches import kv_layout
from kvscope.core.model.settings import RunSettings, effective_spec
from kvscope.core.model.spec import ModelSpec, SettingsError, dtype_bytes
from kvscope.core.model.states import state_bytes
from kvscope.core.prediction.replay.heap import PrefillPeak
from kvscope.core.prediction.replay.registry import recipe_for
from kvscope.core.prediction.replay.shapes import new_pass

FP32 = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory in bytes, split the same way for predictions and observations.

    ``other`` is what is neither weights, KV nor activations (runtime context, allocator slack);
    predictions leave it 0. A part that could not be measured is None, never 0.
    """

    weights: int | None
    kv_cache: int | None
    activations: int | None
    other: int | None = 0

    @property
    def total(self) -> int:
        return sum(v for v in (self.weights, self.kv_cache, self.activations, self.other) if v)


@dataclass(frozen=True)
class Prediction:
    """A predicted breakdown, with the activation peaks of prefill and of one decode step."""

    context: int
    breakdown: MemoryBreakdown
    activations_prefill: int
    activations_decode: int
    kv_bytes_per_token: float
    #: Where the activations come from: "replay" (the forward pass replayed allocation by allocation, the peaks an
    #: allocator reads), "replay, approximate" (replayed, but the model type or the cache is one the replay does
    #: not follow op by op: a Llama layer's, or a dynamic cache's concatenation), "estimate" (the rough sum).
    activations_source: str = "estimate"

    @property
    def total(self) -> int:
        return self.breakdown.total


def weight_bytes(spec: ModelSpec, settings: RunSettings) -> int:
    """Bytes of the parameters (count, meta-device exact and adjusted for K/V head changes, x dtype size)
    plus the model's buffers (rotary tables, in the dtype they are built in)."""
    eff = effective_spec(spec, settings)
    return int(eff.num_parameters * dtype_bytes(settings.weight_dtype or spec.dtype)) + eff.buffer_bytes


def kv_elem_bytes(spec: ModelSpec, settings: RunSettings) -> float:
    """Bytes per cached element: the KV dtype if set, else the weights' dtype (what HF caches store)."""
    return dtype_bytes(settings.kv_dtype or settings.weight_dtype or spec.dtype)


def kv_bytes(spec: ModelSpec, settings: RunSettings, tokens: int, prompt_tokens: int | None = None) -> int:
    """Exact bytes the cache holds after ``tokens`` tokens (``prompt_tokens`` of them in the prefill).

    The classic formula 2 x layers x kv_heads x head_dim x tokens x batch x bytes is the dynamic
    full-attention case; windows, preallocation, quantization and MLA are handled per layer. Layers that
    keep fixed-size states beside (or instead of) K/V add them, in the model's dtype (``kvscope.core.model.states``).
    """
    eff = effective_spec(spec, settings)
    return settings.cache.kv_bytes(
        kv_layout(eff), settings.batch, tokens, kv_elem_bytes(spec, settings),
        max_context=settings.max_context or tokens, prompt_tokens=prompt_tokens,
    ) + state_bytes(eff.layer_states, settings.batch, dtype_bytes(settings.weight_dtype or spec.dtype), tokens)


def activation_bytes(spec: ModelSpec, settings: RunSettings, q_len: int, kv_len: int) -> int:
    """Peak transient bytes of one forward pass over ``q_len`` new tokens attending to ``kv_len``.

    - eager (transformers ``eager_attention_forward``): scores = q @ k^T is materialised as
      [batch, heads, q_len, kv_len] in the model dtype and softmax runs in fp32
      (``softmax(..., dtype=torch.float32)``), so both exist at once in one layer: b*h*q*kv*(dtype+4).
    - sdpa / flash: fused kernels never hold the q x kv matrix; their working set is the output
      and the log-sum-exp rows, b*h*q*(head_dim + 1) fp32.
    Around that: the residual stream and normed copy (2 x b*q*hidden), q/k/v projections, the MLP's
    gate and up projections (2 x b*q*intermediate) and fp32 logits for the last position only
    (generation passes logits_to_keep=1). A sink or h2o cache bounds the keys a decode step attends
    (the prompt's own pass attends every prompt token: eviction follows it).
    """
    eff = effective_spec(spec, settings)
    b = settings.batch
    dt = dtype_bytes(settings.weight_dtype or spec.dtype)
    heads = eff.num_query_heads
    head_dim = eff.head_dim
    inter = spec.intermediate_size
    # Keys one query row attends, in the layer that attends the most: a full layer all ``kv_len`` (a
    # token-selecting cache at most its capacity, plus the new tokens), a sliding layer its window.
    capacity = settings.cache.capacity
    spans = []
    if eff.num_full_layers or not eff.sliding_window:
        spans.append(kv_len if capacity is None else min(kv_len, capacity + q_len))
    if eff.num_sliding_layers and eff.sliding_window:
        spans.append(min(kv_len, eff.sliding_window + q_len))
    attended = max(spans)
    if spec.kernel_for(settings.attn_impl) == "eager":
        attention = b * heads * q_len * attended * (dt + FP32)
    else:
        attention = b * heads * q_len * (head_dim + 1) * FP32
    qkv = b * q_len * (heads + 2 * eff.num_kv_heads) * head_dim * dt
    stream = 2 * b * q_len * spec.hidden_size * dt
    mlp = 2 * b * q_len * inter * dt
    logits = b * spec.vocab_size * FP32
    return int(stream + max(attention + qkv, mlp) + logits)


def predict(spec: ModelSpec, settings: RunSettings, context: int, prompt_tokens: int | None = None,
            device: str = "cuda", cpu_threads: int = 1) -> Prediction:
    """Predicted memory after ``context`` tokens: weights + KV + activations, the activations being what the
    largest moment of getting there holds beyond the weights and the KV of ``context`` tokens (never below 0).

    ``prompt_tokens`` is how much of the context came in the prefill (default: all of it, as a calculator's "load a
    context of N tokens" means). The two moments (``peak_moments``): the prefill of the prompt on an empty cache,
    weights + its replayed peak; the decode step that reaches ``context``, weights + the cache it starts from + its
    replayed peak. ``device`` ("cuda": a GPU's allocator, no CPU kernel buffers; "cpu") and ``cpu_threads`` (the CPU
    sdpa kernel's buffers are per thread) say where the pass runs. A spec the replay cannot follow gets the rough
    sum (``activation_bytes``), said in ``activations_source``.
    """
    prompt = context if prompt_tokens is None else min(prompt_tokens, context)
    weights = weight_bytes(spec, settings)
    kv = kv_bytes(spec, settings, context, prompt)
    try:
        prefill_moment, decode_moment, exact = peak_moments(spec, settings, context, prompt, device, cpu_threads)
    except SettingsError:
        raise
    except (ValueError, ZeroDivisionError):  # a spec the replay cannot build a pass for: the rough sum
        act_prefill = activation_bytes(spec, settings, prompt, prompt) if prompt > 0 else 0
        act_decode = activation_bytes(spec, settings, 1, context)
        activations, source = max(act_prefill, act_decode), "estimate"
    else:
        act_prefill = max(prefill_moment - kv, 0)
        act_decode = max(decode_moment - kv, 0)
        activations, source = max(act_prefill, act_decode), "replay" if exact else "replay, approximate"
    return Prediction(
        context=context,
        breakdown=MemoryBreakdown(weights=weights, kv_cache=kv, activations=activations),
        activations_prefill=act_prefill,
        activations_decode=act_decode,
        kv_bytes_per_token=kv / context if context else 0.0,
        activations_source=source,
    )


def peak_moments(spec: ModelSpec, settings: RunSettings, context: int, prompt: int, device: str = "cuda",
                 cpu_threads: int = 1) -> tuple[int, int, bool]:
    """The bytes beyond the weights at the two largest moments of reaching ``context`` tokens, ``prompt`` of them in
    the prefill, and whether the replay follows both exactly: (prefill, decode, exact).

    - The prefill: its replayed peak above the weights and an empty dynamic cache (the K/V it writes included); for
      a cache that holds other than what it was given (a static cache's preallocation, a token-selecting or
      quantized cache), the pass's temporaries at its peak (``PrefillPeak.transient``) on top of the cache it leaves.
    - A decode step: the one that made the last token (on the cache of ``context - 1`` tokens), or, when the whole
      context is the prefill's (``prompt == context``, a calculator's context), the first step after it (on the cache
      of ``context``): the cache it starts from plus its replayed peak above that (the grown K/V of one layer held
      twice while the cat runs, the 1 x past scores in eager). A token-selecting cache's step attends its capacity,
      not the context (``past_tokens`` capped there).
    The replay follows a dynamic cache's concatenation and a sink cache's (on full-attention layers); ``exact`` is
    False for any other cache, a model type the replay lends a Llama layer, or a step past a sliding window."""
    # the caches the replay follows as they allocate: a dynamic cache, a sink or h2o cache on full-attention layers
    dynamic = settings.cache.name == "dynamic" or (settings.cache.name in ("sink", "h2o") and not
                                                   effective_spec(spec, settings).num_sliding_layers)
    prefill_bytes = 0
    exact = dynamic
    if prompt > 0:
        pre = prefill_peak(spec, settings, prompt, device=device, cpu_threads=cpu_threads)
        prefill_bytes = pre.peak if dynamic else kv_bytes(spec, settings, prompt, prompt) + pre.transient
        exact = exact and pre.exact
    past = context - 1 if context > prompt else context
    capacity = settings.cache.capacity
    step = decode_peak(spec, settings, past if capacity is None else min(past, capacity), device=device,
                       cpu_threads=cpu_threads)
    decode_bytes = kv_bytes(spec, settings, past, min(prompt, past)) + step.peak
    exact = exact and step.exact
    return prefill_bytes, decode_bytes, exact


def max_context_that_fits(spec: ModelSpec, settings: RunSettings, memory_bytes: int, limit: int | None = None,
                          device: str = "cuda", cpu_threads: int = 1) -> int | None:
    """Largest context (tokens) whose predicted total (``predict`` on ``device`` with ``cpu_threads``: the replayed
    peaks) fits in ``memory_bytes``; None if not even one token.

    Static caches preallocate their max context, so that is tied to the context being tried.
    """
    hi_limit = limit or max(spec.max_position_embeddings, 1)

    def fits(n: int) -> bool:
        s = settings.with_(max_context=n) if settings.cache.name == "static" else settings
        return predict(spec, s, n, device=device, cpu_threads=cpu_threads).total <= memory_bytes

    if not fits(1):
        return None
    return last_true(fits, 1, hi_limit)


def kv_overtakes_weights_at(spec: ModelSpec, settings: RunSettings, limit: int = 1 << 24) -> int | None:
    """Smallest context at which the KV cache holds more bytes than the weights (None below ``limit``)."""
    weights = weight_bytes(spec, settings)

    def over(n: int) -> bool:
        s = settings.with_(max_context=n) if settings.cache.name == "static" else settings
        return kv_bytes(spec, s, n) > weights

    if not over(limit):
        return None
    return last_true(lambda n: not over(n), 0, limit) + 1


def last_true(holds, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] for which ``holds(n)``, given that it holds at ``lo`` and, once it
    fails, fails for every larger n (memory grows with the context). Bisection: log2(hi - lo) calls."""
    if holds(hi):
        return hi
    while hi - lo > 1:  # holds(lo), not holds(hi)
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------------------------------
# The prefill peak: the allocations of transformers' forward pass, replayed in order (kvscope.core.prediction.replay)


def prefill_peak(spec: ModelSpec, settings: RunSettings, prompt_tokens: int, device: str = "cpu",
                 cpu_threads: int = 1, past_tokens: int = 0,
                 matmul_scratch: Callable[..., int] | None = None) -> PrefillPeak:
    """The prefill's peak, in bytes above what was held before the forward call (the weights, the empty cache),
    for the call ``generate()`` makes: ``model(input_ids, cache=DynamicCache(), use_cache=True,
    logits_to_keep=1)``. With ``past_tokens``, the same for ``prompt_tokens`` new tokens (1: a decode step) on a
    dynamic cache that already holds ``past_tokens`` (its per-layer cat allocates the grown K/V, then frees the old).
    A sink cache (``sink:S+W``) on a model of full-attention layers is replayed as ``SinkWindowLayer`` runs: the whole
    cat, and past its S + W tokens the kept sinks and window beside it to the end of the layer's attention (it holds
    at most S + W of ``past_tokens``); an h2o cache (``h2o:B+W``) as ``HeavyHitterLayer`` runs: its scores, and the
    forward hook's sums of the attention weights and eviction by gathers (``replay.blocks.h2o_observe``).

    The forward pass of transformers 5.24 is replayed tensor by tensor by the model type's recipe
    (``kvscope.core.prediction.replay.RECIPES``; Llama's layer for a type without one, ``exact`` False): the
    embeddings (held to the end), the positions, the causal mask (eager: [b, 1, s, s] in the model dtype; sdpa:
    none, it runs causal), the rotary cos/sin, then per decoder layer the norms' temporaries, q/k/v, rotary's
    rotate_half copies, the cache's concatenations (``DynamicLayer.update`` copies K/V into the cache), the attention
    (eager: repeat_kv copies, scores x scaling + mask, an fp32 softmax and its cast back, kept alive to the end
    of the layer by the ``hidden_states, _ = self_attn(...)`` binding; sdpa on the CPU: its flash kernel's
    per-thread buffers, ``cpu_threads`` of them), o_proj, the residual add and the MLP; last the final norm and
    lm_head on the last position. ``matmul_scratch(batch, m, k, n, transposed)``, when given, is the scratch one
    matmul of that shape allocates and frees inside the call (oneDNN's, in bf16/fp16 on the CPU: the engine asks
    the library, ``kvscope.core.runtimes.transformers.peak.matmul_scratch``); without it none is counted (a GPU's cuBLAS workspace is not
    PyTorch's allocator's, and fp32 on the CPU has none). Not counted: sub-kilobyte position tensors.
    """
    eff = effective_spec(spec, settings)
    dtype = settings.weight_dtype or spec.dtype
    kv_dt = kv_elem_bytes(spec, settings)
    recipe, own = recipe_for(spec.model_type)
    cache = settings.cache
    # A sink cache on a model of full-attention layers only is replayed as its layers run (SinkWindowLayer); else the
    # replay's cache is a dynamic one's.
    sink = (cache.sinks, cache.window) if cache.name == "sink" and not eff.num_sliding_layers else None
    h2o = (cache.budget, cache.window) if cache.name == "h2o" and not eff.num_sliding_layers else None
    if sink is not None or h2o is not None:
        past_tokens = min(past_tokens, sum(sink or h2o))  # what the cache holds of them
    # Every layer slides: DynamicSlidingWindowLayer holds at most W - 1 of the past tokens, and a step cats one onto
    # those (eager's step then equals the allocator's; sdpa's with a window is not followed yet).
    slides_past = bool(past_tokens and eff.num_sliding_layers and not eff.num_full_layers and eff.sliding_window)
    if slides_past:
        past_tokens = min(past_tokens, eff.sliding_window - 1)
    run = new_pass(spec, eff, settings.batch, dtype, kv_dt, spec.kernel_for(settings.attn_impl), prompt_tokens,
                   past_tokens, device=device, threads=cpu_threads, matmul_scratch=matmul_scratch, sink=sink, h2o=h2o)
    logits = recipe.replay(run)
    # A decode step on sliding layers: followed where every layer slides, past the window, in eager; else not exact.
    kernel = spec.kernel_for(settings.attn_impl)
    exact = own and (not (past_tokens and eff.num_sliding_layers) or (slides_past and kernel == "eager"))
    # An h2o step past the capacity: followed on Llama, 256 B to 16 KB short on GPT-NeoX's (tests/test_transformers_total)
    exact = exact and not (h2o is not None and past_tokens)
    heap = run.heap
    return PrefillPeak(peak=heap.peak, end=heap.now, where=heap.where, exact=exact, logits=logits)


def decode_peak(spec: ModelSpec, settings: RunSettings, past_tokens: int, device: str = "cpu", cpu_threads: int = 1,
                matmul_scratch: Callable[..., int] | None = None) -> PrefillPeak:
    """One decode step's peak, in bytes above the weights and the cache of ``past_tokens`` it starts from: the same
    replay as ``prefill_peak`` for one new token (the cache's cat holds one layer's K/V twice for a moment, the
    1 x past scores in eager). ``exact`` is False where the replay does not follow the model or the cache."""
    return prefill_peak(spec, settings, 1, device=device, cpu_threads=cpu_threads, past_tokens=past_tokens,
                        matmul_scratch=matmul_scratch)


def forward_activations(spec: ModelSpec, settings: RunSettings, new_tokens: int, past_tokens: int = 0,
                        device: str = "cpu", cpu_threads: int = 1,
                        matmul_scratch: Callable[..., int] | None = None) -> int:
    """Bytes one forward pass of ``new_tokens`` on a cache of ``past_tokens`` holds at its peak beyond the weights
    and the cache it leaves (``PrefillPeak.transient``): weights + KV after the pass + this is the predicted
    total of that moment, what a device allocator's peak counter reads for the step. A prefill: ``past_tokens``
    0; a decode step: ``new_tokens`` 1."""
    return prefill_peak(spec, settings, new_tokens, device=device, cpu_threads=cpu_threads, past_tokens=past_tokens,
                        matmul_scratch=matmul_scratch).transient

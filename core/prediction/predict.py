"""The memory predictor: bytes of weights, KV cache and activations for a spec and run settings.

KV bytes are exact (they mirror transformers' cache classes, see ``kvscope.core.model.caches``). Weight bytes are
exact for the parameters (count from a meta-device build). Activations are the peak of the
transient tensors of one forward pass, an estimate whose dominant term (eager's scores) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvscope.core.model.caches import kv_layout
from kvscope.core.model.settings import RunSettings, effective_spec
from kvscope.core.model.spec import ModelSpec, dtype_bytes
from kvscope.core.model.states import state_bytes

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


def predict(spec: ModelSpec, settings: RunSettings, context: int, prompt_tokens: int | None = None) -> Prediction:
    """Predicted memory after ``context`` tokens: weights + KV + the larger of the prefill and decode peaks.

    ``prompt_tokens`` is how much of the context came in the prefill (default: all of it, as a
    calculator's "load a context of N tokens" means).
    """
    prompt = context if prompt_tokens is None else min(prompt_tokens, context)
    weights = weight_bytes(spec, settings)
    kv = kv_bytes(spec, settings, context, prompt)
    act_prefill = activation_bytes(spec, settings, prompt, prompt) if prompt > 0 else 0
    act_decode = activation_bytes(spec, settings, 1, context)
    return Prediction(
        context=context,
        breakdown=MemoryBreakdown(weights=weights, kv_cache=kv, activations=max(act_prefill, act_decode)),
        activations_prefill=act_prefill,
        activations_decode=act_decode,
        kv_bytes_per_token=kv / context if context else 0.0,
    )


def max_context_that_fits(spec: ModelSpec, settings: RunSettings, memory_bytes: int, limit: int | None = None) -> int | None:
    """Largest context (tokens) whose predicted total fits in ``memory_bytes``; None if not even one token.

    Static caches preallocate their max context, so that is tied to the context being tried.
    """
    hi_limit = limit or max(spec.max_position_embeddings, 1)

    def fits(n: int) -> bool:
        s = settings.with_(max_context=n) if settings.cache.name == "static" else settings
        return predict(spec, s, n).total <= memory_bytes

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
# The prefill peak: the allocations of transformers' forward pass, replayed in order

#: Model types whose decoder layers this replay follows op by op (transformers 5.24's modeling code);
#: others get the Llama layer, the nearest shape (``PrefillPeak.exact`` is False for them).
_LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "phi", "olmo", "granite",
                         "starcoder2", "stablelm", "cohere", "glm", "helium", "gemma2", "olmo2"})

_FUSED_QKV = frozenset({"gpt_neox", "phi3"})
_LAYER_NORM = frozenset({"gpt_neox", "phi", "starcoder2", "stablelm"})
_PARALLEL = frozenset({"gpt_neox", "phi"})
_FUSED_GATE_UP = frozenset({"phi3", "glm"})
_DENSE_MLP = frozenset({"gpt_neox", "phi", "starcoder2"})
#: Rotary in fp32 on q and k of a bf16/fp16 model (``rope_upcast``): OLMo's fp32 cos/sin promote the products, Cohere
#: copies q and k with .float() first; each mixed-dtype multiply casts its other operand in a temporary.
_FP32_ROPE = frozenset({"cohere", "olmo", "olmo2"})
#: Norms after the attention and after the MLP, on their outputs (Gemma 2: beside the two before; OLMo 2: instead).
_POST_NORMS = frozenset({"gemma2", "olmo2"})


@dataclass(frozen=True)
class PrefillPeak:
    """The most bytes the prefill's forward pass holds at once beyond the weights (``peak``), and what it
    holds when it returns (``end``: the KV it wrote and the logits of the last position).

    ``where`` names the moment of the peak (e.g. "layer 2 softmax"), ``exact`` says whether the replay
    follows this model type's own code (False: the Llama layer stood in for it)."""

    peak: int
    end: int
    where: str
    exact: bool
    logits: int = 0  # of ``end``: the logits returned (the rest is the KV the pass added)

    @property
    def transient(self) -> int:
        """The peak less the KV the pass added: bytes beyond the weights and the cache it leaves (its temporaries
        at the peak, the logits included)."""
        return self.peak - (self.end - self.logits)


class _Heap:
    """Bytes held by live tensors, and the high-water mark, as allocations and frees come in order."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.where = ""
        self.at = ""

    def alloc(self, n: int) -> int:
        self.now += n
        if self.now > self.peak:
            self.peak, self.where = self.now, self.at
        return n

    def free(self, *sizes: int) -> None:
        self.now -= sum(sizes)


def _cfg(spec: ModelSpec, *names: str, default: Any = None) -> Any:
    for name in names:
        value = spec.config.get(name)
        if value is not None:
            return value
    return default


def _sdpa_cpu_buffers(b: int, heads: int, q: int, kv: int, head_dim: int, dt: int, threads: int) -> tuple[int, int]:
    """Working buffers of PyTorch's CPU flash-attention kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
    ``cpu_flash_attention``): per thread one fp32 block of qSplit x kvSplit scores plus the running max, sum and
    qSplit x head_dim output rows; for bf16/fp16 a second block of the scores in the input dtype. Returns
    (fp32 buffer, reduced-type buffer) bytes. The logsumexp rows [b, heads, q] fp32 come on top."""
    q_split = 256 if q >= 768 else (64 if q >= 192 else 32)
    kv_split = 512 if kv >= 512 else kv
    q_split, kv_split = min(q_split, q), min(kv_split, kv)
    per_thread = q_split * kv_split + q_split + q_split + q_split * head_dim
    buf = threads * per_thread * FP32
    reduced = threads * q_split * kv_split * dt if dt != FP32 else 0
    return buf, reduced


def prefill_peak(spec: ModelSpec, settings: RunSettings, prompt_tokens: int, device: str = "cpu",
                 cpu_threads: int = 1, past_tokens: int = 0,
                 matmul_scratch: Callable[..., int] | None = None) -> PrefillPeak:
    """The prefill's peak, in bytes above what was held before the forward call (the weights, the empty cache),
    for the call ``generate()`` makes: ``model(input_ids, cache=DynamicCache(), use_cache=True,
    logits_to_keep=1)``. With ``past_tokens``, the same for ``prompt_tokens`` new tokens (1: a decode step) on a
    dynamic cache that already holds ``past_tokens`` (its per-layer cat allocates the grown K/V, then frees the old).

    The forward pass of transformers 5.24 is replayed tensor by tensor (``_Heap``): the embeddings (held to the
    end), the positions, the causal mask (eager: [b, 1, s, s] in the model dtype; sdpa: none, it runs causal),
    the rotary cos/sin, then per decoder layer the RMSNorm's fp32 temporaries, q/k/v, rotary's rotate_half
    copies, the cache's concatenations (``DynamicLayer.update`` copies K/V into the cache), the attention
    (eager: repeat_kv copies, scores x scaling + mask, an fp32 softmax and its cast back, kept alive to the end
    of the layer by the ``hidden_states, _ = self_attn(...)`` binding; sdpa on the CPU: its flash kernel's
    per-thread buffers, ``cpu_threads`` of them), o_proj, the residual add and the MLP; last the final norm and
    lm_head on the last position. ``matmul_scratch(batch, m, k, n, transposed)``, when given, is the scratch one
    matmul of that shape allocates and frees inside the call (oneDNN's, in bf16/fp16 on the CPU: the engine asks
    the library, ``kvscope.core.runtimes.transformers.peak.matmul_scratch``); without it none is counted (a GPU's cuBLAS workspace is not
    PyTorch's allocator's, and fp32 on the CPU has none). Not counted: sub-kilobyte position tensors.
    """
    eff = effective_spec(spec, settings)
    b, s = settings.batch, prompt_tokens
    kv = past_tokens + s  # keys each new token attends (a decode step: s = 1)
    dt = dtype_bytes(settings.weight_dtype or spec.dtype)
    kv_dt = kv_elem_bytes(spec, settings)
    H, V, I = spec.hidden_size, spec.vocab_size, spec.intermediate_size
    heads, kvh, hd = eff.num_query_heads, eff.num_kv_heads, eff.head_dim
    kernel = spec.kernel_for(settings.attn_impl)
    eager = kernel == "eager"
    mt = spec.model_type
    # A decode step on sliding layers past their window: DynamicSlidingWindowLayer keeps W - 1 tokens, not replayed.
    exact = mt in _LLAMA_LIKE and not (past_tokens and eff.num_sliding_layers)
    fp32_rope = mt in _FP32_ROPE and dt != FP32
    heap = _Heap()

    def mm(out: int, m: int, k: int, n: int, batch: int = 1, transposed: bool = True) -> int:
        """A matmul's output (left allocated), and the scratch the library takes and gives back inside the call."""
        o = heap.alloc(out)
        if matmul_scratch is not None and dt != FP32:
            heap.free(heap.alloc(matmul_scratch(batch, m, k, n, transposed)))
        return o

    A = A_ = b * s * H * dt  # one hidden-state tensor
    A32 = A32_ = b * s * H * FP32
    row32 = b * s * FP32  # one fp32 scalar per token (RMSNorm's variance)
    Q, K = b * heads * s * hd * dt, b * kvh * s * hd * dt
    Kc = b * kvh * kv * hd * kv_dt  # the cache's new tensor of one layer's keys (values the same)
    Kc_old = b * kvh * past_tokens * hd * kv_dt  # the one it replaces (held before the call)
    rope_parameters = spec.config.get("rope_parameters")
    factor = _cfg(spec, "partial_rotary_factor", "rotary_pct") or (
        rope_parameters.get("partial_rotary_factor") if isinstance(rope_parameters, dict) else None)
    rotary = int(hd * float(factor or 1.0))
    rotary -= rotary % 2

    # -- model prologue
    heap.at = "embeddings"
    E = heap.alloc(A)
    heap.alloc(s * 8)  # position ids (int64 arange + past length)
    mask = 0
    if eager:
        heap.at = "causal mask"
        # a model with both kinds of layers builds a full and a sliding mask (Gemma 2's causal_mask_mapping)
        for _ in range(2 if eff.num_sliding_layers and eff.num_full_layers else 1):
            tmp = heap.alloc(b * s * kv)  # the boolean mask
            mask += heap.alloc(b * s * kv * dt)  # torch.where into the additive float mask
            heap.free(tmp)
    heap.at = "rotary embedding"
    pos32, inv32 = heap.alloc(b * s * FP32), heap.alloc(b * (rotary // 2) * FP32)
    freqs = heap.alloc(b * s * (rotary // 2) * FP32)
    heap.free(pos32, inv32)
    emb = heap.alloc(b * s * rotary * FP32)
    cs32 = [heap.alloc(b * s * rotary * FP32) for _ in range(2)]  # cos() and sin() x attention_scaling
    cos_sin = 2 * b * s * rotary * dt
    if mt in ("olmo", "olmo2"):  # their rotary embeddings return cos and sin in fp32 (no cast to the model's dtype)
        cos_sin = sum(cs32)
    elif dt != FP32:
        heap.alloc(cos_sin)
        heap.free(*cs32)
    heap.free(emb, freqs)

    def rms_norm(n: int = 0) -> int:
        """LlamaRMSNorm on a held [b, s, n / s] tensor of ``n`` bytes (default one hidden state); returns the bytes of
        its output (left allocated). OLMo 2 multiplies by the weight in fp32 and casts last."""
        A, A32 = (n, n // dt * FP32) if n else (A_, A32_)  # noqa: N806
        up = heap.alloc(A32) if dt != FP32 else 0  # hidden_states.to(float32)
        sq = heap.alloc(A32)  # pow(2)
        var = heap.alloc(row32)  # mean
        heap.free(sq)
        eps = heap.alloc(row32)
        r = heap.alloc(row32)  # rsqrt
        heap.free(eps)
        normed32 = heap.alloc(A32)
        heap.free(r)
        if up:
            heap.free(up)
        if mt == "olmo2":  # (self.weight * hidden_states).to(input_dtype)
            if dt == FP32:
                out = heap.alloc(A)
            else:
                weighted = heap.alloc(A32)
                out = heap.alloc(A)
                heap.free(weighted)
            heap.free(normed32, var)
            return out
        down = heap.alloc(A) if dt != FP32 else 0  # .to(input_dtype)
        out = heap.alloc(A)  # weight * hidden
        heap.free(down, normed32, var)
        return out

    def rope(n: int) -> int:
        """apply_rotary_pos_emb on one held [b, heads, s, hd] tensor of ``n`` bytes: x*cos + rotate_half(x)*sin."""
        a = heap.alloc(n)  # x * cos
        neg = heap.alloc(n // 2)  # -x2
        cat = heap.alloc(n)  # cat(-x2, x1)
        heap.free(neg)
        c = heap.alloc(n)  # * sin
        heap.free(cat)
        out = heap.alloc(n)  # add
        heap.free(c, a)
        return out

    fused_qkv = mt in _FUSED_QKV
    post_norms = mt in _POST_NORMS
    softcap = _cfg(spec, "attn_logit_softcapping")
    layer_norm = mt in _LAYER_NORM
    parallel = bool(_cfg(spec, "use_parallel_residual", default=mt == "phi")) if mt in _PARALLEL else False
    mlp_kind = "gated-fused" if mt in _FUSED_GATE_UP else ("dense" if mt in _DENSE_MLP else "gated")
    window = eff.sliding_window if eff.num_sliding_layers else None
    gelu_formula = _cfg(spec, "hidden_act", "activation_function", default="") in ("gelu_new", "gelu_fast")
    sdpa_mask = 0
    if not eager and window is not None and kv > window - 1:
        heap.at = "causal mask"
        sdpa_mask = heap.alloc(b * s * kv)  # a window that bites: sdpa gets a boolean mask, not is_causal

    def norm() -> int:
        if mt == "olmo":  # OlmoLayerNorm: F.layer_norm on an fp32 copy, no weight, cast back
            up = heap.alloc(A32) if dt != FP32 else 0
            out32 = heap.alloc(A32)
            heap.free(heap.alloc(row32), heap.alloc(row32))  # native_layer_norm's mean and rstd rows
            heap.free(up)
            if dt == FP32:
                return out32
            out = heap.alloc(A)
            heap.free(out32)
            return out
        if not layer_norm:
            return rms_norm(0)
        out = heap.alloc(A)  # native_layer_norm's output, and its mean and rstd rows
        heap.free(heap.alloc(row32), heap.alloc(row32))
        return out

    def rope_upcast(nq: int, nk: int) -> tuple[int, int]:
        """Rotary in fp32 on q and k of the model's dtype (``nq``, ``nk`` bytes), cast back at the return: OLMo's
        apply_rotary_pos_emb (q * fp32 cos promotes; rotate_half stays in the model's dtype), Cohere's (q.float() and
        k.float() first, its interleaved rotate_half on the fp32 copies)."""
        up = dt and FP32 // dt
        copies = [heap.alloc(n * up) for n in (nq, nk)] if mt == "cohere" else []
        embeds = []
        for n in (nq, nk):
            half = n * up // 2 if copies else n // 2  # -x2 (and the cat/stack) in the dtype rotate_half gets
            # A mixed-dtype multiply casts its other-dtype operand to fp32 in a temporary inside the op: OLMo's
            # q/k (and the rotated halves), Cohere's cos/sin.
            cast = b * s * rotary * FP32 if copies else n * up
            a = heap.alloc(n * up)  # x * cos, fp32
            heap.free(heap.alloc(cast))
            neg = heap.alloc(half)
            cat = heap.alloc(2 * half)
            heap.free(neg)
            c = heap.alloc(n * up)  # rotate_half(x) * sin, fp32
            heap.free(heap.alloc(cast))
            heap.free(cat)
            embeds.append(heap.alloc(n * up))  # the sum
            heap.free(c, a)
        out = heap.alloc(nq), heap.alloc(nk)  # q_embed.to(q_type), k_embed.to(k_type)
        heap.free(*embeds, *copies)
        return out

    def rope_partial(n: int) -> int:
        """Rotary on the first ``rotary`` of ``hd`` dims, then cat(rotated, pass-through) (GPT-NeoX, Phi)."""
        if rotary >= hd:
            return rope(n)
        part = rope(n * rotary // hd)
        out = heap.alloc(n)
        if locals_hold:
            kept.append(part)
        else:
            heap.free(part)
        return out

    def mlp() -> int:
        """The MLP on a held normed input; returns its output's bytes (left allocated)."""
        inter = b * s * I * dt
        if mlp_kind == "dense":  # fc1 -> act -> fc2
            up = mm(inter, b * s, H, I)
            if gelu_formula:  # NewGELUActivation: 0.5*x*(1+tanh(c*(x+0.044715*x**3))), one temporary per op
                half, cube = heap.alloc(inter), heap.alloc(inter)
                scaled = heap.alloc(inter)
                heap.free(cube)
                for _ in range(3):  # x + ..., c * (...), tanh(...): each frees the one before
                    nxt = heap.alloc(inter)
                    heap.free(scaled)
                    scaled = nxt
                one_plus = heap.alloc(inter)
                heap.free(scaled)
                act = heap.alloc(inter)
                heap.free(half, one_plus)
            else:
                act = heap.alloc(inter)
            heap.free(up)
            down = mm(A, b * s, I, H)
            heap.free(act)
        elif mlp_kind == "gated-fused":  # gate_up_proj, chunk (views), up * act(gate), down_proj (Phi-3)
            gu = mm(2 * inter, b * s, H, 2 * I)
            act = heap.alloc(inter)
            prod = heap.alloc(inter)
            heap.free(act)
            down = mm(A, b * s, I, H)
            heap.free(prod, gu)
        else:  # down_proj(act(gate_proj(x)) * up_proj(x))
            gate = mm(inter, b * s, H, I)
            act = heap.alloc(inter)
            heap.free(gate)
            up = mm(inter, b * s, H, I)
            prod = heap.alloc(inter)
            heap.free(act, up)
            down = mm(A, b * s, I, H)
            heap.free(prod)
        return down

    # Phi's and StableLM's attention bind the rotated halves and the pass-through views to locals that live until
    # it returns.
    locals_hold = mt in ("phi", "stablelm") and rotary < hd
    attn_locals_kept = mt == "stablelm" and not parallel
    kept: list[int] = []
    h = E  # the layer's input, held by the caller's binding for the whole layer
    for layer in range(eff.num_layers):
        heap.at = f"layer {layer + 1} attention"
        normed = norm() if mt != "olmo2" else 0  # OLMo 2 projects the layer's input itself
        if fused_qkv:
            qkv = mm(Q + 2 * K, b * s, H, (heads + 2 * kvh) * hd)
            qe, ke = rope_partial(Q), rope_partial(K)
            q = k = v = 0
        else:
            qkv = 0
            if mt == "olmo2":  # q_norm(q_proj(x)), k_norm(k_proj(x)): RMSNorms over all heads, before the split
                q = mm(Q, b * s, H, heads * hd)
                qn = rms_norm(Q)
                heap.free(q)
                k = mm(K, b * s, H, kvh * hd)
                kn = rms_norm(K)
                heap.free(k)
                q, k, v = qn, kn, mm(K, b * s, H, kvh * hd)
            else:
                q, k, v = mm(Q, b * s, H, heads * hd), mm(K, b * s, H, kvh * hd), mm(K, b * s, H, kvh * hd)
            qe, ke = rope_upcast(Q, K) if fp32_rope else (rope_partial(Q), rope_partial(K))
            if locals_hold:  # Phi's query_pass/key_pass views keep q_proj's and k_proj's outputs alive
                kept.extend((q, k))
            else:
                heap.free(q, k)
        for _ in range(2):  # DynamicLayer.update: torch.cat into the cache, keys then values
            heap.alloc(Kc)
            heap.free(Kc_old)  # the tensor the cat replaced (held before the call)
        heap.free(ke, v)
        weights = 0
        groups = heads // kvh
        if eager:
            reps = [heap.alloc(b * heads * kv * hd * kv_dt) for _ in range(2)] if groups > 1 else []
            S = b * heads * s * kv * dt
            heap.at = f"layer {layer + 1} scores"
            scores = mm(S, s, hd, kv, batch=b * heads)
            scaled = heap.alloc(S)
            heap.free(scores)
            if softcap:  # / softcap, tanh, * softcap: each a new tensor, the one before freed
                for _ in range(3):
                    nxt = heap.alloc(S)
                    heap.free(scaled)
                    scaled = nxt
            masked = heap.alloc(S)
            heap.free(scaled)
            heap.at = f"layer {layer + 1} softmax"
            if dt != FP32:
                up = heap.alloc(b * heads * s * kv * FP32)
                sm = heap.alloc(b * heads * s * kv * FP32)
                heap.free(up)
                weights = heap.alloc(S)  # .to(query.dtype)
                heap.free(sm)
            else:
                weights = heap.alloc(S)
            heap.free(masked)
            heap.at = f"layer {layer + 1} attention"
            o = mm(Q, s, kv, hd, batch=b * heads, transposed=False)  # attn_weights @ v
            # transpose(1, 2).contiguous(): a copy unless the swapped dims leave it contiguous (one token, or one head)
            out = heap.alloc(Q) if s > 1 and heads > 1 else 0
            heap.free(o, *reps)
        else:
            # transformers' use_gqa_in_sdpa: with a mask, K/V are repeated to the query heads first.
            reps = [heap.alloc(b * heads * kv * hd * kv_dt) for _ in range(2)] if sdpa_mask and groups > 1 else []
            heap.at = f"layer {layer + 1} sdpa"
            # scaled_dot_product_attention turns a boolean mask into an additive one in the query's dtype
            float_mask = heap.alloc(b * s * kv * dt) if sdpa_mask else 0
            out = heap.alloc(b * s * heads * hd * dt)
            if device == "cpu":
                lse = heap.alloc(b * heads * s * FP32)
                buf, reduced = _sdpa_cpu_buffers(b, heads, s, kv, hd, dt, cpu_threads)
                heap.alloc(buf)
                heap.alloc(reduced)
                heap.free(reduced, buf, lse)
            heap.free(float_mask, *reps)
            heap.at = f"layer {layer + 1} attention"
        attn = mm(A, b * s, heads * hd, H)  # o_proj
        # StableLM binds ``self_attn_output, _ = ...`` beside its normed input: both live to the end of the layer.
        layer_locals = [normed, attn] if attn_locals_kept else []
        heap.free(out, qe, qkv, *kept, *([] if attn_locals_kept else [normed]))
        kept.clear()
        heap.at = f"layer {layer + 1} mlp"
        if post_norms:  # h2 = h + post_attention_layernorm(attn); h3 = h2 + post_feedforward_layernorm(mlp(...))
            post = norm()
            heap.free(attn)
            h2 = heap.alloc(A)
            heap.free(post)
            normed = norm() if mt != "olmo2" else 0
            down = mlp()
            heap.free(normed)
            post = norm()
            heap.free(down)
            h3 = heap.alloc(A)
            heap.free(post)
        elif parallel:  # x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX, Phi)
            normed = norm()
            down = mlp()
            heap.free(normed)
            partial = heap.alloc(A)
            h3 = heap.alloc(A)
            heap.free(partial, down, attn)
            h2 = 0
        else:
            h2 = heap.alloc(A)  # residual add
            if not attn_locals_kept:
                heap.free(attn)
            normed = norm()
            down = mlp()
            heap.free(normed)
            h3 = heap.alloc(A)
            heap.free(down)
        heap.free(h2, weights, *layer_locals)
        if layer:  # layer 0's input is the embeddings, held to the end
            heap.free(h)
        h = h3
    heap.at = "final norm and lm_head"
    normed = norm()
    # The base model returns: its locals (embeddings, positions, masks, cos/sin, the last layer's output) go
    # before the causal-LM head runs lm_head on hidden_states[:, -1:, :] (logits_to_keep=1).
    heap.free(h, E, mask, sdpa_mask, cos_sin, s * 8)
    logits = mm(b * V * dt, b, H, V)
    # the scaling and softcapping below run in the causal LM's forward, while its outputs (the normed states) live
    if mt in ("granite", "cohere"):  # logits / logits_scaling (Granite), logits * logit_scale (Cohere): a new tensor
        heap.at = "logit scaling"
        nxt = heap.alloc(logits)
        heap.free(logits)
        logits = nxt
    if _cfg(spec, "final_logit_softcapping"):  # / cap, tanh, * cap on the logits, each freeing the one before
        heap.at = "final logit softcapping"
        for _ in range(3):
            nxt = heap.alloc(logits)
            heap.free(logits)
            logits = nxt
    heap.free(normed)
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

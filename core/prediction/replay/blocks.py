"""The shared blocks of the replay (as llama.cpp's ``build_norm``, ``build_ffn``): the base model's prologue, the
norms, rotary, the MLPs, the cache's concatenation and the head, each on a ``Pass``'s heap in transformers 5.24's
order. A block leaves its output allocated and returns its bytes; the caller frees it."""

from __future__ import annotations

from kvscope.core.prediction.replay.heap import FP32
from kvscope.core.prediction.replay.shapes import Pass


def prologue(p: Pass, cos_sin_fp32: bool = False) -> None:
    """The base model before its layers: the embeddings (held to the end), the position ids, the causal mask (eager:
    [b, 1, s, kv] in the model dtype, one per kind of layer; sdpa: none, it runs causal, unless a window bites), the
    rotary cos/sin (cast to the model's dtype, or left fp32 with ``cos_sin_fp32``)."""
    heap, b, s, kv, dt, rotary = p.heap, p.b, p.s, p.kv, p.dt, p.rotary
    heap.at = "embeddings"
    p.embeddings = heap.alloc(p.A)
    heap.alloc(s * 8)  # position ids (int64 arange + past length)
    if p.eager:
        heap.at = "causal mask"
        for _ in range(p.masks):  # a model with both kinds of layers builds a full and a sliding mask
            tmp = heap.alloc(b * s * kv)  # the boolean mask
            p.mask += heap.alloc(b * s * kv * dt)  # torch.where into the additive float mask
            heap.free(tmp)
    heap.at = "rotary embedding"
    # The position ids are cache_position.unsqueeze(0), [1, s], whatever the batch: rotary's tensors are one
    # sequence's, broadcast over the batch (two sequences measured: tests/test_transformers_total.py).
    pos32, inv32 = heap.alloc(s * FP32), heap.alloc((rotary // 2) * FP32)
    freqs = heap.alloc(s * (rotary // 2) * FP32)
    heap.free(pos32, inv32)
    emb = heap.alloc(s * rotary * FP32)
    cs32 = [heap.alloc(s * rotary * FP32) for _ in range(2)]  # cos() and sin() x attention_scaling
    p.cos_sin = 2 * s * rotary * dt
    if cos_sin_fp32:
        p.cos_sin = sum(cs32)
    elif dt != FP32:
        heap.alloc(p.cos_sin)
        heap.free(*cs32)
    heap.free(emb, freqs)
    if not p.eager and p.window is not None and kv > p.window - 1:
        heap.at = "causal mask"
        p.sdpa_mask = heap.alloc(b * s * kv)  # a window that bites: sdpa gets a boolean mask, not is_causal


def rms_norm(p: Pass, n: int = 0, weight_fp32: bool = False) -> int:
    """LlamaRMSNorm on a held [b, s, n / s] tensor of ``n`` bytes (default one hidden state). With ``weight_fp32``
    (OLMo 2) the weight multiplies the fp32 states and the product is cast last."""
    heap, dt = p.heap, p.dt
    A, A32 = (n, n // dt * FP32) if n else (p.A, p.A32)  # noqa: N806
    up = heap.alloc(A32) if dt != FP32 else 0  # hidden_states.to(float32)
    sq = heap.alloc(A32)  # pow(2)
    var = heap.alloc(p.row32)  # mean
    heap.free(sq)
    eps = heap.alloc(p.row32)
    r = heap.alloc(p.row32)  # rsqrt
    heap.free(eps)
    normed32 = heap.alloc(A32)
    heap.free(r)
    if up:
        heap.free(up)
    if weight_fp32:  # (self.weight * hidden_states).to(input_dtype)
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


def layer_norm(p: Pass) -> int:
    """nn.LayerNorm on one hidden state: native_layer_norm's output, and its mean and rstd rows freed at once."""
    out = p.heap.alloc(p.A)
    p.heap.free(p.heap.alloc(p.row32), p.heap.alloc(p.row32))
    return out


def rope(p: Pass, n: int) -> int:
    """apply_rotary_pos_emb on one held [b, heads, s, hd] tensor of ``n`` bytes: x*cos + rotate_half(x)*sin."""
    heap = p.heap
    a = heap.alloc(n)  # x * cos
    neg = heap.alloc(n // 2)  # -x2
    cat = heap.alloc(n)  # cat(-x2, x1)
    heap.free(neg)
    c = heap.alloc(n)  # * sin
    heap.free(cat)
    out = heap.alloc(n)  # add
    heap.free(c, a)
    return out


def rope_partial(p: Pass, n: int, hold: bool = False) -> int:
    """Rotary on the first ``rotary`` of ``hd`` dims, then cat(rotated, pass-through) (GPT-NeoX, Phi); with
    ``hold`` the rotated part stays alive in the attention's locals (``Pass.kept``)."""
    if p.rotary >= p.hd:
        return rope(p, n)
    part = rope(p, n * p.rotary // p.hd)
    out = p.heap.alloc(n)
    if hold:
        p.kept.append(part)
    else:
        p.heap.free(part)
    return out


def rope_fp32(p: Pass, nq: int, nk: int, copies: bool) -> tuple[int, int]:
    """Rotary in fp32 on q and k of the model's dtype (``nq``, ``nk`` bytes), cast back at the return: OLMo's
    apply_rotary_pos_emb (q * fp32 cos promotes; rotate_half stays in the model's dtype), or with ``copies``
    Cohere's (q.float() and k.float() first, its interleaved rotate_half on the fp32 copies)."""
    heap = p.heap
    up = p.dt and FP32 // p.dt
    made = [heap.alloc(n * up) for n in (nq, nk)] if copies else []
    embeds = []
    for n in (nq, nk):
        half = n * up // 2 if made else n // 2  # -x2 (and the cat/stack) in the dtype rotate_half gets
        # A mixed-dtype multiply casts its other-dtype operand to fp32 in a temporary inside the op: OLMo's
        # q/k (and the rotated halves), Cohere's cos/sin.
        cast = p.s * p.rotary * FP32 if made else n * up  # cos/sin are [1, s, rotary] (see ``prologue``)
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
    heap.free(*embeds, *made)
    return out


def cache_update(p: Pass) -> None:
    """DynamicLayer.update: torch.cat into the cache, keys then values, each freeing the tensor it replaced.

    A sink cache's layer (``kvscope.core.runtimes.transformers.sparse_caches.SinkWindowLayer``) cats keys and values
    first; past its capacity it keeps a cat of the sinks and the window (keys, then values, each freeing the one it
    replaced) and returns the whole cat, which the attention's locals hold to the end of the layer's attention."""
    if p.sink is None:
        for _ in range(2):
            p.heap.alloc(p.Kc)
            p.heap.free(p.Kc_old)
        if p.h2o is not None:  # HeavyHitterLayer: the same cats, then a zero score per new token cat onto its scores
            new = p.heap.alloc(p.b * p.kvh * p.s * FP32)
            p.heap.alloc(p.b * p.kvh * p.kv * FP32)
            p.heap.free(p.b * p.kvh * p.past * FP32, new)
        return
    whole = [p.heap.alloc(p.Kc) for _ in range(2)]
    capacity = sum(p.sink)
    if p.kv > capacity:
        for _ in range(2):
            p.heap.alloc(p.b * p.kvh * capacity * p.hd * p.kv_dt)
            p.heap.free(p.Kc_old)
        p.kept.extend(whole)
    else:
        p.heap.free(p.Kc_old, p.Kc_old)


def h2o_observe(p: Pass) -> None:
    """HeavyHitterLayer.observe_attention, run by a forward hook when the attention module returns (its locals gone,
    its weights held by the layer's binding): the weights summed over the queries (an fp32 copy first in another
    dtype), then over the query heads of each KV head, added to the scores; past the capacity, ``_evict``: topk of the
    older tokens' scores and their sort, the recent positions, the kept indices, and gathers of the scores, keys and
    values (each freeing the one it replaces)."""
    if p.h2o is None:
        return
    heap, b, kvh, held = p.heap, p.b, p.kvh, p.kv
    up = heap.alloc(b * p.heads * p.s * held * FP32) if p.dt != FP32 else 0
    r1 = heap.alloc(b * p.heads * held * FP32)
    if up:
        heap.free(up)
    r2 = heap.alloc(b * kvh * held * FP32)
    heap.free(r1)
    heap.alloc(b * kvh * held * FP32)  # scores + received
    heap.free(b * kvh * held * FP32)
    budget, window = p.h2o
    capacity = budget + window
    if held > capacity:
        topk = [heap.alloc(b * kvh * budget * FP32), heap.alloc(b * kvh * budget * 8)]
        top, order = heap.alloc(b * kvh * budget * 8), heap.alloc(b * kvh * budget * 8)  # .indices.sort()
        heap.free(*topk, order)
        recent = heap.alloc(window * 8)
        keep = heap.alloc(b * kvh * capacity * 8)
        heap.alloc(b * kvh * capacity * FP32)  # scores.gather
        heap.free(b * kvh * held * FP32)
        for _ in range(2):  # keys.gather, values.gather
            heap.alloc(b * kvh * capacity * p.hd * p.kv_dt)
            heap.free(p.Kc)
        heap.free(top, recent, keep)
    heap.free(r2)


def gated_mlp(p: Pass) -> int:
    """down_proj(act(gate_proj(x)) * up_proj(x)) on a held normed input (Llama's MLP)."""
    heap, b, s = p.heap, p.b, p.s
    inter = b * s * p.I * p.dt
    gate = p.mm(inter, b * s, p.H, p.I)
    act = heap.alloc(inter)
    heap.free(gate)
    up = p.mm(inter, b * s, p.H, p.I)
    prod = heap.alloc(inter)
    heap.free(act, up)
    down = p.mm(p.A, b * s, p.I, p.H)
    heap.free(prod)
    return down


def fused_gated_mlp(p: Pass) -> int:
    """gate_up_proj, chunk (views), up * act(gate), down_proj (Phi-3's MLP, GLM's)."""
    heap, b, s = p.heap, p.b, p.s
    inter = b * s * p.I * p.dt
    gu = p.mm(2 * inter, b * s, p.H, 2 * p.I)
    act = heap.alloc(inter)
    prod = heap.alloc(inter)
    heap.free(act)
    down = p.mm(p.A, b * s, p.I, p.H)
    heap.free(prod, gu)
    return down


def dense_mlp(p: Pass, gelu_formula: bool) -> int:
    """fc1 -> act -> fc2 (GPT-NeoX's, Phi's, Starcoder2's MLP); ``gelu_formula``: NewGELUActivation's
    0.5*x*(1+tanh(c*(x+0.044715*x**3))), one temporary per op."""
    heap, b, s = p.heap, p.b, p.s
    inter = b * s * p.I * p.dt
    up = p.mm(inter, b * s, p.H, p.I)
    if gelu_formula:
        half, cube = heap.alloc(inter), heap.alloc(inter)
        scaled = heap.alloc(inter)
        heap.free(cube)
        for _ in range(3):  # x + ..., c * (...), tanh(...): each frees the one before
            scaled = replace(p, scaled)
        one_plus = heap.alloc(inter)
        heap.free(scaled)
        act = heap.alloc(inter)
        heap.free(half, one_plus)
    else:
        act = heap.alloc(inter)
    heap.free(up)
    down = p.mm(p.A, b * s, p.I, p.H)
    heap.free(act)
    return down


def replace(p: Pass, n: int) -> int:
    """An elementwise op on a tensor of ``n`` bytes that is then dropped: the new tensor, then the old one freed."""
    new = p.heap.alloc(n)
    p.heap.free(n)
    return new


def lm_head(p: Pass, h: int, normed: int) -> int:
    """The causal LM's head on the final norm's output (``normed``): the base model returns first, so its locals
    (the embeddings, positions, masks, cos/sin and the last layer's output ``h``) go; then lm_head on
    hidden_states[:, -1:, :] (logits_to_keep=1). Returns the logits' bytes."""
    p.heap.free(h, p.embeddings, p.mask, p.sdpa_mask, p.cos_sin, p.s * 8)
    return p.mm(p.b * p.V * p.dt, p.b, p.H, p.V)


def rescale_logits(p: Pass, logits: int) -> int:
    """logits / logits_scaling (Granite), logits * logit_scale (Cohere): a new tensor, the old one freed."""
    p.heap.at = "logit scaling"
    return replace(p, logits)


def softcap_logits(p: Pass, logits: int) -> int:
    """/ cap, tanh, * cap on the logits, each freeing the one before (a config's ``final_logit_softcapping``)."""
    p.heap.at = "final logit softcapping"
    for _ in range(3):
        logits = replace(p, logits)
    return logits

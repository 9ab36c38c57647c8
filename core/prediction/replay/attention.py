"""Attention per kernel, from the projected q/k/v to the heads' output (before o_proj): eager's scores and softmax,
sdpa's fused kernel (on the CPU, its flash kernel's per-thread buffers), with transformers 5.24's repeat_kv where
it runs."""

from __future__ import annotations

from kvscope.core.prediction.replay.blocks import replace
from kvscope.core.prediction.replay.heap import FP32
from kvscope.core.prediction.replay.shapes import Pass


def sdpa_cpu_buffers(b: int, heads: int, q: int, kv: int, head_dim: int, dt: int, threads: int) -> tuple[int, int]:
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


def attend(p: Pass, layer: int, softcap: float | None = None) -> tuple[int, int]:
    """The attention of one layer by the pass's kernel; returns (the attention weights the layer's binding keeps
    alive to its end, the heads' output), both left allocated. ``softcap``: eager's tanh soft-capping of the
    scores (Gemma 2's ``attn_logit_softcapping``)."""
    groups = p.heads // p.kvh
    out = eager(p, layer, groups, softcap) if p.eager else (0, sdpa(p, layer, groups))
    p.heap.at = f"layer {layer + 1} attention"
    return out


def eager(p: Pass, layer: int, groups: int, softcap: float | None) -> tuple[int, int]:
    """eager_attention_forward: repeat_kv copies, scores x scaling (+ soft-capping) + mask, an fp32 softmax and its
    cast back, attn_weights @ v and the transpose's copy."""
    heap, b, heads, s, kv, hd, dt = p.heap, p.b, p.heads, p.s, p.kv, p.hd, p.dt
    reps = [heap.alloc(b * heads * kv * hd * p.kv_dt) for _ in range(2)] if groups > 1 else []
    S = b * heads * s * kv * dt  # noqa: N806
    heap.at = f"layer {layer + 1} scores"
    scores = p.mm(S, s, hd, kv, batch=b * heads)
    scaled = heap.alloc(S)
    heap.free(scores)
    if softcap:  # / softcap, tanh, * softcap: each a new tensor, the one before freed
        for _ in range(3):
            scaled = replace(p, scaled)
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
    o = p.mm(p.Q, s, kv, hd, batch=b * heads, transposed=False)  # attn_weights @ v
    # transpose(1, 2).contiguous(): a copy unless the swapped dims leave it contiguous (one token, or one head)
    out = heap.alloc(p.Q) if s > 1 and heads > 1 else 0
    heap.free(o, *reps)
    return weights, out


def sdpa(p: Pass, layer: int, groups: int) -> int:
    """scaled_dot_product_attention (sdpa, flash): with a mask, transformers' use_gqa_in_sdpa repeats K/V to the
    query heads first and the kernel turns the boolean mask into an additive one in the query's dtype; on the CPU
    the flash kernel's logsumexp rows and per-thread buffers (``sdpa_cpu_buffers``, ``Pass.threads`` of them)."""
    heap, b, heads, s, kv, hd, dt = p.heap, p.b, p.heads, p.s, p.kv, p.hd, p.dt
    reps = [heap.alloc(b * heads * kv * hd * p.kv_dt) for _ in range(2)] if p.sdpa_mask and groups > 1 else []
    heap.at = f"layer {layer + 1} sdpa"
    float_mask = heap.alloc(b * s * kv * dt) if p.sdpa_mask else 0
    out = heap.alloc(b * s * heads * hd * dt)
    if p.device == "cpu":
        lse = heap.alloc(b * heads * s * FP32)
        buf, reduced = sdpa_cpu_buffers(b, heads, s, kv, hd, dt, p.threads)
        heap.alloc(buf)
        heap.alloc(reduced)
        heap.free(reduced, buf, lse)
    heap.free(float_mask, *reps)
    return out

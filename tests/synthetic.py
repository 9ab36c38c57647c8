"""A synthetic sample stream with the shape of a real run, for the plot benchmark and UI development.

It is arithmetic only (no model): KV grows by ``bytes_per_token`` per token for the active mode
and drops in a step at each scripted switch, exactly as a converted live cache does. Real runs and
the tests use the real worker; this exists so the redraw rate can be measured without a model.
"""

from __future__ import annotations

from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample

# Embedded-model-shaped numbers: 4 layers, 8 heads of 32, fp32 -> 2*4*8*32*4 = 8 KiB per token (MHA).
LAYERS, QUERY_HEADS, HEAD_DIM, ELEM = 4, 8, 32, 4
KV_HEADS = {"mha": 8, "gqa:4": 4, "gqa:2": 2, "mqa": 1}


def synthetic_samples(n_tokens: int, prompt_tokens: int = 16, switches: dict[int, str] | None = None,
                      gpu: bool = False, weights: int = 6_000_000, tokens_per_s: float = 200.0,
                      start_token: int = 0, attention: str = "mha") -> list[Sample]:
    """``n_tokens`` decode samples after one prefill (when ``start_token`` is 0), with ``switches``
    (token -> attention key) inserted as events."""
    switches = switches or {}
    out: list[Sample] = []
    base = dict(attn_impl="sdpa", cache="dynamic", kernel="sdpa-math", device="cuda:0" if gpu else "cpu",
                dtype="float32")
    total = 141 * 1024**3 if gpu else None

    def kv(tokens: int, mode: str) -> int:
        return 2 * LAYERS * KV_HEADS.get(mode, 8) * HEAD_DIM * tokens * ELEM

    def sample(token: int, phase: str, text: str, mode: str, t: float, event: str | None = None,
               **switch: object) -> Sample:
        k = kv(token + 1, mode)
        act = 300_000
        return Sample(
            token=token, phase=phase, time_s=t, text=text, attention=mode, kv_bytes_held=k, kv_bytes_reserved=k,
            kv_bytes_storage=k, weights_bytes=weights,
            allocator_allocated=(weights + k + act // 3) if gpu else None,
            allocator_reserved=(weights + k + 2 * 1024**2) if gpu else None,
            device_used=(600 * 1024**2 + weights + k) if gpu else None, device_total=total,
            process_gpu=(500 * 1024**2 + weights + k) if gpu else None,
            process_rss=None if gpu else 400 * 1024**2 + weights + k + (token % 7) * 4096,
            kv_bytes_predicted=k, weights_predicted=weights, activations_predicted=act,
            total_predicted=weights + k + act, tokens_per_s=tokens_per_s,
            event=event, **switch, **base)

    mode = attention
    if start_token == 0:
        out.append(sample(prompt_tokens - 1, PHASE_PREFILL, "The KV cache grows with every token. ", mode, 0.0))
        start_token = prompt_tokens
    for i in range(n_tokens):
        token = start_token + i
        t = token / tokens_per_s
        if token in switches:
            before, mode = mode, switches[token]
            out.append(sample(token - 1, PHASE_EVENT, f"attention: {before} -> {mode}", mode, t, event="switch",
                              switch_key="attention", switch_before=before, switch_after=mode))
        out.append(sample(token, PHASE_DECODE, (" kv", " cache", " grows", ".")[token % 4], mode, t))
    return out

"""Tiny GGUF models of three cache layouts, written with the ``gguf`` package (kvscope.core.model.gguf_write) for the real llama.cpp.

- ``llama``: plain GQA (4 query heads share 2 K/V heads), tied or untied output.
- ``gemma3``: interleaved sliding-window layers (llama.cpp's gemma3 pattern: 5 window layers, then 1 full).
- ``deepseek2``: MLA, the latent cache (kv_lora_rank + rope key, no V), with per-head K/V up-projections.
- ``qwen3moe``: mixture of experts (a router and 3-D expert tensors, ``*_exps``), Q/K norms per head.

Tensor names and shapes are the ones llama.cpp's loader asks for (src/models/<arch>.cpp ``load_arch_tensors``);
ggml lists a shape's fastest dimension first, numpy last, hence the reversed tuples. Weights are seeded random:
the tests measure memory, not text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvscope.core.model.gguf_write import GgufVocab, write_gguf

VOCAB = 300


def _rng(seed: int):
    return np.random.default_rng(seed)


def _mat(rng, *ggml_shape: int) -> np.ndarray:
    return (rng.standard_normal(tuple(reversed(ggml_shape))) * 0.02).astype(np.float16)


def _norm(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _attention_and_ffn(rng, b: str, n_embd: int, n_head: int, n_head_kv: int, head: int, n_ff: int) -> list:
    """A block's Q/K/V/output projections and its gated FFN, as llama.cpp's llama and gemma3 load them."""
    return [
        (b + "attn_q.weight", _mat(rng, n_embd, n_head * head)),
        (b + "attn_k.weight", _mat(rng, n_embd, n_head_kv * head)),
        (b + "attn_v.weight", _mat(rng, n_embd, n_head_kv * head)),
        (b + "attn_output.weight", _mat(rng, n_head * head, n_embd)),
        (b + "ffn_norm.weight", _norm(n_embd)),
        (b + "ffn_gate.weight", _mat(rng, n_embd, n_ff)),
        (b + "ffn_up.weight", _mat(rng, n_embd, n_ff)),
        (b + "ffn_down.weight", _mat(rng, n_ff, n_embd)),
    ]


def llama(path: Path, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 256,
          ctx_train: int = 2048, tied: bool = True, seed: int = 0, quant: str | None = None, vocab: int | None = None,
          quant_embd: bool = False) -> Path:
    """``quant``: a ggml type for every matrix but the token embedding (``quant_embd``: that one too); ``vocab``:
    the vocabulary's size (default ``VOCAB`` as it is when called: tests set it for a whole fixture)."""
    vocab = vocab or VOCAB
    rng = _rng(seed)
    head = n_embd // n_head
    tensors = [("token_embd.weight", _mat(rng, n_embd, vocab)), ("output_norm.weight", _norm(n_embd))]
    if not tied:
        tensors.append(("output.weight", _mat(rng, n_embd, vocab)))
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", _norm(n_embd))]
        tensors += _attention_and_ffn(rng, b, n_embd, n_head, n_head_kv, head, n_ff)
    meta = {"general.name": "tiny llama", "context_length": ctx_train, "embedding_length": n_embd,
            "block_count": n_layer, "feed_forward_length": n_ff, "attention.head_count": n_head,
            "attention.head_count_kv": n_head_kv, "rope.dimension_count": head,
            "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": vocab}
    qmap = {name: quant for name, arr in tensors
            if quant and arr.ndim == 2 and (quant_embd or name != "token_embd.weight")}
    return write_gguf(path, "llama", meta, tensors, GgufVocab.tiny(vocab), quant=qmap)


def gemma3(path: Path, n_layer: int = 7, n_embd: int = 128, n_head: int = 4, n_head_kv: int = 2, head: int = 64,
           n_ff: int = 256, n_swa: int = 128, ctx_train: int = 4096, seed: int = 1) -> Path:
    rng = _rng(seed)
    tensors = [("token_embd.weight", _mat(rng, n_embd, VOCAB)), ("output_norm.weight", _norm(n_embd))]
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", _norm(n_embd))]
        tensors += _attention_and_ffn(rng, b, n_embd, n_head, n_head_kv, head, n_ff)
        tensors += [  # gemma3's own: the norms after attention and FFN, and Q/K norms per head
            (b + "post_attention_norm.weight", _norm(n_embd)),
            (b + "attn_k_norm.weight", _norm(head)),
            (b + "attn_q_norm.weight", _norm(head)),
            (b + "post_ffw_norm.weight", _norm(n_embd)),
        ]
    meta = {"general.name": "tiny gemma3", "context_length": ctx_train, "embedding_length": n_embd,
            "block_count": n_layer, "feed_forward_length": n_ff, "attention.head_count": n_head,
            "attention.head_count_kv": n_head_kv, "attention.key_length": head, "attention.value_length": head,
            "attention.sliding_window": n_swa, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6}
    return write_gguf(path, "gemma3", meta, tensors, GgufVocab.tiny(VOCAB))


def deepseek2(path: Path, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, kv_lora_rank: int = 64,
              rope: int = 32, nope: int = 32, v_head: int = 32, n_ff: int = 256, ctx_train: int = 4096,
              seed: int = 2) -> Path:
    rng = _rng(seed)
    k_mla = nope + rope
    tensors = [("token_embd.weight", _mat(rng, n_embd, VOCAB)), ("output_norm.weight", _norm(n_embd)),
               ("output.weight", _mat(rng, n_embd, VOCAB))]
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", _norm(n_embd)),
            (b + "attn_kv_a_norm.weight", _norm(kv_lora_rank)),
            (b + "attn_q.weight", _mat(rng, n_embd, n_head * k_mla)),
            (b + "attn_kv_a_mqa.weight", _mat(rng, n_embd, kv_lora_rank + rope)),
            (b + "attn_k_b.weight", _mat(rng, nope, kv_lora_rank, n_head)),
            (b + "attn_v_b.weight", _mat(rng, kv_lora_rank, v_head, n_head)),
            (b + "attn_output.weight", _mat(rng, n_head * v_head, n_embd)),
            (b + "ffn_norm.weight", _norm(n_embd)),
            (b + "ffn_gate.weight", _mat(rng, n_embd, n_ff)),
            (b + "ffn_up.weight", _mat(rng, n_embd, n_ff)),
            (b + "ffn_down.weight", _mat(rng, n_ff, n_embd)),
        ]
    # As convert_hf_to_gguf.py writes DeepSeek-V2/V3 for MLA: one KV head of the latent + rope width.
    meta = {"general.name": "tiny deepseek2", "context_length": ctx_train, "embedding_length": n_embd,
            "block_count": n_layer, "feed_forward_length": n_ff, "attention.head_count": n_head,
            "attention.head_count_kv": 1, "attention.key_length": kv_lora_rank + rope,
            "attention.value_length": kv_lora_rank, "attention.key_length_mla": k_mla,
            "attention.value_length_mla": v_head, "attention.kv_lora_rank": kv_lora_rank,
            "attention.q_lora_rank": 0,
            "rope.dimension_count": rope, "attention.layer_norm_rms_epsilon": 1e-6,
            "leading_dense_block_count": n_layer, "expert_feed_forward_length": n_ff, "expert_shared_count": 0,
            "expert_count": 0, "expert_used_count": 0, "vocab_size": VOCAB}
    return write_gguf(path, "deepseek2", meta, tensors, GgufVocab.tiny(VOCAB))


def qwen3moe(path: Path, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_head_kv: int = 2, head: int = 32,
             n_expert: int = 8, n_expert_used: int = 2, n_ff_exp: int = 64, ctx_train: int = 4096, seed: int = 3,
             quant: str | None = None) -> Path:
    """A tiny Qwen3-MoE (src/models/qwen3moe.cpp): every layer's FFN is ``n_expert`` experts, ``n_expert_used``
    chosen per token by the router (``ffn_gate_inp``); ``quant``: a ggml type for the attention and expert matrices."""
    rng = _rng(seed)
    tensors = [("token_embd.weight", _mat(rng, n_embd, VOCAB)), ("output_norm.weight", _norm(n_embd)),
               ("output.weight", _mat(rng, n_embd, VOCAB))]
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", _norm(n_embd)),
            (b + "attn_q.weight", _mat(rng, n_embd, n_head * head)),
            (b + "attn_k.weight", _mat(rng, n_embd, n_head_kv * head)),
            (b + "attn_v.weight", _mat(rng, n_embd, n_head_kv * head)),
            (b + "attn_output.weight", _mat(rng, n_head * head, n_embd)),
            (b + "attn_q_norm.weight", _norm(head)),
            (b + "attn_k_norm.weight", _norm(head)),
            (b + "ffn_norm.weight", _norm(n_embd)),
            (b + "ffn_gate_inp.weight", _mat(rng, n_embd, n_expert).astype(np.float32)),
            (b + "ffn_gate_exps.weight", _mat(rng, n_embd, n_ff_exp, n_expert)),
            (b + "ffn_up_exps.weight", _mat(rng, n_embd, n_ff_exp, n_expert)),
            (b + "ffn_down_exps.weight", _mat(rng, n_ff_exp, n_embd, n_expert)),
        ]
    meta = {"general.name": "tiny qwen3moe", "context_length": ctx_train, "embedding_length": n_embd,
            "block_count": n_layer, "feed_forward_length": n_ff_exp, "attention.head_count": n_head,
            "attention.head_count_kv": n_head_kv, "attention.key_length": head, "attention.value_length": head,
            "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": n_expert,
            "expert_used_count": n_expert_used, "expert_feed_forward_length": n_ff_exp}
    qmap = {name: quant for name, arr in tensors
            if quant and arr.ndim >= 2 and name != "token_embd.weight" and "ffn_gate_inp" not in name}
    return write_gguf(path, "qwen3moe", meta, tensors, GgufVocab.tiny(VOCAB), quant=qmap)

"""The decoder recipe every family's recipe derives from: Llama's (``LlamaModel`` / ``LlamaDecoderLayer`` of
transformers 5.24), composed of the shared blocks. A family overrides the hooks its modeling code changes (the
norm, the projections, rotary, the MLP, the residual, the logits), as llama.cpp's ``src/models/<arch>.cpp`` compose
its shared builders; the layer's order of allocations and frees stays here, once."""

from __future__ import annotations

from kvscope.core.prediction.replay import attention, blocks
from kvscope.core.prediction.replay.heap import FP32
from kvscope.core.prediction.replay.shapes import Pass


class Decoder:
    """Llama's decoder: RMSNorm before the attention and the MLP, q/k/v projected apart, rotary on q and k, the
    gated MLP, sequential residuals, lm_head on the last position. Recipes are stateless (the pass is ``Pass``)."""

    #: transformers' modeling file the recipe follows (for the reader: where to look when it drifts)
    follows = "models/llama/modeling_llama.py"
    #: a norm on the layer's input before the attention and before the MLP (OLMo 2 norms the outputs instead)
    pre_norm = True
    #: the rotary embedding returns cos and sin in fp32, no cast to the model's dtype (OLMo's)
    cos_sin_fp32 = False

    # -- hooks a family overrides

    def norm(self, p: Pass) -> int:
        """The layer's norm on one held hidden state; returns its output's bytes (left allocated)."""
        return blocks.rms_norm(p)

    def rotate(self, p: Pass, q: int, k: int) -> tuple[int, int]:
        """Rotary on the projected q and k (``q``, ``k`` bytes); returns the rotated tensors' bytes."""
        hold = self.holds_rotary_locals(p)
        return blocks.rope_partial(p, q, hold), blocks.rope_partial(p, k, hold)

    def holds_rotary_locals(self, p: Pass) -> bool:
        """Whether the attention's locals keep q_proj's and k_proj's outputs and the rotated halves to its return."""
        return False

    def project(self, p: Pass) -> tuple[int, int, int, int]:
        """q/k/v projections and rotary on a held normed input; returns (a fused projection's bytes or 0, rotated q,
        rotated k, v), all left allocated (a local the attention keeps goes to ``Pass.kept``)."""
        b, s, H = p.b, p.s, p.H  # noqa: N806
        q = p.mm(p.Q, b * s, H, p.heads * p.hd)
        k, v = p.mm(p.K, b * s, H, p.kvh * p.hd), p.mm(p.K, b * s, H, p.kvh * p.hd)
        qe, ke = self.rotate(p, p.Q, p.K)
        if self.holds_rotary_locals(p):
            p.kept.extend((q, k))
        else:
            p.heap.free(q, k)
        return 0, qe, ke, v

    def keeps_attention_locals(self, p: Pass) -> bool:
        """Whether the layer binds the attention's output beside its normed input, both alive to the layer's end."""
        return False

    def mlp(self, p: Pass) -> int:
        """The MLP on a held normed input; returns its output's bytes (left allocated)."""
        return blocks.gated_mlp(p)

    def residual(self, p: Pass, attn: int, keep: bool) -> tuple[int, int]:
        """After o_proj (``attn`` bytes held): returns (the mid-layer state, the layer's output), left allocated."""
        return sequential_residual(self, p, attn, keep)

    def scale_logits(self, p: Pass, logits: int) -> int:
        """What the causal LM does to lm_head's logits before it returns them; returns their bytes."""
        return logits

    # -- the pass, the same for every recipe

    def replay(self, p: Pass) -> int:
        """The whole forward pass on ``p``'s heap; returns the bytes of the logits it leaves."""
        blocks.prologue(p, self.cos_sin_fp32)
        h = p.embeddings  # the layer's input, held by the caller's binding for the whole layer
        for layer in range(p.layers):
            h = self.layer(p, layer, h)
        p.heap.at = "final norm and lm_head"
        normed = self.norm(p)
        logits = self.scale_logits(p, blocks.lm_head(p, h, normed))
        if p.cfg("final_logit_softcapping"):
            logits = blocks.softcap_logits(p, logits)
        p.heap.free(normed)  # the scaling and softcapping ran while the base model's output lived
        return logits

    def layer(self, p: Pass, layer: int, h: int) -> int:
        """One decoder layer on its held input ``h``; returns its output's bytes (left allocated, ``h`` freed
        unless it is the embeddings, which the base model holds to the end)."""
        heap = p.heap
        heap.at = f"layer {layer + 1} attention"
        normed = self.norm(p) if self.pre_norm else 0
        qkv, qe, ke, v = self.project(p)
        blocks.cache_update(p)
        heap.free(ke, v)
        weights, out = attention.attend(p, layer, p.cfg("attn_logit_softcapping"))
        attn = p.mm(p.A, p.b * p.s, p.heads * p.hd, p.H)  # o_proj
        keep = self.keeps_attention_locals(p)
        layer_locals = [normed, attn] if keep else []
        heap.free(out, qe, qkv, *p.kept, *([] if keep else [normed]))
        p.kept.clear()
        blocks.h2o_observe(p)  # an h2o cache's forward hook, as the attention module returns
        heap.at = f"layer {layer + 1} mlp"
        h2, h3 = self.residual(p, attn, keep)
        heap.free(h2, weights, *layer_locals)
        if layer:
            heap.free(h)
        return h3


def sequential_residual(recipe: Decoder, p: Pass, attn: int, keep: bool) -> tuple[int, int]:
    """h2 = h + attn; h3 = h2 + mlp(norm(h2)) (Llama); ``keep``: the attention's output stays to the layer's end."""
    h2 = p.heap.alloc(p.A)
    if not keep:
        p.heap.free(attn)
    normed = recipe.norm(p)
    down = recipe.mlp(p)
    p.heap.free(normed)
    h3 = p.heap.alloc(p.A)
    p.heap.free(down)
    return h2, h3


def parallel_residual(recipe: Decoder, p: Pass, attn: int, keep: bool) -> tuple[int, int]:
    """h3 = h + attn(ln1(h)) + mlp(ln2(h)) (GPT-NeoX, Phi): the MLP's input is the layer's input, normed again."""
    normed = recipe.norm(p)
    down = recipe.mlp(p)
    p.heap.free(normed)
    partial = p.heap.alloc(p.A)
    h3 = p.heap.alloc(p.A)
    p.heap.free(partial, down, attn)
    return 0, h3


def post_norm_residual(recipe: Decoder, p: Pass, attn: int, keep: bool) -> tuple[int, int]:
    """h2 = h + post_attention_layernorm(attn); h3 = h2 + post_feedforward_layernorm(mlp(...)) (Gemma 2 beside its
    pre-norms, OLMo 2 instead of them)."""
    post = recipe.norm(p)
    p.heap.free(attn)
    h2 = p.heap.alloc(p.A)
    p.heap.free(post)
    normed = recipe.norm(p) if recipe.pre_norm else 0
    down = recipe.mlp(p)
    p.heap.free(normed)
    post = recipe.norm(p)
    p.heap.free(down)
    h3 = p.heap.alloc(p.A)
    p.heap.free(post)
    return h2, h3


def rotate_fp32(recipe: Decoder, p: Pass, q: int, k: int, copies: bool = False) -> tuple[int, int]:
    """Rotary on fp32 q and k in a bf16/fp16 model (``blocks.rope_fp32``); in fp32 the plain rotary."""
    if p.dt != FP32:
        return blocks.rope_fp32(p, q, k, copies)
    return Decoder.rotate(recipe, p, q, k)


def fused_project(recipe: Decoder, p: Pass) -> tuple[int, int, int, int]:
    """One fused qkv projection, q/k/v its views, rotary on q and k (GPT-NeoX's query_key_value, Phi-3's qkv_proj)."""
    qkv = p.mm(p.Q + 2 * p.K, p.b * p.s, p.H, (p.heads + 2 * p.kvh) * p.hd)
    qe, ke = blocks.rope_partial(p, p.Q), blocks.rope_partial(p, p.K)
    return qkv, qe, ke, 0

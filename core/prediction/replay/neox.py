"""The LayerNorm families with partial rotary: GPT-NeoX (fused query_key_value, the dense GELU MLP, a parallel
residual where the config says so), Phi (parallel residual, rotary halves held by the attention's locals), StableLM
(its attention's output held beside the normed input to the layer's end) and Starcoder2 (dense MLP)."""

from __future__ import annotations

from kvscope.core.prediction.replay import blocks
from kvscope.core.prediction.replay.decoder import Decoder, fused_project, parallel_residual, sequential_residual
from kvscope.core.prediction.replay.shapes import Pass


class LayerNormDecoder(Decoder):
    """nn.LayerNorm for every norm, and fc1 -> act -> fc2 (with NewGELUActivation's formula where the config's
    activation is gelu_new or gelu_fast)."""

    def norm(self, p: Pass) -> int:
        return blocks.layer_norm(p)

    def mlp(self, p: Pass) -> int:
        gelu_formula = p.cfg("hidden_act", "activation_function", default="") in ("gelu_new", "gelu_fast")
        return blocks.dense_mlp(p, gelu_formula)


class ParallelDecoder(LayerNormDecoder):
    """A layer whose MLP runs on its input beside the attention when ``use_parallel_residual`` (``parallel``: its
    default), else sequentially."""

    parallel = False

    def residual(self, p: Pass, attn: int, keep: bool) -> tuple[int, int]:
        parallel = bool(p.cfg("use_parallel_residual", default=self.parallel))
        return (parallel_residual if parallel else sequential_residual)(self, p, attn, keep)


class GptNeox(ParallelDecoder):
    """GPTNeoXLayer: query_key_value fused."""

    follows = "models/gpt_neox/modeling_gpt_neox.py"
    project = fused_project


class Phi(ParallelDecoder):
    """PhiDecoderLayer: one input_layernorm feeds the attention and the MLP (parallel by default); its attention
    binds the rotated halves and the pass-through views to locals that live until it returns."""

    follows = "models/phi/modeling_phi.py"
    parallel = True

    def holds_rotary_locals(self, p: Pass) -> bool:
        return p.rotary < p.hd


class StableLm(Decoder):
    """StableLmDecoderLayer (replayed sequential): LayerNorm, Llama's gated MLP, the rotary halves held as Phi's,
    and ``self_attn_output, _ = ...`` bound beside the normed input, both alive to the end of the layer."""

    follows = "models/stablelm/modeling_stablelm.py"

    def norm(self, p: Pass) -> int:
        return blocks.layer_norm(p)

    def holds_rotary_locals(self, p: Pass) -> bool:
        return p.rotary < p.hd

    def keeps_attention_locals(self, p: Pass) -> bool:
        return True


class Starcoder2(LayerNormDecoder):
    """Starcoder2DecoderLayer: LayerNorm, q/k/v apart, the dense MLP, sequential residuals."""

    follows = "models/starcoder2/modeling_starcoder2.py"

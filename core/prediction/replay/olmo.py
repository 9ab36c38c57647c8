"""OLMo's family: rotary in fp32 (fp32 cos/sin promote q and k of a bf16/fp16 model), OLMo's weightless LayerNorm
on an fp32 copy, and OLMo 2's norms after the attention and the MLP instead of before, with RMSNorms on q and k."""

from __future__ import annotations

from kvscope.core.prediction.replay import blocks
from kvscope.core.prediction.replay.decoder import Decoder, post_norm_residual, rotate_fp32
from kvscope.core.prediction.replay.heap import FP32
from kvscope.core.prediction.replay.shapes import Pass


class Olmo(Decoder):
    """OlmoDecoderLayer: OlmoLayerNorm (F.layer_norm on an fp32 copy, no weight, cast back)."""

    follows = "models/olmo/modeling_olmo.py"
    cos_sin_fp32 = True

    def norm(self, p: Pass) -> int:
        heap = p.heap
        up = heap.alloc(p.A32) if p.dt != FP32 else 0
        out32 = heap.alloc(p.A32)
        heap.free(heap.alloc(p.row32), heap.alloc(p.row32))  # native_layer_norm's mean and rstd rows
        heap.free(up)
        if p.dt == FP32:
            return out32
        out = heap.alloc(p.A)
        heap.free(out32)
        return out

    def rotate(self, p: Pass, q: int, k: int) -> tuple[int, int]:
        return rotate_fp32(self, p, q, k)


class Olmo2(Olmo):
    """Olmo2DecoderLayer: the layer's input projected as is; q_norm(q_proj(x)) and k_norm(k_proj(x)) over all
    heads before the split; post_attention_layernorm and post_feedforward_layernorm on the outputs; RMSNorms that
    multiply by the weight in fp32 and cast last."""

    follows = "models/olmo2/modeling_olmo2.py"
    pre_norm = False
    residual = post_norm_residual

    def norm(self, p: Pass, n: int = 0) -> int:
        return blocks.rms_norm(p, n, weight_fp32=True)

    def project(self, p: Pass) -> tuple[int, int, int, int]:
        b, s, H = p.b, p.s, p.H  # noqa: N806
        q = p.mm(p.Q, b * s, H, p.heads * p.hd)
        qn = self.norm(p, p.Q)
        p.heap.free(q)
        k = p.mm(p.K, b * s, H, p.kvh * p.hd)
        kn = self.norm(p, p.K)
        p.heap.free(k)
        v = p.mm(p.K, b * s, H, p.kvh * p.hd)
        qe, ke = self.rotate(p, p.Q, p.K)
        p.heap.free(qn, kn)
        return 0, qe, ke, v

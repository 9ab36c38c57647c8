"""Llama and the families whose decoder is Llama's but for one trait: Mistral, Qwen 2/3, Helium (Llama's layer as
is), Phi-3 (fused qkv and gate_up projections), GLM (fused gate_up), Granite and Cohere (scaled logits; Cohere's
rotary on fp32 copies of q and k)."""

from __future__ import annotations

from kvscope.core.prediction.replay import blocks
from kvscope.core.prediction.replay.decoder import Decoder, fused_project, rotate_fp32
from kvscope.core.prediction.replay.shapes import Pass


class Llama(Decoder):
    """LlamaDecoderLayer; Mistral's, Qwen 2's and 3's and Helium's are replayed as it (each checked against the
    allocator: tests/test_prefill_peak.py)."""


class Phi3(Decoder):
    """Phi3DecoderLayer: qkv_proj and gate_up_proj fused, their outputs split into views."""

    follows = "models/phi3/modeling_phi3.py"
    project = fused_project

    def mlp(self, p: Pass) -> int:
        return blocks.fused_gated_mlp(p)


class Glm(Decoder):
    """GlmDecoderLayer: Llama's, with gate_up_proj fused as Phi-3's."""

    follows = "models/glm/modeling_glm.py"

    def mlp(self, p: Pass) -> int:
        return blocks.fused_gated_mlp(p)


class Granite(Decoder):
    """GraniteDecoderLayer: Llama's (its residual and embedding multipliers scale in place); the logits divided
    by logits_scaling in a new tensor."""

    follows = "models/granite/modeling_granite.py"

    def scale_logits(self, p: Pass, logits: int) -> int:
        return blocks.rescale_logits(p, logits)


class Cohere(Decoder):
    """CohereDecoderLayer's allocations as Llama's, but rotary on q.float() and k.float() copies in a bf16/fp16
    model, and the logits multiplied by logit_scale in a new tensor."""

    follows = "models/cohere/modeling_cohere.py"

    def rotate(self, p: Pass, q: int, k: int) -> tuple[int, int]:
        return rotate_fp32(self, p, q, k, copies=True)

    def scale_logits(self, p: Pass, logits: int) -> int:
        return blocks.rescale_logits(p, logits)

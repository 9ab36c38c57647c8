"""Gemma's family: Gemma (Llama's layer in this replay: its RMSNorm's (1 + weight) allocates as Llama's) and Gemma 2
(norms after the attention and the MLP beside the two before, tanh soft-capping of the scores and of the logits,
sliding layers beside full ones). The soft-capping and the windows are the config's (``attn_logit_softcapping``,
``final_logit_softcapping``, the sliding layers) and the shared blocks follow them for any recipe."""

from __future__ import annotations

from kvscope.core.prediction.replay.decoder import Decoder, post_norm_residual


class Gemma(Decoder):
    """GemmaDecoderLayer."""

    follows = "models/gemma/modeling_gemma.py"


class Gemma2(Decoder):
    """Gemma2DecoderLayer: input_layernorm, attention, post_attention_layernorm, residual; pre_feedforward_layernorm,
    MLP, post_feedforward_layernorm, residual."""

    follows = "models/gemma2/modeling_gemma2.py"
    residual = post_norm_residual

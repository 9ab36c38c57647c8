"""Predicted KV bytes equal the bytes transformers' cache objects really hold, byte for byte.

Tiny real models (random weights, fixed seed, built offline) run a prefill of P tokens and then N
single-token decode steps through ``model(ids, cache=cache, use_cache=True)``; after the prefill and
after EVERY step, ``kvscope.core.prediction.predict.kv_bytes`` must equal ``kvscope.core.runtimes.transformers.measure.cache_bytes(cache).logical``.
Then the presets: per-token KV bytes derived by hand, and the MHA/GQA/MQA ratios of Llama-3-8B.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, QuantizedCache, StaticCache)

from kvscope.core.model.attention import SettingsError, parse_attention
from kvscope.core.model.caches import Dynamic, Quantized, Static, parse_cache
from kvscope.core.runtimes.transformers.caches import build_cache, forward_context
from kvscope.core.model.hf_config import spec_from_config
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.prediction.predict import kv_bytes
from kvscope.core.runtimes.transformers.measure import cache_bytes, model_weight_bytes
from tests import helpers

VOCAB = 128
HAS_QUANTO = importlib.util.find_spec("optimum.quanto") is not None
HAS_HQQ = importlib.util.find_spec("hqq") is not None


_one_thread = pytest.fixture(autouse=True, scope="module")(helpers.one_torch_thread)


# ------------------------------------------------------------------------------------------------
# Tiny models (hidden 64, 2 layers, random weights, seed 0)


def _seeded(build):
    torch.manual_seed(0)
    return build().eval()


def tiny_llama(kv_heads: int = 2, heads: int = 4, head_dim: int = 16, tied: bool = False) -> LlamaForCausalLM:
    """Llama with ``heads`` query heads: kv_heads == heads is MHA, 1 < kv_heads < heads GQA, 1 MQA."""
    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=tied,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
    )))


def tiny_mistral(window: int = 8) -> MistralForCausalLM:
    """Mistral whose every layer slides over ``window`` tokens (smaller than what the tests generate)."""
    return _seeded(lambda: MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window, max_position_embeddings=512,
    )))


def tiny_deepseek() -> DeepseekV3ForCausalLM:
    """DeepseekV3 with MLA: the cache holds the latent (kv_lora_rank 32) and the rope key (16) per token."""
    return _seeded(lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
    )))


def tiny_gemma3(window: int = 8) -> Gemma3ForCausalLM:
    """Gemma 3 text model with one local (sliding) layer and one global layer."""
    return _seeded(lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=window, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
    )))


MODELS = {
    "llama-mha": lambda: tiny_llama(kv_heads=4),
    "llama-gqa": lambda: tiny_llama(kv_heads=2),
    "llama-mqa": lambda: tiny_llama(kv_heads=1, heads=2, head_dim=32),
    "mistral-window8": tiny_mistral,
    "deepseek-mla": tiny_deepseek,
    "gemma3-local-global": tiny_gemma3,
}


def _spec(model):
    return spec_from_config(model.config.to_dict(), name=type(model).__name__)


def generate_and_compare(model, cache, settings: RunSettings, prompt: int, steps: int) -> list[tuple[int, int, int]]:
    """Prefill ``prompt`` tokens then ``steps`` decode tokens; return (tokens, observed, predicted) after each."""
    spec = _spec(model)
    rows = []
    ids = torch.randint(0, VOCAB, (settings.batch, prompt), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model(ids, cache=cache, use_cache=True)
        for step in range(steps + 1):
            tokens = prompt + step
            # The cache really advanced: its own count is the token count we predict for.
            assert cache.get_seq_length() == tokens
            rows.append((tokens, cache_bytes(cache).logical, kv_bytes(spec, settings, tokens, prompt_tokens=prompt)))
            if step < steps:
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    return rows


def assert_exact(rows):
    wrong = [(t, obs, pred) for t, obs, pred in rows if obs != pred]
    assert not wrong, f"(tokens, observed, predicted) that differ: {wrong[:5]}"
    assert rows[-1][1] > 0


# ------------------------------------------------------------------------------------------------
# Dynamic and static caches, on every tiny model (sliding layers included)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", list(MODELS))
def test_dynamic_cache_exact_every_token(kind, batch):
    model = MODELS[kind]()
    cache = DynamicCache(config=model.config)  # with the config, sliding layers become DynamicSlidingWindowLayer
    rows = generate_and_compare(model, cache, RunSettings(batch=batch, cache=Dynamic()), prompt=5, steps=14)
    assert_exact(rows)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", list(MODELS))
def test_static_cache_exact_every_token(kind, batch):
    model = MODELS[kind]()
    max_len = 24
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    settings = RunSettings(batch=batch, cache=Static(), max_context=max_len)
    rows = generate_and_compare(model, cache, settings, prompt=5, steps=14)
    assert_exact(rows)
    # Preallocated: the bytes do not move with the token count.
    assert len({obs for _, obs, _ in rows}) == 1


def test_sliding_window_caps_dynamic_cache_at_window_minus_one():
    """DynamicSlidingWindowLayer keeps W - 1 tokens; the slice it keeps is a view, so storage can exceed it."""
    model = tiny_mistral(window=8)
    cache = DynamicCache(config=model.config)
    rows = generate_and_compare(model, cache, RunSettings(cache=Dynamic()), prompt=12, steps=3)
    assert_exact(rows)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32
    assert rows[0][1] == 7 * per_token  # prefill of 12 > W: 7 tokens held
    assert rows[-1][1] == 7 * per_token
    measured = cache_bytes(cache)
    # The kept keys are the last 7 of an 8-token concatenation: 8 tokens of storage stay allocated.
    assert measured.storage == 8 * per_token
    assert measured.layers == 2


def test_static_cache_bookkeeping_is_not_counted():
    """StaticLayer.cumulative_length (an int64 counter) is not K/V: exactly b*h*max_len*(k+v) bytes are reported."""
    model = tiny_llama(kv_heads=2)
    cache = StaticCache(config=model.config, max_cache_len=10)
    with torch.inference_mode():
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache, use_cache=True)
    assert all(isinstance(layer.cumulative_length, torch.Tensor) for layer in cache.layers)
    assert cache_bytes(cache) == cache_bytes(cache)  # frozen value type
    assert cache_bytes(cache).logical == 2 * (1 * 2 * 10 * (16 + 16) * 4)
    assert cache_bytes(cache).storage == cache_bytes(cache).logical


def test_cache_bytes_of_empty_and_none():
    assert cache_bytes(None).logical == 0
    empty = cache_bytes(DynamicCache())
    assert (empty.logical, empty.storage, empty.layers) == (0, 0, 0)


def test_cache_bytes_walks_subclasses_defined_outside_transformers_and_legacy_tuples():
    class EngineCache(DynamicCache):
        """What an engine might subclass to convert heads between tokens."""

    model = tiny_llama(kv_heads=2)
    cache = EngineCache(config=model.config)
    rows = generate_and_compare(model, cache, RunSettings(cache=Dynamic()), prompt=4, steps=2)
    assert_exact(rows)
    legacy = tuple((layer.keys, layer.values) for layer in cache.layers)
    assert cache_bytes(legacy).logical == cache_bytes(cache).logical == rows[-1][2]
    assert cache_bytes(legacy).layers == 2


def test_model_weight_bytes_counts_tied_weights_once():
    model = tiny_llama(kv_heads=2, tied=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    params = {id(p): p for p in model.parameters()}.values()
    expected = sum(p.numel() * p.element_size() for p in params) + sum(b.nbytes for b in model.buffers())
    assert model_weight_bytes(model) == expected
    # And it is what the spec's exact parameter count predicts, plus the rotary buffer.
    spec = _spec(model)
    assert model_weight_bytes(model) == spec.num_parameters * 4 + sum(b.nbytes for b in model.buffers())


# ------------------------------------------------------------------------------------------------
# Quantized caches: quanto 4/2, hqq 4/2, fp8 — through the residual flush


def _quantized_cache(model, q: Quantized) -> QuantizedCache:
    if q.backend == "fp8":
        return QuantizedCache("fp8", model.config)
    if q.backend == "quanto" and not HAS_QUANTO:
        pytest.skip("optimum-quanto is not installed")
    if q.backend == "hqq" and not HAS_HQQ:
        pytest.skip("hqq is not installed")
    return QuantizedCache(q.backend, model.config, nbits=q.nbits, q_group_size=q.q_group_size,
                          residual_length=q.residual_length)


QUANT_KEYS = ["quantized:quanto:4", "quantized:quanto:2", "quantized:hqq:4", "quantized:hqq:2", "quantized:fp8"]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("key", QUANT_KEYS)
@pytest.mark.parametrize("kind", ["llama-gqa", "deepseek-mla"])
def test_quantized_cache_exact_every_token_through_flush(kind, key, batch):
    """Default residual_length 128: 132 decode steps flush the residual into the quantized states once."""
    q = parse_cache(key)
    assert isinstance(q, Quantized) and q.residual_length == 128 and q.q_group_size == 64
    model = MODELS[kind]()
    # P = 4: quanto groups heads x tokens x dim by 64 per sequence, which the MLA rope key (16 wide)
    # meets only at multiples of 4 tokens — P and the flush at P + 128 both are.
    rows = generate_and_compare(model, _quantized_cache(model, q), RunSettings(batch=batch, cache=q), prompt=4, steps=132)
    assert_exact(rows)
    if q.backend != "fp8":
        by_tokens = dict((t, obs) for t, obs, _ in rows)
        # The flush at 4 + 128 tokens empties the fp32 residual: bytes drop back below the step before.
        assert by_tokens[132] < by_tokens[131]


@pytest.mark.parametrize("key", ["quantized:quanto:4", "quantized:hqq:4", "quantized:hqq:8", "quantized:hqq:3"])
def test_quantized_cache_non_default_groups_and_residual(key):
    q0 = parse_cache(key)
    q = Quantized(backend=q0.backend, nbits=q0.nbits, q_group_size=32, residual_length=16)
    model = tiny_llama(kv_heads=2)
    rows = generate_and_compare(model, _quantized_cache(model, q), RunSettings(batch=2, cache=q), prompt=6, steps=40)
    assert_exact(rows)


@pytest.mark.skipif(not HAS_QUANTO, reason="optimum-quanto is not installed")
def test_quantized_cache_bf16_scales_in_model_dtype():
    """Scales and zero-points follow the model dtype (2 bytes in bf16), and so does the residual."""
    model = tiny_llama(kv_heads=2).to(torch.bfloat16)
    q = Quantized(backend="quanto", nbits=4, residual_length=16)
    settings = RunSettings(batch=1, cache=q, weight_dtype="bf16")
    rows = generate_and_compare(model, _quantized_cache(model, q), settings, prompt=6, steps=20)
    assert_exact(rows)


def _quantize_once(q: Quantized, shape: tuple[int, int, int, int], dtype=torch.float32) -> int:
    """Bytes a real transformers quantized layer holds after one update (the prefill) of K and V of ``shape``."""
    from transformers.cache_utils import Fp8QuantizedLayer, HQQQuantizedLayer, QuantoQuantizedLayer

    if q.backend == "fp8":
        layer = Fp8QuantizedLayer()
    else:
        cls = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}[q.backend]
        layer = cls(nbits=q.nbits, q_group_size=q.q_group_size, residual_length=q.residual_length)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    layer.update(k, v)
    return cache_bytes(layer).logical


# (batch, heads, tokens, dim): one group (n == 64: quanto keeps a (1, 64) scale), odd group counts
# (quanto pads its packed rows), batch 2, wide heads.
SHAPES = [(1, 1, 4, 16), (1, 2, 3, 32), (1, 2, 6, 16), (2, 1, 4, 16), (2, 3, 5, 64), (1, 8, 7, 128), (3, 1, 12, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("key", ["quantized:quanto:4", "quantized:quanto:2", "quantized:hqq:4", "quantized:hqq:2",
                                 "quantized:hqq:8", "quantized:hqq:3", "quantized:hqq:1", "quantized:fp8"])
def test_quantized_formula_matches_backend_for_shapes(key, shape):
    q = parse_cache(key)
    if (q.backend == "quanto" and not HAS_QUANTO) or (q.backend == "hqq" and not HAS_HQQ):
        pytest.skip(f"{q.backend} is not installed")
    b, h, s, d = shape
    for dtype, elem in ((torch.float32, 4), (torch.bfloat16, 2)):
        observed = _quantize_once(q, shape, dtype)
        assert observed == 2 * q.quantized_bytes(b, h, s, d, elem), (key, shape, dtype)


def test_quanto_single_group_and_padding_rules():
    """The two layout rules a naive n*bits/8 + 2*n/g*dtype formula misses."""
    q4 = Quantized(backend="quanto", nbits=4)
    # 64 elements = one group: scale and shift are (1, 64), not (1, 1); and the one row of codes
    # still takes a whole packed row of 64 bytes (ceil(1 / 2) = 1), not 32.
    assert q4.quantized_bytes(1, 1, 4, 16, 4) == 64 + 2 * 64 * 4
    # 3 groups of 64 at 4 bits: 2 codes per byte along the group axis -> ceil(3/2) = 2 rows of 64 bytes.
    assert q4.quantized_bytes(1, 2, 6, 16, 4) == 2 * 64 + 2 * 3 * 4


@pytest.mark.skipif(not HAS_QUANTO, reason="optimum-quanto is not installed")
def test_quanto_refuses_what_the_predictor_refuses():
    """heads x tokens x dim = 2 x 5 x 16 = 160 is no multiple of 64: quanto raises, so does the predictor."""
    model = tiny_llama(kv_heads=2)
    q = Quantized(backend="quanto", nbits=4)
    with pytest.raises(ValueError, match="divisor"), torch.inference_mode():
        model(torch.zeros(1, 5, dtype=torch.long), cache=_quantized_cache(model, q), use_cache=True)
    with pytest.raises(SettingsError, match="multiple of 64"):
        kv_bytes(_spec(model), RunSettings(cache=q), 5)


def test_quantized_cache_refused_on_sliding_layers_like_transformers():
    model = tiny_mistral()
    with pytest.raises(ValueError, match="only supported for models with only full attention"):
        QuantizedCache("fp8", model.config)
    with pytest.raises(SettingsError, match="full-attention"):
        kv_bytes(_spec(model), RunSettings(cache=parse_cache("quantized:fp8")), 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloaded caches need CUDA (transformers uses CUDA streams)")
def test_offloaded_cache_exact_on_cuda():  # pragma: no cover - runs on GPU machines only
    model = tiny_llama(kv_heads=2).cuda()
    cache = DynamicCache(config=model.config, offloading=True)
    rows = generate_and_compare(model, cache, RunSettings(cache=parse_cache("offloaded")), prompt=5, steps=8)
    assert_exact(rows)
    assert set(cache_bytes(cache).logical_by_device) <= {"cuda", "cpu"}


# ------------------------------------------------------------------------------------------------
# Presets: hand-derived per-token KV bytes


def _per_token(name: str, settings: RunSettings | None = None, tokens: int = 1) -> float:
    return kv_bytes(load_spec(name), settings or RunSettings(), tokens) / tokens


def test_llama_3_8b_worked_example():
    # 2 (K and V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes (bf16) = 131,072 B per token.
    assert _per_token("llama-3-8b") == 131_072
    spec = load_spec("llama-3-8b")
    assert kv_bytes(spec, RunSettings(), 4096) == 536_870_912
    assert kv_bytes(spec, RunSettings(), 32_768) == 4_294_967_296
    assert kv_bytes(spec, RunSettings(), 131_072) == 17_179_869_184
    # fp16 is also 2 bytes: same numbers.
    assert kv_bytes(spec, RunSettings(kv_dtype="fp16"), 4096) == 536_870_912


def test_llama_3_8b_mha_gqa_mqa_ratios():
    spec = load_spec("llama-3-8b")
    n = 4096
    native = kv_bytes(spec, RunSettings(), n)
    mha = kv_bytes(spec, RunSettings(attention=parse_attention("mha")), n)
    gqa8 = kv_bytes(spec, RunSettings(attention=parse_attention("gqa:8")), n)
    gqa2 = kv_bytes(spec, RunSettings(attention=parse_attention("gqa:2")), n)
    mqa = kv_bytes(spec, RunSettings(attention=parse_attention("mqa")), n)
    # 32 query heads: MHA caches 32 KV heads, GQA:8 8, GQA:2 2, MQA 1.
    assert gqa8 == native
    assert mha == 4 * native
    assert gqa8 == 4 * gqa2
    assert mha == 32 * mqa
    assert mqa * 131_072 == native * 16_384  # MQA: 2 x 32 x 1 x 128 x 2 = 16,384 B per token
    with pytest.raises(SettingsError, match="gqa:3 does not divide 32"):
        kv_bytes(spec, RunSettings(attention=parse_attention("gqa:3")), n)


@pytest.mark.parametrize("name, per_token", [
    # 2 x 80 layers x 8 KV heads x 128 (8192 / 64) x 2 B = 327,680
    ("llama-3-70b", 2 * 80 * 8 * 128 * 2),
    # 2 x 28 layers x 4 KV heads x 128 (3584 / 28) x 2 B = 57,344; use_sliding_window false: no window
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
    # MLA: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B = 70,272 — one latent and one
    # rope key per token, shared by all 128 heads (DeepseekV3Attention's cache.update(kv_nope, k_rot))
    ("deepseek-v3", 61 * (512 + 64) * 2),
    # 2 x 30 layers x 3 KV heads x 64 (576 / 9) x 2 B = 23,040
    ("smollm2-135m", 2 * 30 * 3 * 64 * 2),
    # embedded demo model: 2 x 4 layers x 8 KV heads x 32 x 4 B (fp32) = 8,192
    ("embedded", 2 * 4 * 8 * 32 * 4),
])
def test_preset_per_token_full_attention(name, per_token):
    assert _per_token(name) == per_token
    assert kv_bytes(load_spec(name), RunSettings(), 1000) == 1000 * per_token


def test_mistral_7b_window_4096():
    # 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B per token, every layer sliding over W = 4096.
    spec = load_spec("mistral-7b")
    per_token = 2 * 32 * 8 * 128 * 2
    assert kv_bytes(spec, RunSettings(), 1000) == 1000 * per_token
    # Dynamic: DynamicSlidingWindowLayer keeps the last W - 1 = 4095 tokens.
    assert kv_bytes(spec, RunSettings(), 32_768) == 4095 * per_token
    # Static: StaticSlidingWindowLayer preallocates min(W, max_cache_len) = 4096 slots.
    assert kv_bytes(spec, RunSettings(cache=Static(), max_context=32_768), 100) == 4096 * per_token
    assert kv_bytes(spec, RunSettings(cache=Static(), max_context=2048), 100) == 2048 * per_token


def test_gemma_3_27b_local_global():
    # 62 layers, sliding_window_pattern 6: layers 5, 11, ..., 59 are global (10), the other 52 local
    # with W = 1024. Per layer per token: 2 x 16 KV heads x 128 x 2 B = 8,192 B.
    spec = load_spec("gemma-3-27b")
    assert (spec.num_full_layers, spec.num_sliding_layers) == (10, 52)
    layer = 2 * 16 * 128 * 2
    for t in (500, 1023, 1024, 32_768):
        assert kv_bytes(spec, RunSettings(), t) == 10 * layer * t + 52 * layer * min(t, 1023)
    # Static at 32K: global layers preallocate 32,768 slots, local ones 1,024.
    assert kv_bytes(spec, RunSettings(cache=Static(), max_context=32_768), 10) == (10 * 32_768 + 52 * 1024) * layer


# ------------------------------------------------------------------------------------------------
# Token-selecting caches (core/runtimes/transformers/sparse_caches.py): attention sinks + window, heavy hitters


def _selecting_rows(model, strategy, prompt: int, steps: int, batch: int = 1) -> list[tuple[int, int, int]]:
    """Like ``generate_and_compare``, with the strategy's own cache and forward context (h2o's attention hooks)."""
    spec = _spec(model)
    settings = RunSettings(batch=batch, cache=strategy)
    cache = build_cache(strategy, model.config, 512)
    rows = []
    ids = torch.randint(0, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        with forward_context(strategy, model, cache):
            out = model(ids, cache=cache, use_cache=True)
        for step in range(steps + 1):
            tokens = prompt + step
            assert cache.get_seq_length() == tokens  # every token counted, held or dropped: positions go on
            rows.append((tokens, cache_bytes(cache).logical, kv_bytes(spec, settings, tokens, prompt_tokens=prompt)))
            if step < steps:
                with forward_context(strategy, model, cache):
                    out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert not any(m._forward_hooks for m in model.modules()), "the h2o hooks outlive the forward pass"
    return rows


@pytest.mark.parametrize("key", ["sink:2+5", "h2o:3+4"])
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("prompt", [3, 12])  # eviction starts during decoding / at the prefill
def test_token_selecting_caches_exact_every_token(kind, key, prompt):
    model = MODELS[kind]()
    strategy = parse_cache(key)
    if strategy.needs_attention_weights:
        model.set_attn_implementation("eager")
    rows = _selecting_rows(model, strategy, prompt=prompt, steps=14, batch=2 if prompt == 3 else 1)
    assert_exact(rows)
    # Bounded from capacity + 1 tokens on: the full-attention layers hold S + W (B + W) tokens.
    spec = _spec(model)
    if spec.num_full_layers:
        flat = [obs for t, obs, _ in rows if t >= strategy.capacity]
        assert len(set(flat)) == 1, f"not flat beyond {strategy.capacity} tokens: {rows}"


def test_token_selecting_cache_bytes_by_hand():
    """sink:4+60 on Llama-3-8B (131,072 B per token): 64 tokens' worth from 64 tokens on; h2o adds one float32
    score per held token and KV head in every layer (32 layers x 8 KV heads)."""
    spec = load_spec("llama-3-8b")
    sink = RunSettings(cache=parse_cache("sink:4+60"))
    counts = (1, 63, 64, 65, 400, 4096)
    assert [kv_bytes(spec, sink, n) for n in counts] == [131_072 * min(n, 64) for n in counts]
    h2o = RunSettings(cache=parse_cache("h2o:32+32"))
    assert kv_bytes(spec, h2o, 1000) == 64 * 131_072 + 32 * 8 * 64 * 4
    # A model that mixes sliding and full layers: only the full ones are bounded by S + W.
    gemma = load_spec("gemma-3-27b")
    layer = 2 * 16 * 128 * 2
    assert kv_bytes(gemma, RunSettings(cache=parse_cache("sink:4+252")), 32_768) == (10 * 256 + 52 * 1023) * layer


def test_h2o_without_attention_weights_fails_loudly():
    """sdpa returns no attention weights: the heavy-hitter layer says so at the next token, never silently grows."""
    model = tiny_llama()
    strategy = parse_cache("h2o:2+2")
    cache = build_cache(strategy, model.config, 512)
    with torch.inference_mode():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache, use_cache=True)  # sdpa, no hooks
        with pytest.raises(RuntimeError, match="needs eager attention"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache, use_cache=True)


def test_calc_reads_a_config_json_transformers_saved_with_infinity(tmp_path):
    """save_pretrained writes Mamba-2's time_step_limit (0, inf) as [0.0, {"__float__": "Infinity"}] and from_pretrained
    decodes it; calc reads the same folder as transformers does (it was refused: "doesn't match list[float]")."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                          state_size=8, n_groups=1, chunk_size=16, time_step_limit=(0.0, float("inf")))
    config.save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    spec = load_spec(str(tmp_path))
    with torch.device("meta"):
        model = Mamba2ForCausalLM(Mamba2Config.from_pretrained(tmp_path))
    assert spec.num_parameters == sum(p.numel() for p in model.parameters())
    assert spec.layer_states is not None and spec.num_kv_layers == 0


def test_layers_of_their_own_shapes_are_predicted_as_transformers_caches_them():
    """MiMo-V2-Flash's sliding layers compute twice the K/V heads of its full layers, and its values are narrower than
    its keys: the spec carries each layer's shape as the meta-device probe found it (ModelSpec.layer_kv), and the
    prediction follows it at every token, past the window too."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    config = MiMoV2FlashConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, sliding_window=6,
                               layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "dense"])
    model = _seeded(lambda: MiMoV2FlashForCausalLM(config))
    spec = spec_from_config(config.to_dict(), "mimo")
    assert spec.layer_kv == ((2, 16, 8, 0), (4, 16, 8, 0))
    settings = RunSettings(weight_dtype="float32")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.arange(4).unsqueeze(0), cache=cache, use_cache=True)
        assert cache_bytes(cache).logical == kv_bytes(spec, settings, 4)
        for n in range(5, 12):
            model(torch.tensor([[n]]), cache=cache, use_cache=True)
            assert cache_bytes(cache).logical == kv_bytes(spec, settings, n)
    # A head change makes every layer alike (1 head of 16 for K and V): 10 tokens in the full layer, 5 in the sliding one.
    assert kv_bytes(spec, settings.with_(attention=parse_attention("mqa")), 10) == (10 + 5) * (16 + 16) * 4


def test_deepseek_v4_compressor_state_grows_window_by_window():
    """DeepSeek-V4's compressing layers keep, beside a sliding K=V (one tensor), one compressed entry per full window of
    compress_rate tokens, the tokens since the last full window, and (CSA) the last window's overlap series: predicted
    from the probe (kvscope.core.model.states.LayerState.compress_rate...) at every token, through several windows of each rate."""
    from transformers import DeepseekV4ForCausalLM

    from tests import archs

    config = archs.tiny_config("deepseek_v4")
    config.compress_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    model = _seeded(lambda: DeepseekV4ForCausalLM(config))
    spec = spec_from_config(config.to_dict(), "deepseek_v4")
    assert {s.compress_rate for s in spec.layer_states} == {4, 8}
    settings = RunSettings(weight_dtype="float32")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.arange(3, 9).unsqueeze(0), cache=cache, use_cache=True)
        assert cache_bytes(cache).logical == kv_bytes(spec, settings, 6)
        for n in range(7, 30):
            model(torch.tensor([[n]]), cache=cache, use_cache=True)
            assert cache_bytes(cache).logical == kv_bytes(spec, settings, n), n
    assert all(type(s).from_json(s.to_json()) == s for s in spec.layer_states)  # as the memoised view stores it

"""MLX's caches against the predictor, byte for byte, with the real MLX on the CPU.

Two layers of checks:
- the real mlx-lm cache classes driven with random K/V of seeded random histories (multi-token chunks and
  single tokens mixed, rotations, concatenations after a rotation): ``nbytes`` after every update equals
  ``CacheTrack``'s prediction;
- tiny Llama models (MHA, GQA, MQA; float32, float16, bfloat16; random weights saved as safetensors +
  config.json in a temporary folder, loaded with mlx-lm's own ``load_model``) run token by token with every
  cache kind, for prompts around the 256-token step and past the prefill chunk: the arrays' bytes
  after every update equal the prediction made from the config alone.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from kvscope.core.runtimes.mlx.predict import (KV, QUANTIZED, ROTATING, STEP, CacheTrack, LayerShape, MlxCache,
                                               ModelTrack, kv_after, layers_of, parse_cache, prompt_chunks,
                                               quantize_problem, slot_bytes)

try:
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache
except Exception as exc:  # noqa: BLE001 - the reason is the skip's
    mx = None
    MISSING = f"mlx / mlx-lm not importable here ({type(exc).__name__}: {exc}); make test installs the mlx extra"
else:
    MISSING = None

needs_mlx = pytest.mark.skipif(mx is None, reason=MISSING or "")

# ---------------------------------------------------------------------------------------------------- caches

ROTATING_CACHES = [MlxCache(ROTATING, max_size=m, keep=k) for m, k in itertools.product((7, 255, 256, 300), (0, 4))]
QUANT_CACHES = [MlxCache(QUANTIZED, bits=b, group_size=g) for b, g in itertools.product((8, 4, 2), (32, 64))]
CACHES = [MlxCache(KV)] + ROTATING_CACHES + QUANT_CACHES


def _real_cache(c: MlxCache):
    if c.kind == ROTATING:
        return mlx_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if c.kind == QUANTIZED:
        return mlx_cache.QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    return mlx_cache.KVCache()


def _history(rng: random.Random, total: int) -> list[int]:
    """Update sizes: mostly single tokens, some chunks (some longer than a step)."""
    out, n = [], 0
    while n < total:
        size = 1 if rng.random() < 0.8 else rng.choice((2, 3, 17, 255, 256, 257, 300))
        out.append(size)
        n += size
    return out


@needs_mlx
@pytest.mark.parametrize("cache", CACHES, ids=lambda c: c.key)
def test_cache_classes_follow_the_rules_through_random_histories(cache):
    """Seeded fuzz: three random histories per cache, every update checked."""
    for seed in range(3):
        rng = random.Random(f"{cache.key}-{seed}")
        heads, dim = rng.choice(((1, 64), (2, 32), (4, 64), (3, 128))), None
        heads, dim = heads
        layer = LayerShape(heads=heads, k_dim=dim, v_dim=dim, itemsize=2)
        if quantize_problem((layer,), cache):
            continue
        real, track = _real_cache(cache), CacheTrack(cache)
        for i, n in enumerate(_history(rng, 700)):
            k = mx.random.normal((1, heads, n, dim)).astype(mx.float16)
            real.update_and_fetch(k, k)
            track.feed(n)
            assert real.nbytes == track.capacity * slot_bytes(layer, cache), (cache.key, seed, i, n, track)
            assert real.offset == track.offset
            if cache.kind == ROTATING:
                assert real._idx == track.idx, (cache.key, seed, i, n)
            mx.eval(real.state)


@needs_mlx
@pytest.mark.parametrize("cache", [MlxCache(KV), MlxCache(ROTATING, max_size=300, keep=4),
                                   MlxCache(QUANTIZED, bits=8, group_size=64), MlxCache(QUANTIZED, bits=4, group_size=32)],
                         ids=lambda c: c.key)
def test_every_token_from_1_to_600(cache):
    """A one-token prompt decoded to 600 tokens: 1, 255, 256, 257 ... 600, every token checked."""
    layer = LayerShape(heads=2, k_dim=64, v_dim=64, itemsize=2)
    real, track = _real_cache(cache), CacheTrack(cache)
    k = mx.zeros((1, 2, 1, 64), dtype=mx.float16)
    for n in range(1, 601):
        real.update_and_fetch(k, k)
        track.feed(1)
        assert real.nbytes == track.capacity * slot_bytes(layer, cache) == kv_after((layer,), cache, 1, n - 1), n
    mx.eval(real.state)


def test_decode_in_one_jump_equals_token_by_token():
    """``decode(n)`` (O(window / 256)) lands where n one-token feeds land, from seeded random states."""
    rng = random.Random(7)
    for cache in CACHES:
        for _ in range(20):
            a = CacheTrack(cache)
            for n in _history(rng, rng.randrange(0, 900)):
                a.feed(n)
            b = a.copy()
            k = rng.randrange(1, 1500)
            a.decode(k)
            for _ in range(k):
                b.feed(1)
            assert (a.capacity, a.offset, a.idx) == (b.capacity, b.offset, b.idx), (cache.key, k)


def test_kv_staircase_steps_every_256_tokens():
    layer = LayerShape(heads=2, k_dim=64, v_dim=64, itemsize=2)
    per_slot = slot_bytes(layer, MlxCache())
    for n in (1, 255, 256, 257, 511, 512, 513, 600):
        assert kv_after((layer,), MlxCache(), n) == -(-n // STEP) * STEP * per_slot
        assert kv_after((layer,), MlxCache(), 1, n - 1) == kv_after((layer,), MlxCache(), n)


def test_prompt_chunks_are_generate_steps():
    assert prompt_chunks(1) == [1]
    assert prompt_chunks(2) == [1, 1]
    assert prompt_chunks(2049) == [2048, 1]
    assert prompt_chunks(2050) == [2048, 1, 1]
    assert prompt_chunks(5000, 2048) == [2048, 2048, 903, 1]


@pytest.mark.parametrize("spelled,key", [("kv", "kv"), ("dynamic", "kv"), ("rotating:512", "rotating:512:4"),
                                         ("rotating:512:0", "rotating:512:0"), ("q8", "quantized:8:64"),
                                         ("quantized:4:32", "quantized:4:32"), ("Q4:128", "quantized:4:128")])
def test_cache_spellings(spelled, key):
    assert parse_cache(spelled).key == key


@pytest.mark.parametrize("spelled,says", [("rotating", "rotating:MAX"), ("rotating:8:8", "keep"),
                                          ("quantized:7", "bits"), ("quantized:8:48", "groups"),
                                          ("paged", "one of kv"), ("rotating:x", "rotating:MAX")])
def test_bad_cache_spellings_say_why(spelled, says):
    from kvscope.core.model.attention import SettingsError

    with pytest.raises(SettingsError, match=says):
        parse_cache(spelled)


@needs_mlx
def test_quantize_refusal_is_mx_quantize_s():
    """A group size that does not divide the head dim: the predictor refuses it, and so does mx.quantize."""
    layer = LayerShape(heads=2, k_dim=32, v_dim=32, itemsize=4)
    cache = MlxCache(QUANTIZED, bits=8, group_size=64)
    assert quantize_problem((layer,), cache)
    with pytest.raises(ValueError):
        mx.eval(mx.quantize(mx.zeros((1, 2, 4, 32)), group_size=64, bits=8))
    assert quantize_problem((layer,), MlxCache(QUANTIZED, bits=8, group_size=32)) is None


# ---------------------------------------------------------------------------------------------------- models

#: (query heads, K/V heads, head dim): MHA, GQA and MQA, generated.
ATTENTION = [(4, kv, hd) for kv, hd in zip((4, 2, 1), (64, 32, 64))]
DTYPES = ("float32", "float16", "bfloat16")


def _tiny_llama(folder, heads: int, kv_heads: int, head_dim: int, dtype: str, seed: int):
    """A 2-layer Llama with random weights, written as mlx-lm reads one: config.json + model.safetensors."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "intermediate_size": 96, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 96, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "tie_word_embeddings": True, "torch_dtype": dtype, "dtype": dtype,
              "rope_theta": 10000.0}
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return config


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    if mx is None:
        pytest.skip(MISSING)
    from mlx_lm.utils import load_model

    from kvscope.core.model.hf_config import spec_from_config

    out = {}
    for i, (heads, kv, hd) in enumerate(ATTENTION):
        dtype = DTYPES[i % len(DTYPES)]
        folder = tmp_path_factory.mktemp(f"llama-{heads}q-{kv}kv-{hd}")
        config = _tiny_llama(folder, heads, kv, hd, dtype, seed=i)
        model, _ = load_model(folder)
        spec = spec_from_config(json.loads((folder / "config.json").read_text()), folder.name)
        out[(heads, kv, hd)] = (model, layers_of(spec), config)
    return out


def _model_caches():
    """Per attention: KVCache, a rotating cache near the step and one past it, 8- and 4-bit quantized."""
    for att in ATTENTION:
        for cache in (MlxCache(KV), MlxCache(ROTATING, max_size=256, keep=4), MlxCache(ROTATING, max_size=300, keep=0),
                      MlxCache(QUANTIZED, bits=8, group_size=32), MlxCache(QUANTIZED, bits=4, group_size=64)):
            yield att, cache


#: (prompt tokens, tokens decoded after it): prompts around the step (each decoded across it), past a rotating
#: window, and past the 2048-token prefill chunk. (The long token-by-token decode through 1 ... 600 is
#: test_every_token_from_1_to_600 on the cache classes: a forward pass per token of 15 models costs minutes.)
HISTORIES = [(1, 2), (254, 3), (256, 2), (257, 1), (600, 2), (650, 1)]
#: The prompt's chunk in this test: smaller than generate_step's 2048 so that a 650-token prompt goes in three
#: chunks and a last token (the rule is the same; 2048 itself is test_prompt_chunks_are_generate_steps').
CHUNK = 300


@needs_mlx
@pytest.mark.parametrize("att,cache", list(_model_caches()), ids=lambda v: v.key if isinstance(v, MlxCache) else
                         f"{v[0]}q{v[1]}kv-d{v[2]}")
def test_model_cache_bytes_equal_prediction_at_every_token(tiny_models, att, cache):
    model, layers, config = tiny_models[att]
    assert all(l.heads == att[1] and l.k_dim == att[2] for l in layers)
    assert layers[0].itemsize == getattr(mx, config["dtype"]).size
    problem = quantize_problem(layers, cache)
    if problem:  # the predictor refuses what mx.quantize would: check that it would
        with pytest.raises(ValueError):
            mx.eval(mx.quantize(mx.zeros((1, att[1], 1, att[2])), group_size=cache.group_size, bits=cache.bits))
        return
    rng = random.Random(f"{att}-{cache.key}")
    checked = 0
    for prompt, generated in HISTORIES:
        if cache.kind == QUANTIZED and prompt > 300:
            continue  # MLX's quantized attention over a long prompt in half precision takes minutes on a CPU
        caches = [_real_cache(cache) for _ in layers]
        track = ModelTrack(layers, cache)
        updates = prompt_chunks(prompt, CHUNK) + [1] * generated
        for i, n in enumerate(updates):
            ids = mx.array([[rng.randrange(config["vocab_size"]) for _ in range(n)]])
            mx.eval(model(ids, cache=caches))
            track.feed(n)
            observed = sum(c.nbytes for c in caches)
            assert observed == track.nbytes, (att, cache.key, prompt, generated, i, n, observed, track.nbytes)
            checked += 1
    assert checked == sum(len(prompt_chunks(p, CHUNK)) + g for p, g in HISTORIES
                          if not (cache.kind == QUANTIZED and p > 300))

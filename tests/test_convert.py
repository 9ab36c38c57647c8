"""Live conversions (core/runtimes/transformers/convert.py) on real tiny transformers models, fp32 on the CPU.

Every check is a real forward pass. Equality is ``torch.equal`` (bit for bit) wherever both sides
run the same kernels on the same numbers, which is the case with the eager attention kernel;
tolerances are used only where the two sides run differently shaped matmuls (sdpa's GQA packing,
a static cache's padded slots), and each says so.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, QuantizedCache, StaticCache

from kvscope.core.model.attention import GQA, MHA, MLA, MQA, SettingsError, Window
from kvscope.core.model.caches import Dynamic, Static, kv_layout
from kvscope.core.model.hf_config import spec_from_config
from kvscope.core.runtimes.transformers.convert import (DynamicTruncatedLayer, convert_cache,
                                                        convert_cache_kv_heads, convert_cache_window, dense_kv,
                                                        kv_heads_of, refill_cache, regroup_heads, set_kv_heads,
                                                        with_window)

HEADS, HEAD_DIM, VOCAB = 8, 8, 128


def tiny_config(kv_heads: int = HEADS, layers: int = 2, attn: str = "eager", **extra) -> LlamaConfig:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=HEADS,
                         num_key_value_heads=kv_heads, head_dim=HEAD_DIM, vocab_size=VOCAB,
                         max_position_embeddings=256, **extra)
    config._attn_implementation = attn
    return config


def tiny_llama(kv_heads: int = HEADS, layers: int = 2, attn: str = "eager", seed: int = 0, **extra) -> LlamaForCausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(kv_heads, layers, attn, **extra))
    return model.eval()


def token_ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def step(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Run ``ids`` ([1, n]) through the model on ``cache``; the logits of the last position."""
    with torch.inference_mode():
        return model(ids, cache=cache).logits[:, -1]


def kv_nbytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def llama_spec(config: LlamaConfig, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path))  # spec_from_config memoises parameter counts on disk
    return spec_from_config(config.to_dict(), "tiny")


# ------------------------------------------------------------------------------------------------
# KV heads


def repeated_mha_twin(gqa: LlamaForCausalLM) -> LlamaForCausalLM:
    """An MHA model built by hand from a GQA model, independently of kvscope.core.runtimes.transformers.convert: query head i
    reads KV head i // groups (transformers' repeat_kv), so MHA head i gets GQA head i // groups."""
    kv = gqa.config.num_key_value_heads
    groups = HEADS // kv
    mha = tiny_llama(HEADS, layers=gqa.config.num_hidden_layers, attn=gqa.config._attn_implementation, seed=99,
                     attention_bias=gqa.config.attention_bias)
    state = gqa.state_dict()
    for key, value in list(state.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            heads = value.reshape(kv, HEAD_DIM, *value.shape[1:])
            state[key] = torch.cat([heads[i // groups] for i in range(HEADS)])
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("attn,bias", [("eager", False), ("sdpa", False), ("eager", True)])
def test_gqa_to_mha_mid_generation_matches_mha_from_start(attn, bias):
    gqa = tiny_llama(kv_heads=2, attn=attn, attention_bias=bias)
    mha = repeated_mha_twin(gqa)
    ids = token_ids(12)
    prompt, decoded = ids[:, :6], ids[:, 6:]

    cache_gqa, cache_mha = DynamicCache(config=gqa.config), DynamicCache(config=mha.config)
    step(gqa, cache_gqa, prompt), step(mha, cache_mha, prompt)
    for t in range(3):
        step(gqa, cache_gqa, decoded[:, t:t + 1]), step(mha, cache_mha, decoded[:, t:t + 1])

    assert set_kv_heads(gqa, HEADS) is True
    assert convert_cache_kv_heads(cache_gqa, 2, HEADS) is True
    assert kv_heads_of(gqa) == HEADS and gqa.config.num_key_value_heads == HEADS
    assert all(layer.self_attn.num_key_value_groups == 1 for layer in gqa.model.layers)
    assert cache_gqa.get_seq_length() == cache_mha.get_seq_length() == 9

    for t in range(3, 6):
        after_switch = step(gqa, cache_gqa, decoded[:, t:t + 1])
        from_start = step(mha, cache_mha, decoded[:, t:t + 1])
        if attn == "eager":
            # eager repeats K/V (repeat_kv) before the same matmuls MHA runs: bit-identical.
            assert torch.equal(after_switch, from_start)
        else:
            # sdpa runs GQA decode steps with the query heads packed (pack_gqa), a differently
            # shaped matmul than MHA's. Bit-identical on this CPU build, but other backends may
            # round differently, so only a tolerance is promised here.
            torch.testing.assert_close(after_switch, from_start, atol=1e-6, rtol=0)
    for mine, theirs in zip(cache_gqa.layers, cache_mha.layers):
        if attn == "eager":
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_mha_to_mqa_divides_kv_bytes_by_the_head_ratio(tmp_path, monkeypatch):
    model = tiny_llama()
    spec = llama_spec(model.config, tmp_path, monkeypatch)
    ids = token_ids(10)
    cache = DynamicCache(config=model.config)
    step(model, cache, ids[:, :7])
    before_step = kv_nbytes(cache)
    step(model, cache, ids[:, 7:8])
    mha_bytes = kv_nbytes(cache)
    mha_per_token = mha_bytes - before_step

    assert set_kv_heads(model, 1) is False  # pooling 8 heads into 1 is approximate
    convert_cache_kv_heads(cache, HEADS, 1)
    mqa_bytes = kv_nbytes(cache)
    assert mha_bytes == HEADS * mqa_bytes
    assert cache.get_seq_length() == 8
    step(model, cache, ids[:, 8:9])
    mqa_per_token = kv_nbytes(cache) - mqa_bytes
    assert mha_per_token == HEADS * mqa_per_token == 2 * 2 * HEADS * HEAD_DIM * 4  # layers x (K+V) x heads x d x fp32
    # The live cache holds exactly what the predictor says an MQA cache holds.
    assert kv_nbytes(cache) == Dynamic().kv_bytes(kv_layout(MQA().apply(spec)), 1, 9, 4)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "window"])
def test_mha_gqa_mqa_round_trip_keeps_cache_consistent(cache_kind, tmp_path, monkeypatch):
    model = tiny_llama()
    spec = llama_spec(model.config, tmp_path, monkeypatch)
    if cache_kind == "window":
        model = with_window(model, 6)
    cache = (StaticCache(config=model.config, max_cache_len=32) if cache_kind == "static"
             else DynamicCache(config=model.config))
    ids = token_ids(14)
    step(model, cache, ids[:, :5])
    seen, old = 5, HEADS
    for mode, new, exact in [(GQA(2), 2, False), (MQA(), 1, False), (GQA(4), 4, True), (MHA(), HEADS, True)]:
        assert set_kv_heads(model, new) is exact
        assert convert_cache_kv_heads(cache, old, new) is exact
        assert int(cache.get_seq_length()) == seen
        for layer in cache.layers:
            held = {"dynamic": seen, "static": 32, "window": min(seen, 5)}[cache_kind]
            assert layer.keys.shape == layer.values.shape == (1, new, held, HEAD_DIM)
        logits = step(model, cache, ids[:, seen:seen + 1])
        seen += 1
        assert torch.isfinite(logits).all() and int(cache.get_seq_length()) == seen
        assert kv_heads_of(model) == new == model.config.num_key_value_heads
        if cache_kind == "dynamic":
            assert kv_nbytes(cache) == Dynamic().kv_bytes(kv_layout(mode.apply(spec)), 1, seen, 4)
        if cache_kind == "static":
            assert kv_nbytes(cache) == Static().kv_bytes(kv_layout(mode.apply(spec)), 1, seen, 4, max_context=32)
        old = new
    # After MQA every head was one head; repeating it back up leaves 8 identical heads.
    k = model.model.layers[0].self_attn.k_proj.weight.reshape(HEADS, HEAD_DIM, -1)
    assert all(torch.equal(k[0], k[h]) for h in range(HEADS))


def test_kv_heads_that_do_not_divide_the_query_heads_are_refused():
    model = tiny_llama()
    with pytest.raises(SettingsError, match="3 KV heads do not divide the 8 query heads; choose one of 1, 2, 4, 8"):
        set_kv_heads(model, 3)
    assert kv_heads_of(model) == HEADS  # untouched
    with pytest.raises(SettingsError, match="latent"):
        set_kv_heads(_tiny_deepseek(), 2)
    with pytest.raises(SettingsError, match="holds 8 K/V heads, not 2"):
        cache = DynamicCache(config=model.config)
        step(model, cache, token_ids(3))
        convert_cache_kv_heads(cache, 2, 1)


def test_pooling_down_is_the_group_mean_and_exact_only_at_layer_zero():
    model = tiny_llama()
    k_before = model.model.layers[1].self_attn.k_proj.weight.detach().clone().reshape(HEADS, HEAD_DIM, -1)
    ids = token_ids(6)
    cache = DynamicCache(config=model.config)
    step(model, cache, ids)
    set_kv_heads(model, 2)
    convert_cache_kv_heads(cache, HEADS, 2)
    k_after = model.model.layers[1].self_attn.k_proj.weight.reshape(2, HEAD_DIM, -1)
    # KV head j of GQA(2) serves query heads 4j..4j+3, so it is the mean of those four MHA heads.
    torch.testing.assert_close(k_after[1], k_before[4:8].mean(0), atol=1e-7, rtol=0)

    fresh = DynamicCache(config=model.config)
    step(model, fresh, ids)
    # Layer 0's K/V are linear in the embeddings (RoPE rotates every head alike): the pooled
    # cache is what the pooled model computes, up to rounding...
    torch.testing.assert_close(cache.layers[0].keys, fresh.layers[0].keys, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache.layers[0].values, fresh.layers[0].values, atol=1e-6, rtol=0)
    # ...deeper layers saw the unpooled model's hidden states: approximate.
    assert not torch.allclose(cache.layers[1].keys, fresh.layers[1].keys, atol=1e-4)


def test_regroup_other_pairs_go_through_the_lcm():
    x = torch.arange(6.0).reshape(1, 6, 1, 1)
    # 6 -> 4 heads: up to lcm 12 (each head twice), then pool runs of 3.
    y = regroup_heads(x, 6, 4, 1).flatten().tolist()
    assert y == pytest.approx([(0 + 0 + 1) / 3, (1 + 2 + 2) / 3, (3 + 3 + 4) / 3, (4 + 5 + 5) / 3])


def test_quantized_cache_heads_are_requantized():
    model = tiny_llama()
    ids = token_ids(10)
    cache = QuantizedCache("quanto", config=model.config, nbits=4, q_group_size=8, residual_length=4)
    step(model, cache, ids[:, :6])
    step(model, cache, ids[:, 6:7])  # one token in the full-precision residual
    dense_before = dense_kv(cache)
    assert set_kv_heads(model, 2) is False
    assert convert_cache_kv_heads(cache, HEADS, 2) is False
    assert cache.get_seq_length() == 7
    for (k0, _), (k1, _) in zip(dense_before, dense_kv(cache)):
        assert k1.shape == (1, 2, 7, HEAD_DIM)
        expected = regroup_heads(k0, HEADS, 2, 1)
        # 4-bit codes over 8-element groups: within a sixteenth of each group's range, give or take.
        assert (k1 - expected).abs().max() <= (expected.amax() - expected.amin()) / 8
    assert torch.isfinite(step(model, cache, ids[:, 7:8])).all()
    assert cache.get_seq_length() == 8

    # fp8 keeps one scale per tensor; repeating heads keeps the amax, so going up loses nothing.
    fp8 = QuantizedCache("fp8", config=model.config)
    step(model, fp8, ids[:, :6])
    codes = [layer._quantized_keys[0].float() for layer in fp8.layers]
    assert convert_cache_kv_heads(fp8, 2, HEADS) is True
    for before, layer in zip(codes, fp8.layers):
        assert torch.equal(layer._quantized_keys[0].float(), before.repeat_interleave(4, dim=1))


# ------------------------------------------------------------------------------------------------
# Cache strategies


def test_dynamic_static_dynamic_refill_keeps_next_token_logits():
    model = tiny_llama()
    ids = token_ids(12)
    reference = DynamicCache(config=model.config)
    step(model, reference, ids[:, :8])
    switched = DynamicCache(config=model.config)
    step(model, switched, ids[:, :8])

    static = StaticCache(config=model.config, max_cache_len=24)
    refill_cache(static, dense_kv(switched))
    assert int(static.get_seq_length()) == 8
    assert static.layers[0].keys.shape == (1, HEADS, 24, HEAD_DIM)
    back = DynamicCache(config=model.config)
    convert_cache(static, back)
    assert back.get_seq_length() == 8
    # dynamic -> static -> dynamic copies every value: the next logits are bit-identical.
    assert torch.equal(step(model, back, ids[:, 8:9]), step(model, reference, ids[:, 8:9]))

    static = StaticCache(config=model.config, max_cache_len=24)
    convert_cache(back, static)
    on_static = step(model, static, ids[:, 9:10])
    on_dynamic = step(model, reference, ids[:, 9:10])
    # A static step attends over all 24 slots (the empty ones masked), a longer reduction than
    # the dynamic step's 10: equal up to float rounding, not bit for bit.
    torch.testing.assert_close(on_static, on_dynamic, atol=1e-5, rtol=0)
    assert int(static.get_seq_length()) == 10


def test_refill_into_quantized_and_back():
    model = tiny_llama()
    ids = token_ids(12)
    cache = DynamicCache(config=model.config)
    step(model, cache, ids[:, :9])
    exact = dense_kv(cache)
    quantized = QuantizedCache("quanto", config=model.config, nbits=4, q_group_size=8, residual_length=4)
    convert_cache(cache, quantized)
    assert quantized.get_seq_length() == 9
    # The single refill update quantized all 9 tokens; the residual starts empty.
    assert all(layer.keys.numel() == 0 for layer in quantized.layers)
    assert torch.isfinite(step(model, quantized, ids[:, 9:10])).all()
    assert quantized.get_seq_length() == 10

    back = DynamicCache(config=model.config)
    convert_cache(quantized, back)
    assert back.get_seq_length() == 10 and back.layers[0].keys.shape == (1, HEADS, 10, HEAD_DIM)
    k_exact, k_back = exact[1][0], back.layers[1].keys[:, :, :9]
    assert 0 < (k_back - k_exact).abs().max() <= (k_exact.amax() - k_exact.amin()) / 8
    step(model, back, ids[:, 10:11])
    assert back.get_seq_length() == 11


def test_refill_refuses_what_it_cannot_hold():
    model = tiny_llama()
    cache = DynamicCache(config=model.config)
    step(model, cache, token_ids(9))
    with pytest.raises(SettingsError, match="static cache of 4 tokens cannot hold the 9"):
        convert_cache(cache, StaticCache(config=model.config, max_cache_len=4))
    with pytest.raises(SettingsError, match="run the prompt"):
        dense_kv(DynamicCache(config=model.config))


# ------------------------------------------------------------------------------------------------
# Sliding window


def test_window_twin_shares_the_llama_parameters():
    llama = tiny_llama()
    twin = with_window(llama, 64)
    assert type(twin).__name__ == "MistralForCausalLM" and twin.config.sliding_window == 64
    theirs = {p.data_ptr() for p in llama.parameters()}
    assert {p.data_ptr() for p in twin.parameters()} == theirs
    assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in llama.parameters())
    assert with_window(llama, None) is llama
    ids = token_ids(10)
    # A window wider than the sequence changes nothing.
    assert torch.equal(step(twin, DynamicCache(config=twin.config), ids), step(llama, DynamicCache(config=llama.config), ids))
    with pytest.raises(SettingsError, match="at least 2"):
        with_window(llama, 1)


def _windowed_run(window: int, switch_at: int, total: int):
    """Logits after switching a full-attention Llama to ``window`` when ``switch_at`` tokens are
    cached, and those of the same weights windowed from the start, for tokens switch_at..total-1."""
    llama = tiny_llama()
    ids = token_ids(total)
    cache = DynamicCache(config=llama.config)
    step(llama, cache, ids[:, :4])
    for t in range(4, switch_at):
        step(llama, cache, ids[:, t:t + 1])
    model = with_window(llama, window)
    assert convert_cache_window(cache, window, model.config) == 0
    assert cache.get_seq_length() == switch_at
    assert all(layer.keys.shape[-2] == min(switch_at, window - 1) for layer in cache.layers)

    reference = DynamicCache(config=model.config)
    step(model, reference, ids[:, :4])
    for t in range(4, switch_at):
        step(model, reference, ids[:, t:t + 1])
    pairs = [(step(model, cache, ids[:, t:t + 1]), step(model, reference, ids[:, t:t + 1]))
             for t in range(switch_at, total)]
    return model, cache, reference, ids, pairs


def test_window_switch_matches_window_from_start_while_sequence_fits():
    # 8 tokens cached, window 8: no query has yet reached back further than the window, so the
    # full-attention K/V are the windowed model's K/V, and every later step agrees bit for bit.
    window = 8
    *_, pairs = _windowed_run(window, switch_at=window, total=window + 6)
    for switched, from_start in pairs:
        assert torch.equal(switched, from_start)


def test_window_switch_past_the_window_differs_then_back_to_full_drops_tokens():
    window = 5
    model, cache, reference, ids, pairs = _windowed_run(window, switch_at=9, total=11)
    # 9 > W: tokens 5..8 attended further back than W under full attention, so their K/V differ.
    assert not torch.allclose(pairs[0][0], pairs[0][1], atol=1e-4)
    assert cache.get_seq_length() == 11 and cache.layers[0].keys.shape[-2] == window - 1

    # Window -> full on the reference (windowed from the start): only the last W - 1 are held.
    again, windowed = copy.deepcopy(model), copy.deepcopy(reference)  # stay windowed, for comparison
    full = with_window(model, None)
    assert full is model and full.config.sliding_window is None
    assert convert_cache_window(reference, None, full.config) == 11 - (window - 1)
    assert isinstance(reference.layers[0], DynamicTruncatedLayer)
    assert reference.get_seq_length() == 11
    nxt = token_ids(12)[:, 11:12]
    # The first full-attention query sees the W - 1 held tokens and itself: the same set a window
    # W query sees, at the same RoPE positions.
    assert torch.equal(step(full, reference, nxt), step(again, windowed, nxt))
    assert reference.get_seq_length() == 12 and reference.layers[0].keys.shape[-2] == window


def test_window_cache_refills_into_a_static_window_cache():
    window = 6
    model, cache, reference, ids, _ = _windowed_run(window, switch_at=8, total=10)
    static = StaticCache(config=model.config, max_cache_len=32)
    convert_cache(reference, static)
    assert static.get_seq_length() == 10 and static.layers[0].keys.shape == (1, HEADS, window, HEAD_DIM)
    nxt = token_ids(11)[:, 10:11]
    # The static window layer rolls a W-slot buffer; same tokens attended, shapes differ: rounding only.
    torch.testing.assert_close(step(model, static, nxt), step(model, reference, nxt), atol=1e-5, rtol=0)
    with pytest.raises(SettingsError, match="dynamic cache"):
        convert_cache_window(static, None, model.config)
    # Back to a dynamic window cache: a full static window gives the W - 1 tokens still in reach
    # (its slot 0 is about to roll out), the same tokens the reference holds.
    assert all(k.shape[-2] == window - 1 for k, _ in dense_kv(static))
    back = DynamicCache(config=model.config)
    convert_cache(static, back)
    assert back.get_seq_length() == 11
    for mine, theirs in zip(back.layers, reference.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=0)
    nxt = token_ids(12)[:, 11:12]
    torch.testing.assert_close(step(model, back, nxt), step(model, reference, nxt), atol=1e-5, rtol=0)


def test_qwen2_window_set_in_place_matches_a_qwen2_built_with_it():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def qwen(**window):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
                                 num_key_value_heads=2, head_dim=HEAD_DIM, vocab_size=VOCAB, **window)
            config._attn_implementation = "eager"
            return Qwen2ForCausalLM(config).eval()

    plain = qwen()
    built = qwen(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    built.load_state_dict(plain.state_dict())
    assert with_window(plain, 4) is plain
    ids = token_ids(9)
    cache_a, cache_b = DynamicCache(config=plain.config), DynamicCache(config=built.config)
    assert torch.equal(step(plain, cache_a, ids[:, :8]), step(built, cache_b, ids[:, :8]))
    assert torch.equal(step(plain, cache_a, ids[:, 8:9]), step(built, cache_b, ids[:, 8:9]))
    assert cache_a.layers[0].keys.shape[-2] == 3


# ------------------------------------------------------------------------------------------------
# MLA


def _tiny_deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                              q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                              first_k_dense_replace=2, max_position_embeddings=64)
    return DeepseekV3ForCausalLM(config).eval()


@pytest.mark.parametrize("rank", [2 * HEADS * HEAD_DIM, 16])
def test_latent_cache_holds_the_predicted_bytes_and_is_exact_at_full_rank(rank, tmp_path, monkeypatch):
    from kvscope.core.runtimes.transformers import latent
    from kvscope.core.runtimes.transformers.measure import cache_bytes

    llama = tiny_llama()
    spec = llama_spec(llama.config, tmp_path, monkeypatch)
    ids = token_ids(9)
    plain = DynamicCache(config=llama.config)
    step(llama, plain, ids[:, :6])
    cache = DynamicCache(config=llama.config)
    step(llama, cache, ids[:, :6])
    how = latent.convert_to_latent(cache, llama, rank)
    assert "rotary positions undone" in how
    for n in (6, 7, 8):
        ours, theirs = step(llama, cache, ids[:, n:n + 1]), step(llama, plain, ids[:, n:n + 1])
        if rank == 2 * HEADS * HEAD_DIM:
            assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
        assert cache_bytes(cache).logical == Dynamic().kv_bytes(kv_layout(MLA(rank).apply(spec)), 1, n + 1, 4)
    assert cache.get_seq_length() == 9 and all(isinstance(layer, latent.LatentLayer) for layer in cache.layers)


def test_window_cache_bytes_match_the_predictor(tmp_path, monkeypatch):
    llama = tiny_llama()
    spec = llama_spec(llama.config, tmp_path, monkeypatch)
    _, cache, *_ = _windowed_run(5, switch_at=7, total=9)
    assert kv_nbytes(cache) == Dynamic().kv_bytes(kv_layout(Window(5).apply(spec)), 1, 9, 4)


def test_conversions_run_inside_inference_mode():
    # The engine's worker thread runs under torch.inference_mode(); every conversion must too.
    llama = tiny_llama()
    ids = token_ids(9)
    with torch.inference_mode():
        cache = DynamicCache(config=llama.config)
        llama(ids[:, :6], cache=cache)
        set_kv_heads(llama, 2)
        convert_cache_kv_heads(cache, HEADS, 2)
        model = with_window(llama, 4)
        convert_cache_window(cache, 4, model.config)
        static = StaticCache(config=model.config, max_cache_len=16)
        convert_cache(cache, static)
        assert torch.isfinite(model(ids[:, 6:7], cache=static).logits).all()
        from kvscope.core.runtimes.transformers import latent

        plain = DynamicCache(config=llama.config)
        llama(ids[:, :6], cache=plain)
        latent.convert_to_latent(plain, llama, 8)
        assert torch.isfinite(llama(ids[:, 6:7], cache=plain).logits).all()
    assert static.get_seq_length() == 7 and not model.model.layers[0].self_attn.k_proj.weight.requires_grad

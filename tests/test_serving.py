"""Serving capacity under vLLM 0.33.0's rules (kvscope.core.prediction.serving, calc --runtime vllm), by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.prediction.parallel import Parallelism
from kvscope.core.prediction.predict import activation_bytes
from kvscope.core.prediction.serving import VllmOptions, default_max_num_batched_tokens, vllm_capacity

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20


def test_llama3_8b_on_one_24gib_gpu_by_hand():
    spec = load_spec("llama-3-8b")
    cap = vllm_capacity(spec, RunSettings(), 24 * GiB)
    (w,) = cap.workers
    assert w.requested == math.ceil(24 * GiB * 0.92) == 23_708_219_474
    assert w.weights == 16_060_523_008  # 8,030,261,248 parameters x 2 B, plus its rotary buffer
    # vLLM's AttentionSpec.page_size_bytes x 32 layers: 16 tokens x 8 heads x (128 + 128) x 2 B x 32 = 2 MiB
    assert w.block_bytes == 16 * 8 * 256 * 2 * 32 == 2_097_152
    # the estimated terms: the activation peak over 2,048 tokens (vLLM's default below 70 GiB), 512 MiB each else
    assert cap.max_num_batched_tokens == 2048
    assert w.activation_peak == activation_bytes(spec, RunSettings(attn_impl="flash"), 2048, 2048)
    assert w.non_torch == w.cudagraphs == 512 * MiB
    available = w.requested - w.weights - w.activation_peak - 1024 * MiB
    assert w.available_kv == available
    assert cap.num_gpu_blocks == available // 2_097_152
    # 8,192 tokens per request = 512 blocks
    assert cap.blocks_per_request == 512
    assert cap.concurrency() == cap.num_gpu_blocks / 512
    assert cap.kv_cache_tokens == cap.num_gpu_blocks * 16
    assert cap.log_line() == (f"GPU KV cache size: {cap.num_gpu_blocks * 16:,} tokens, Maximum concurrency for 8,192 "
                              f"tokens per request: {cap.num_gpu_blocks / 512:.2f}x")


def test_concurrency_as_vllms_own_test():
    """vLLM's tests/v1/core/test_kv_cache_utils.py test_get_max_concurrency_for_kv_cache_config: 32 layers,
    block_size 16, max_model_len 16,384, 1,536 blocks -> 1.5 (a 32-head fp16 full-attention spec)."""
    spec = load_spec("llama-3-8b")
    opts = VllmOptions(max_model_len=16384)
    cap = vllm_capacity(spec, RunSettings(), 24 * GiB, opts)
    blocks = 1536
    avail = blocks * cap.workers[0].block_bytes
    # give the worker exactly 1,536 blocks' worth: fix the overheads so that available == avail
    extra = cap.workers[0].available_kv - avail
    cap2 = vllm_capacity(spec, RunSettings(), 24 * GiB, VllmOptions(max_model_len=16384, non_torch_bytes=512 * MiB + extra))
    assert cap2.num_gpu_blocks == 1536 and cap2.concurrency() == 1.5


def test_tp_uses_each_gpus_share_and_the_smallest_count():
    spec = load_spec("llama-3-70b")
    cap = vllm_capacity(spec, RunSettings(), 80 * GiB, parallelism=Parallelism(tensor=4))
    assert len(cap.workers) == 4 and len({w.num_blocks for w in cap.workers}) == 1
    assert cap.workers[0].block_bytes == 16 * 2 * 256 * 2 * 80  # 2 KV heads per GPU, 80 layers
    assert cap.max_num_batched_tokens == 8192  # vLLM's default from 70 GiB
    pp = vllm_capacity(spec, RunSettings(), 80 * GiB, parallelism=Parallelism(pipeline=3))
    # stages of 27, 27, 26 layers: the first stage (embedding + 27 layers) is the tightest
    assert pp.num_gpu_blocks == min(w.num_blocks for w in pp.workers) == pp.workers[0].num_blocks
    assert pp.workers[2].block_bytes == 16 * 8 * 256 * 2 * 26


def test_does_not_fit_and_refusals():
    spec = load_spec("llama-3-70b")
    cap = vllm_capacity(spec, RunSettings(), 80 * GiB)  # 131 GiB of weights on one 80 GiB GPU
    assert cap.num_gpu_blocks == 0 and cap.workers[0].available_kv < 0
    with pytest.raises(SettingsError):
        VllmOptions(gpu_memory_utilization=1.5)
    with pytest.raises(SettingsError):
        VllmOptions(gpu_memory_utilization=float("nan"))
    from kvscope.core.model.caches import parse_cache

    with pytest.raises(SettingsError, match="paged"):
        vllm_capacity(spec, RunSettings(cache=parse_cache("static")), 80 * GiB)
    assert default_max_num_batched_tokens(24 * GiB) == 2048 and default_max_num_batched_tokens(192 * GiB) == 16384


def test_cli_table_and_json():
    args = [sys.executable, "main.py", "calc", "--model", "llama-3-8b", "--context", "8k", "--gpu-memory", "24GiB",
            "--runtime", "vllm"]
    table = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "vLLM 0.33.0" in table.stdout and "Maximum concurrency for 8,192 tokens per request:" in table.stdout
    assert table.stdout.count("estimate") >= 3
    data = json.loads(subprocess.run(args + ["--json", "--cudagraph-memory", "0"], cwd=ROOT, capture_output=True,
                                     text=True, timeout=120).stdout)
    serving = data["serving"]
    assert serving["vllm_version"] == "0.33.0" and serving["workers"][0]["cudagraph_bytes"] == 0
    assert serving["kv_cache_tokens"] == serving["num_gpu_blocks"] * 16
    bad = subprocess.run(args[:-4] + ["--runtime", "vllm"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "needs --gpu-memory" in bad.stderr


# ------------------------------------------------------------------------------------------------
# Against start-up lines real vLLM servers printed (users' logs quoted in GitHub threads).


def _qwen3_14b():
    """Qwen3-14B's KV geometry (its config.json: 40 layers, 8 KV heads, head_dim 128, bfloat16); the other
    fields do not enter a block's bytes."""
    from kvscope.core.model.spec import ModelSpec

    return ModelSpec(name="qwen3-14b", model_type="qwen3", num_layers=40, num_query_heads=40, num_kv_heads=8,
                     head_dim=128, hidden_size=5120, vocab_size=151936, tie_word_embeddings=False,
                     max_position_embeddings=40960, dtype="bfloat16", num_parameters=14_768_307_200,
                     layer_types=("full_attention",) * 40)


def test_a_vllm_v1_log_for_qwen3_14b():
    """LMCache/LMCache issue #1739 quotes vLLM (V1) serving Qwen3-14B on one GPU:
    'Available KV cache memory: 6.51 GiB' / 'GPU KV cache size: 42,656 tokens' /
    'Maximum concurrency for 32,768 tokens per request: 1.30x'. The log rounds the memory to 0.01 GiB,
    which spans 2,664-2,668 blocks of 2.5 MiB; vLLM's 42,656 tokens are 2,666 of them, and 6.51 GiB itself
    gives exactly vLLM's block count, tokens and concurrency."""
    spec = _qwen3_14b()
    counts = set()
    for gib in (6.505, 6.51, 6.5149):
        cap = vllm_capacity(spec, RunSettings(), 80 * GiB,
                            VllmOptions(max_model_len=32768, kv_cache_memory=int(gib * GiB)))
        assert cap.workers[0].block_bytes == 16 * 8 * 256 * 2 * 40 == 2_621_440
        counts.add(cap.num_gpu_blocks)
    assert min(counts) <= 42_656 // 16 <= max(counts) and max(counts) - min(counts) <= 4
    cap = vllm_capacity(spec, RunSettings(), 80 * GiB, VllmOptions(max_model_len=32768, kv_cache_memory=int(6.51 * GiB)))
    assert cap.num_gpu_blocks == 2666 and cap.kv_cache_tokens == 42_656
    assert cap.log_line() == "GPU KV cache size: 42,656 tokens, Maximum concurrency for 32,768 tokens per request: 1.30x"


def test_a_vllm_v0_log_for_llama_31_8b_on_a_3090():
    """vllm-project/vllm issue #10517: Llama-3.1-8B-Instruct (Llama-3-8B's KV geometry) on an RTX 3090,
    gpu_memory_utilization 0.90, --max-model-len 29000: 'total_gpu_memory=23.58GiB ... peak_torch_memory=
    17.98GiB ... non_torch_memory=0.35GiB kv_cache_size=2.89GiB', '# GPU blocks: 1478', 'Maximum concurrency
    for 29000 tokens per request: 0.82x', 'maximum number of tokens that can be stored in KV cache (23648)'.
    The same subtraction (requested - profiled peak - non-torch), with vLLM's own profiled figures in
    place of KV Scope's estimates, lands within the log's rounding (0.01 GiB = 5 blocks each term)."""
    spec = load_spec("llama-3-8b")
    available = 23.58 * GiB * 0.90 - 17.98 * GiB - 0.35 * GiB
    cap = vllm_capacity(spec, RunSettings(), int(23.58 * GiB),
                        VllmOptions(gpu_memory_utilization=0.90, max_model_len=29000, kv_cache_memory=int(available)))
    assert abs(cap.num_gpu_blocks - 1478) <= 10
    exact = vllm_capacity(spec, RunSettings(), int(23.58 * GiB),
                          VllmOptions(max_model_len=29000, kv_cache_memory=1478 * 2 * MiB))
    assert exact.num_gpu_blocks == 1478 and exact.num_gpu_blocks * 16 == 23_648
    assert f"{exact.concurrency():.2f}x" == "0.82x"
    assert f"{exact.concurrency(20000):.2f}x" == f"{1478 * 16 / 20000:.2f}x"


# ------------------------------------------------------------------------------------------------
# Hybrid models: vLLM 0.33's hybrid KV cache manager (vllm/v1/core/kv_cache_planning.py
# _get_kv_cache_groups_uniform_page_size, get_kv_cache_config_from_groups; vllm/v1/core/kv_cache_utils.py
# get_max_concurrency_for_kv_cache_config; vllm/v1/kv_cache_interface.py SlidingWindowSpec), by vLLM's arithmetic.


def test_gemma3_27b_groups_as_vllms_hybrid_allocator():
    """Gemma-3-27B: 62 layers, 52 sliding (window 1,024) and 10 full, 16 KV heads x (128 + 128) x 2 B.
    vLLM: group_size = min(10, 52) = 10 (52 >= 1.5 x 10); the window layers split into cdiv(52, 10) = 6 groups,
    layers[i::6] = 9, 9, 9, 9, 8, 8 layers; the full ones into one group of 10. A block is the largest group's
    pages: 10 x (16 x 16 x 256 x 2 B) = 1.25 MiB. A request of 131,072 tokens takes 131,072 / 16 = 8,192 blocks in
    the full group and, in each window group, cdiv(min(1,023 + 2 x 8,192, 131,072), 16) + 1 = 1,089 (async
    scheduling's two batches in flight of max_num_batched_tokens 8,192 at 80 GiB)."""
    spec = load_spec("gemma-3-27b")
    assert spec.num_sliding_layers == 52 and spec.sliding_window == 1024
    cap = vllm_capacity(spec, RunSettings(), 80 * GiB, VllmOptions(kv_cache_memory=40 * GiB))
    page = 16 * 16 * 256 * 2
    assert sorted((g.kind, g.layers) for g in cap.groups) == [("full", 10)] + [("sliding window", n)
                                                                               for n in (8, 8, 9, 9, 9, 9)]
    assert all(g.page_bytes == page and g.block_size == 16 for g in cap.groups)
    assert cap.workers[0].block_bytes == 10 * page
    assert cap.num_gpu_blocks == 40 * GiB // (10 * page) == 32768
    assert cap.max_in_flight_tokens == 2 * 8192
    assert cap.blocks_per_request == 8192 + 6 * (-(-(1023 + 16384) // 16) + 1) == 8192 + 6 * 1089
    assert cap.concurrency() == 32768 / (8192 + 6 * 1089)
    assert cap.kv_cache_tokens == int(32768 / (8192 + 6 * 1089) * 131072)
    # with the hybrid manager off, every layer takes blocks for every token: one group of 62 layers
    off = vllm_capacity(spec, RunSettings(), 80 * GiB, VllmOptions(kv_cache_memory=40 * GiB,
                                                                    hybrid_kv_cache_manager=False))
    assert [(g.kind, g.layers) for g in off.groups] == [("full", 62)]
    assert off.workers[0].block_bytes == 62 * page and off.blocks_per_request == 8192
    assert cap.concurrency() > off.concurrency() * 2  # the window layers' blocks are what the hybrid saves


@pytest.mark.parametrize("n_full,n_swa,window,max_len,batched", [
    (10, 52, 1024, 131072, 8192), (4, 20, 512, 8192, 2048), (12, 13, 128, 32768, 2048), (1, 1, 4096, 4096, 2048),
    (8, 40, 4096, 65536, 16384), (6, 30, 1024, 3000, 2048),
])
def test_hybrid_groups_generated(n_full, n_swa, window, max_len, batched):
    """A generated spread of layer mixes, checked against vLLM's rules written out step by step."""
    from kvscope.core.model.caches import LayerKV
    from kvscope.core.prediction.serving import BlockGroup, block_groups

    layers = [LayerKV(heads=8, k_dim=128, v_dim=128)] * n_full + [LayerKV(heads=8, k_dim=128, v_dim=128,
                                                                          window=window)] * n_swa
    groups, block = block_groups(layers, 16, 2)
    page = 16 * 8 * 256 * 2
    size = min(n_full, n_swa)
    if max(n_full, n_swa) < 1.5 * size:  # gpt-oss + eagle: pad to the larger count instead
        size = max(n_full, n_swa)
    expected = []
    for kind, n in (("full", n_full), ("sliding window", n_swa)):
        k = -(-n // size)
        expected += [(kind, len(range(i, n, k))) for i in range(k)]
    assert sorted((g.kind, g.layers) for g in groups) == sorted(expected)
    assert block == max(n for _, n in expected) * page
    in_flight = 2 * batched
    per_request = sum(g.blocks_per_request(max_len, in_flight) for g in groups)
    swa_blocks = -(-min(window - 1 + in_flight, max_len) // 16) + 1
    assert per_request == sum(-(-max_len // 16) if kind == "full" else swa_blocks for kind, _ in expected)
    assert isinstance(groups[0], BlockGroup)


def test_smaller_window_pages_take_larger_blocks():
    """unify_kv_cache_spec_page_size: a window layer with half the page of a full layer gets block_size 32."""
    from kvscope.core.model.caches import LayerKV
    from kvscope.core.prediction.serving import block_groups

    layers = [LayerKV(heads=8, k_dim=128, v_dim=128)] * 2 + [LayerKV(heads=4, k_dim=128, v_dim=128, window=512)] * 10
    groups, block = block_groups(layers, 16, 2)
    swa = [g for g in groups if g.window]
    assert {g.block_size for g in swa} == {32} and {g.page_bytes for g in groups} == {16 * 8 * 256 * 2}
    assert swa[0].blocks_per_request(8192, 4096) == -(-min(511 + 4096, 8192) // 32) + 1


def test_mla_block_is_one_latent_head():
    """MLAAttentionSpec: one head of kv_lora_rank + rope (head_size_v 0): DeepSeek-V3 512 + 64 at 2 B x 61
    layers x 16 tokens."""
    spec = load_spec("deepseek-v3")
    cap = vllm_capacity(spec, RunSettings(), 8 * 80 * GiB, VllmOptions(kv_cache_memory=10 * GiB),
                        parallelism=Parallelism(tensor=8))
    assert [(g.kind, g.layers) for g in cap.groups] == [("full", 61)]
    assert cap.groups[0].page_bytes == 16 * (512 + 64) * 2
    assert cap.workers[0].block_bytes == 61 * 16 * 576 * 2


def test_cli_hybrid_groups_and_the_flag_that_disables_them():
    """calc --runtime vllm --json carries the groups; --disable-hybrid-kv-cache-manager (vLLM's flag) makes one."""
    args = [sys.executable, "main.py", "calc", "--model", "gemma-3-27b", "--context", "32k", "--gpu-memory", "80GiB",
            "--runtime", "vllm", "--kv-cache-memory", "20GiB", "--json"]
    on = json.loads(subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120).stdout)["serving"]
    off = json.loads(subprocess.run(args + ["--disable-hybrid-kv-cache-manager"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=120).stdout)["serving"]
    page = 16 * 16 * 256 * 2
    assert len(on["kv_cache_groups"]) == 7 and on["num_gpu_blocks"] == 20 * GiB // (10 * page)
    assert [(g["kind"], g["layers"]) for g in off["kv_cache_groups"]] == [("full", 62)]
    assert off["num_gpu_blocks"] == 20 * GiB // (62 * page) and off["blocks_per_request"] == 131072 // 16
    assert on["kv_cache_tokens"] > 2 * off["kv_cache_tokens"]


@pytest.mark.parametrize("state_bytes,pattern", [(1 << 20, 4), (3 << 20, 4), (700_000, 3), (40_000, 2)])
def test_linear_attention_states_take_padded_pages(state_bytes, pattern):
    """A hybrid of attention and fixed-state layers (Qwen3-Next-style linear attention, Mamba): vLLM raises the
    attention block size until a page holds a state (vllm/platforms/interface.py _align_hybrid_block_size: a
    multiple of the kernel block 16), pads the state page to it (MambaSpec.page_size_padded), groups both kinds
    (_get_kv_cache_groups_uniform_page_size) and charges a request one block per state group
    (MambaSpec.max_memory_usage_bytes, mamba_cache_mode 'none'). Worked by hand here."""
    from dataclasses import replace

    from kvscope.core.model.spec import NO_KV
    from kvscope.core.model.states import LayerState

    base = load_spec("llama-3-8b")
    types = tuple("full_attention" if il % pattern == pattern - 1 else NO_KV for il in range(32))
    spec = replace(base, layer_types=types,
                   layer_states=tuple(LayerState(fixed_bytes=state_bytes) if t == NO_KV else None for t in types))
    cap = vllm_capacity(spec, RunSettings(), 80 * GiB, VllmOptions(kv_cache_memory=10 * GiB, max_model_len=32768))
    per_token = 8 * 256 * 2  # one attention layer: 8 KV heads x (128 + 128) x 2 B
    block = 16 * -(-state_bytes // (16 * per_token))
    block = max(16, 16 * -(-block // 16))
    page = block * per_token
    n_attn = 32 // pattern
    n_state = 32 - n_attn
    size = min(n_attn, n_state) if max(n_attn, n_state) >= 1.5 * min(n_attn, n_state) else max(n_attn, n_state)
    state_groups = -(-n_state // size)
    assert {g.block_size for g in cap.groups if g.kind == "full"} == {block}
    assert all(g.page_bytes == page for g in cap.groups)
    assert sum(1 for g in cap.groups if g.kind == "state") == state_groups
    assert cap.workers[0].block_bytes == max(g.layers for g in cap.groups) * page
    assert cap.num_gpu_blocks == 10 * GiB // cap.workers[0].block_bytes
    assert cap.blocks_per_request == -(-32768 // block) * -(-n_attn // size) + state_groups

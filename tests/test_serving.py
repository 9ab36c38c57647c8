"""Serving capacity under vLLM 0.33.0's rules (core.serving, calc --runtime vllm), by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from core.attention import SettingsError
from core.parallel import Parallelism
from core.predict import activation_bytes
from core.serving import VllmOptions, default_max_num_batched_tokens, vllm_capacity
from core.settings import RunSettings
from core.spec import load_spec

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
    from core.caches import parse_cache

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
    from core.spec import ModelSpec

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

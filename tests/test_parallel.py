"""Multi-GPU prediction (kvscope.core.prediction.parallel, calc --tensor-parallel/--pipeline-parallel): per-GPU weights and KV
for Llama-3-70B against arithmetic done by hand from its config.json, vLLM's layout rules.

Llama-3-70B: hidden 8192, 80 layers, 64 query heads, 8 KV heads, head_dim 128, MLP 28672, vocab 128256,
untied, bfloat16. Per layer: q and o 8192 x 8192 = 67,108,864 each; k and v 8192 x 1024 = 8,388,608
each; MLP 3 x 8192 x 28672 = 704,643,072; two norms 16,384: 855,654,400. x 80 = 68,452,352,000;
embedding and LM head 128256 x 8192 = 1,050,673,152 each; final norm 8,192: 70,553,706,496 (the
preset's meta-device count, checked below). Buffers: 512 B (rotary inv_freq), on every GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.prediction.calc import calculate
from kvscope.core.prediction.parallel import Parallelism, layout, max_context_per_gpu, pp_partition, predict_parallel
from kvscope.core.prediction.predict import predict

ROOT = Path(__file__).resolve().parent.parent
BF16 = 2
BUFFERS = 512
LAYER = 855_654_400
VOCAB_MATRIX = 128_256 * 8192


@pytest.fixture(scope="module")
def llama70():
    return load_spec("llama-3-70b")


def test_the_decomposition_is_the_meta_count(llama70):
    assert 80 * LAYER + 2 * VOCAB_MATRIX + 8192 == llama70.num_parameters == 70_553_706_496


def test_tp4_per_gpu_by_hand(llama70):
    p = predict_parallel(llama70, RunSettings(), Parallelism(tensor=4), 32 * 1024)
    # per layer on one GPU: q,o /4 = 33,554,432; 2 of 8 KV heads: k,v 2 x 8192 x 256 = 4,194,304;
    # MLP /4 = 176,160,768; norms replicated 16,384 -> 213,925,888 x 80 = 17,114,071,040;
    # embedding and LM head /4 (128256 is a multiple of 64 and of 4): 2 x 32064 x 8192 = 525,336,576; + 8,192.
    params = 213_925_888 * 80 + 525_336_576 + 8192
    assert params == 17_639_415_808
    (stage,) = p.layout.stages
    assert stage.kv_heads_per_gpu == 2 and stage.kv_replicas == 1 and stage.parameters_per_gpu == params
    (gpu,) = p.per_stage
    assert gpu.breakdown.weights == params * BF16 + BUFFERS == 35_278_832_128
    # KV per GPU: 2 (K,V) x 80 layers x 2 heads x 128 x 2 B = 81,920 B per token; 32,768 tokens.
    assert gpu.breakdown.kv_cache == 2 * 80 * 2 * 128 * BF16 * 32768 == 2_684_354_560
    assert len(p.per_gpu()) == 4 and p.total("kv_cache") == predict(llama70, RunSettings(), 32768).breakdown.kv_cache


def test_tp8_one_kv_head_per_gpu(llama70):
    p = predict_parallel(llama70, RunSettings(), Parallelism(tensor=8), 4096)
    # per layer: q,o /8 16,777,216; 1 KV head: k,v 2 x 8192 x 128 = 2,097,152; MLP /8 88,080,384; norms 16,384.
    params = (16_777_216 + 2_097_152 + 88_080_384 + 16_384) * 80 + 2 * 16_032 * 8192 + 8192
    assert p.layout.stages[0].parameters_per_gpu == params == 8_820_367_360
    assert p.per_stage[0].breakdown.kv_cache == 2 * 80 * 1 * 128 * BF16 * 4096
    assert p.layout.stages[0].kv_replicas == 1 and not p.layout.notes


def test_tp16_replicates_kv_heads(llama70):
    """16 GPUs, 8 KV heads: each GPU holds 1 head (as with TP 8), every head on 2 GPUs: the cluster holds
    twice the model's KV."""
    p = predict_parallel(llama70, RunSettings(), Parallelism(tensor=16), 4096)
    stage = p.layout.stages[0]
    assert stage.kv_heads_per_gpu == 1 and stage.kv_replicas == 2
    assert p.per_stage[0].breakdown.kv_cache == 2 * 80 * 1 * 128 * BF16 * 4096
    assert p.total("kv_cache") == 2 * predict(llama70, RunSettings(), 4096).breakdown.kv_cache
    # the k/v projections are replicated too: 1 head's worth per GPU, not 8/16
    params = (67_108_864 * 2 // 16 + 2 * 8192 * 128 + 704_643_072 // 16 + 16_384) * 80 + 2 * 8016 * 8192 + 8192
    assert stage.parameters_per_gpu == params
    assert any("replicated on 2 GPUs" in n for n in p.layout.notes)


def test_pp4_splits_layers_embedding_first_head_last(llama70):
    p = predict_parallel(llama70, RunSettings(), Parallelism(pipeline=4), 8192)
    assert [(s.first_layer, s.end_layer) for s in p.layout.stages] == [(0, 20), (20, 40), (40, 60), (60, 80)]
    params = [s.parameters_per_gpu for s in p.layout.stages]
    assert params == [20 * LAYER + VOCAB_MATRIX, 20 * LAYER, 20 * LAYER, 20 * LAYER + VOCAB_MATRIX + 8192]
    assert sum(params) == llama70.num_parameters
    for pred in p.per_stage:  # 20 layers x 8 heads: a quarter of the model's KV on each stage
        assert pred.breakdown.kv_cache == 2 * 20 * 8 * 128 * BF16 * 8192
    # only the last stage computes logits (128256 per sequence, bf16 as the replay follows transformers 5); they are
    # not the peak: a layer's MLP is, the same on every stage (the activations are the replayed peaks,
    # kvscope.core.prediction.predict.predict)
    from kvscope.core.prediction.predict import prefill_peak
    logits = [prefill_peak(st.spec, RunSettings(), 8192, device="cuda").logits for st in p.layout.stages]
    assert logits == [0, 0, 0, 128_256 * 2]
    assert p.per_stage[3].breakdown.activations == p.per_stage[0].breakdown.activations > 128_256 * 4


def test_uneven_pp_as_vllm_partitions():
    # vllm/distributed/utils.py get_pp_indices: the remainder goes one each from the second-to-last stage back.
    assert pp_partition(80, 3) == [27, 27, 26]
    assert pp_partition(22, 4) == [5, 6, 6, 5]
    assert pp_partition(32, 4) == [8] * 4
    with pytest.raises(SettingsError):
        pp_partition(4, 5)


def test_tp_and_pp_together(llama70):
    p = predict_parallel(llama70, RunSettings(), Parallelism(tensor=2, pipeline=2), 1024)
    assert len(p.per_gpu()) == 4
    assert p.total("kv_cache") == predict(llama70, RunSettings(), 1024).breakdown.kv_cache
    # parameters: every GPU's share sums to the model (no replication at TP 2 with 8 KV heads; norms x 2)
    total = sum(s.parameters_per_gpu * 2 for s in p.layout.stages)
    assert total == llama70.num_parameters + (2 * 80 + 1) * 8192  # norms replicated on the 2 TP ranks


def test_refuses_what_vllm_refuses(llama70):
    with pytest.raises(SettingsError, match="query heads"):
        layout(llama70, RunSettings(), Parallelism(tensor=3))
    with pytest.raises(SettingsError):
        Parallelism(tensor=0)


def test_largest_context_per_gpu(llama70):
    s, par, gpu = RunSettings(), Parallelism(tensor=4), 80 * 1024**3
    n = max_context_per_gpu(llama70, s, par, gpu, limit=1 << 24)
    assert predict_parallel(llama70, s, par, n).largest_gpu_total <= gpu < predict_parallel(llama70, s, par, n + 1).largest_gpu_total
    assert max_context_per_gpu(llama70, s, par, 30 * 1024**3, limit=1 << 24) is None  # 32.9 GiB of weights per GPU


def test_single_gpu_unchanged(llama70):
    r = calculate(llama70, RunSettings(), [4096], 80 * 1024**3)
    assert not r.parallel and set(r.to_json()) == {"model", "rows", "max_context"}
    p = predict_parallel(llama70, RunSettings(), Parallelism(), 4096)
    assert p.per_stage[0] == predict(llama70, RunSettings(), 4096)


def test_calc_cli_json_per_gpu():
    out = subprocess.run([sys.executable, "main.py", "calc", "--model", "llama-3-70b", "--tensor-parallel", "4",
                          "--context", "32k", "--json", "--gpu-memory", "80GiB"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["tensor_parallel"] == 4 and data["gpus"] == 4
    (row,) = data["rows"]
    assert [g["gpu"] for g in row["per_gpu"]] == [0, 1, 2, 3]
    assert {g["kv_cache_bytes"] for g in row["per_gpu"]} == {2_684_354_560}
    assert {g["weights_bytes"] for g in row["per_gpu"]} == {35_278_832_128}
    assert row["kv_cache_bytes"] == 4 * 2_684_354_560
    assert data["max_context"] > 32768
    table = subprocess.run([sys.executable, "main.py", "calc", "--model", "llama-3-70b", "--tensor-parallel", "16",
                            "--context", "4k"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "replicated on 2 GPUs" in table.stdout and "per GPU" in table.stdout

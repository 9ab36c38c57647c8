"""The predictor's headline numbers, derived by hand, and the calc command that prints them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.core.model.attention import SettingsError, parse_attention
from kvscope.core.model.caches import Quantized, Static, parse_cache
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import SpecError, parse_size, parse_tokens
from kvscope.core.prediction.predict import (activation_bytes, kv_bytes, kv_overtakes_weights_at, max_context_that_fits,
                                             predict)

ROOT = Path(__file__).resolve().parent.parent
FP16 = RunSettings(weight_dtype="fp16")


@pytest.fixture(scope="module")
def llama8b():
    return load_spec("llama-3-8b")


def test_worked_example_kv_bytes(llama8b):
    # 2 x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 131,072 B (128 KiB) per token.
    assert kv_bytes(llama8b, FP16, 1) == 131_072
    assert kv_bytes(llama8b, FP16, 4096) == 536_870_912
    assert kv_bytes(llama8b, FP16, 32768) == 4_294_967_296
    assert kv_bytes(llama8b, FP16, 131072) == 17_179_869_184


def test_worked_example_weights_and_crossover(llama8b):
    # 8,030,261,248 parameters (meta-device count) x 2 bytes, plus the rotary tables: inv_freq and
    # original_inv_freq, 64 float32 each (the buffers stay float32 when the weights load in fp16).
    p = predict(llama8b, FP16, 4096)
    assert llama8b.num_parameters == 8_030_261_248
    assert llama8b.buffer_bytes == 2 * 64 * 4
    assert p.breakdown.weights == 16_060_522_496 + 512 == 16_060_523_008
    assert p.total == p.breakdown.weights + p.breakdown.kv_cache + p.breakdown.activations
    # The cache passes the weights where tokens x 131072 > 16,060,523,008: at 122,533 tokens.
    assert kv_overtakes_weights_at(llama8b, FP16) == 16_060_523_008 // 131_072 + 1 == 122_533


def test_mha_gqa_mqa_ratios(llama8b):
    mha = kv_bytes(llama8b, FP16.with_(attention=parse_attention("mha")), 4096)
    gqa = kv_bytes(llama8b, FP16.with_(attention=parse_attention("gqa:8")), 4096)
    mqa = kv_bytes(llama8b, FP16.with_(attention=parse_attention("mqa")), 4096)
    assert mha == 4 * gqa == 32 * mqa
    assert gqa == kv_bytes(llama8b, FP16, 4096)  # Llama-3-8B is gqa:8 as built


def test_gqa_must_divide_query_heads(llama8b):
    with pytest.raises(SettingsError, match="does not divide 32 query heads"):
        kv_bytes(llama8b, FP16.with_(attention=parse_attention("gqa:3")), 10)


def test_mha_conversion_changes_weight_count(llama8b):
    # k_proj and v_proj grow from 8 to 32 heads: 2 x 32 layers x 24 heads x 128 x 4096 more parameters.
    mha = predict(llama8b, FP16.with_(attention=parse_attention("mha")), 1)
    assert mha.breakdown.weights == (8_030_261_248 + 2 * 32 * 24 * 128 * 4096) * 2 + 512


def test_window_caps_and_static_preallocates(llama8b):
    window = FP16.with_(attention=parse_attention("window:4096"))
    # DynamicSlidingWindowLayer keeps W - 1 tokens.
    assert kv_bytes(llama8b, window, 100_000) == 4095 * 131_072
    static = FP16.with_(cache=Static(), max_context=8192)
    assert kv_bytes(llama8b, static, 1) == kv_bytes(llama8b, static, 8000) == 8192 * 131_072
    assert kv_bytes(llama8b, static, 0) == 0  # StaticLayer allocates lazily, on the first update


def test_eager_materialises_scores_sdpa_does_not(llama8b):
    eager = activation_bytes(llama8b, FP16.with_(attn_impl="eager"), 4096, 4096)
    sdpa = activation_bytes(llama8b, FP16.with_(attn_impl="sdpa"), 4096, 4096)
    scores = 1 * 32 * 4096 * 4096 * (2 + 4)  # fp16 scores + fp32 softmax of one layer
    assert eager - sdpa >= scores - 32 * 4096 * 129 * 4 - 2 * 4096 * 14336 * 2
    assert eager > 6 * sdpa


def test_max_context_that_fits(llama8b):
    budget = 24 * 2**30
    n = max_context_that_fits(llama8b, FP16, budget, limit=1 << 24)
    assert predict(llama8b, FP16, n).total <= budget < predict(llama8b, FP16, n + 1).total
    assert max_context_that_fits(llama8b, FP16, 10 * 2**30) is None  # 16 GB of weights do not fit


def test_quantized_keeps_residual_unquantized(llama8b):
    q = RunSettings(weight_dtype="fp16", cache=parse_cache("quantized:4"))
    assert isinstance(q.cache, Quantized)
    # All prompt tokens are quantized by the prefill; 10 decoded tokens wait in the fp16 residual.
    assert q.cache.split(110, 100) == (100, 10)
    assert q.cache.split(100 + 128, 100) == (228, 0)
    assert kv_bytes(llama8b, q, 4096) < kv_bytes(llama8b, FP16, 4096) / 3


@pytest.mark.parametrize("text,value", [("24GiB", 24 * 2**30), ("1.5GB", 1_500_000_000), ("64MiB", 64 * 2**20),
                                        ("4096", 4096), ("80g", 80 * 2**30)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text,value", [("4096", 4096), ("4k", 4096), ("32K", 32768), ("128k", 131072)])
def test_parse_tokens(text, value):
    assert parse_tokens(text) == value


@pytest.mark.parametrize("bad", ["", "-3", "4q", "1.5", "nan"])
def test_parse_tokens_rejects(bad):
    with pytest.raises(SpecError):
        parse_tokens(bad)


def _calc(*args: str) -> subprocess.CompletedProcess:
    """The real command line, in a child process (one test: entry point, exit code, streams)."""
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "calc", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def _calc_inproc(capsys, *args: str) -> tuple[int, str, str]:
    """main.main in this process: the same code path, without paying torch's import per test."""
    from kvscope import main

    code = main.main(["calc", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_calc_prints_worked_example():
    out = _calc("--model", "llama-3-8b", "--context", "4k,32k,128k", "--dtype", "fp16")
    assert out.returncode == 0, out.stderr
    for figure in ("536,870,912 B", "4,294,967,296 B", "17,179,869,184 B", "16,060,523,008 B (15.0 GiB)", "4,294,967,296 B (4.0 GiB)",
                   "overtakes the weights at 122,533 tokens"):
        assert figure in out.stdout


def test_calc_json_shape(capsys):
    code, stdout, stderr = _calc_inproc(capsys, "--model", "LLAMA-3-8B", "--context", "4096,32768",
                                        "--gpu-memory", "24GiB", "--json")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["model"] == "llama-3-8b"
    assert [r["context"] for r in data["rows"]] == [4096, 32768]
    assert data["rows"][0]["kv_cache_bytes"] == 536_870_912
    assert set(data["rows"][0]) == {"context", "kv_cache_bytes", "weights_bytes", "activation_bytes", "total_bytes",
                                    "activations_source", "prefill_peak_bytes", "decode_peak_bytes"}
    # the prefill holds the KV it writes and more (its transients): the peak is above the KV, and grows with the prompt
    first, second = data["rows"]
    assert first["kv_cache_bytes"] < first["prefill_peak_bytes"] < second["prefill_peak_bytes"]
    # a decode step holds one layer's grown keys (then values) beside the old for a moment: above half a layer's
    # K/V at that context, far below the prefill's peak, and growing with the cache
    half_layer_kv = first["kv_cache_bytes"] // 32 // 2
    assert half_layer_kv < first["decode_peak_bytes"] < first["prefill_peak_bytes"]
    assert first["decode_peak_bytes"] < second["decode_peak_bytes"]
    assert isinstance(data["max_context"], int) and data["max_context"] > 32768


@pytest.mark.parametrize("args,message", [
    (("--attention", "gqa:3"), "does not divide 32 query heads"),
    (("--context", "lots"), "cannot read token count"),
    (("--gpu-memory", "24 parsecs"), "cannot read size"),
    (("--cache", "quantized:3"), "quanto stores 2, 4 bits"),
    (("--model", "no-such-preset"), "unknown model"),
])
def test_calc_bad_input_is_one_line(capsys, args, message):
    code, _, stderr = _calc_inproc(capsys, *(args if "--model" in args else ("--model", "llama-3-8b", *args)))
    assert code == 2
    assert message in stderr and stderr.count("\n") == 1 and "Traceback" not in stderr


def test_calc_every_preset(capsys):
    from kvscope.core.model.spec import preset_names

    for name in preset_names():
        code, stdout, stderr = _calc_inproc(capsys, "--model", name, "--context", "1k")
        assert code == 0 and "KV per token" in stdout, (name, stderr)


def test_prefill_peak_leaves_the_kv_and_the_last_logits():
    """Generated over the presets with full attention only: what the replayed pass leaves allocated is exactly the
    KV it wrote (kvscope.core.prediction.predict.kv_bytes) plus one row of logits per sequence; eager's scores make its peak larger
    than sdpa's from a few hundred tokens; and the peak never falls as the prompt grows."""
    import random

    from kvscope.core.model.spec import dtype_bytes, preset_names
    from kvscope.core.prediction.predict import prefill_peak

    rng = random.Random(24)
    checked = 0
    for name in preset_names():
        spec = load_spec(name)
        if spec.num_sliding_layers or spec.layer_states or spec.is_mla or spec.layer_kv or spec.indexer_head_dim:
            continue
        batch, n = rng.randint(1, 3), rng.randint(300, 4000)
        settings = RunSettings(batch=batch)
        peak = prefill_peak(spec, settings, n)
        logits = batch * spec.vocab_size * int(dtype_bytes(spec.dtype))
        assert peak.end == kv_bytes(spec, settings, n) + logits, name
        assert prefill_peak(spec, settings.with_(attn_impl="eager"), n).peak > peak.peak, name
        assert prefill_peak(spec, settings, n + 64).peak >= peak.peak, name
        checked += 1
    assert checked >= 5

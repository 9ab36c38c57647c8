"""The measuring engine on the real embedded model: observed KV == predicted KV at every token,
live switches, the run command, recordings, memory budget and out-of-memory recovery."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvscope.core.live.run import BudgetExceeded, RunHooks, run_generation
from kvscope.core.model.attention import parse_attention
from kvscope.core.model.caches import parse_cache
from kvscope.core.model.request import RunRequest
from kvscope.core.model.settings import RunSettings
from kvscope.core.records.recording import RecordingReader
from kvscope.core.runtimes import parse_switch
from kvscope.core.runtimes.transformers.engine import Engine, GenerationError
from kvscope.core.runtimes.transformers.loading import load_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 12


def _engine(attention: str | None = None, cache: str = "dynamic", attn_impl: str = "sdpa",
            max_context: int | None = 256) -> Engine:
    loaded = load_model("embedded", device="cpu")
    settings = RunSettings(attention=parse_attention(attention) if attention else None, cache=parse_cache(cache),
                           attn_impl=attn_impl, max_context=max_context)
    return Engine(loaded, settings, seed=0)


def _prompt(engine: Engine, n: int = PROMPT_TOKENS) -> torch.Tensor:
    return torch.randint(3, engine.spec.vocab_size, (engine.settings.batch, n), generator=torch.Generator().manual_seed(1))


ATTENTION = ["mha", "gqa:4", "gqa:2", "mqa", "mla", "window:16"]
CACHES = ["dynamic", "static", "quantized:4", "quantized:2", "quantized:hqq:4", "quantized:hqq:2", "quantized:fp8"]


def _refused(attention: str, cache: str) -> bool:
    # transformers' QuantizedCache refuses sliding layers; MLA's latent is a dynamic cache of its own.
    return cache.startswith("quantized") and attention.startswith("window") or attention == "mla" and cache != "dynamic"


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("cache", CACHES)
def test_observed_equals_predicted_every_token(attention, cache):
    if _refused(attention, cache):
        with pytest.raises(Exception, match="dynamic cache of its own" if attention == "mla" else "quantized cache"):
            _engine(attention, cache)
        return
    engine = _engine(attention, cache)
    samples = [engine.prefill(_prompt(engine), "prompt")]
    samples += [engine.step() for _ in range(24)]
    for s in samples:
        assert s.kv_bytes_reserved == s.kv_bytes_predicted, (s.token, s.attention, s.cache)
    assert samples[-1].context_tokens == PROMPT_TOKENS + 24
    assert samples[-1].attention == attention and samples[-1].cache == cache


def test_quantized_residual_flush_is_predicted():
    # residual_length 128: the 128th decoded token requantizes everything; bytes drop then.
    engine = _engine(None, "quantized:4")
    samples = [engine.prefill(_prompt(engine), "p")] + [engine.step() for _ in range(140)]
    assert all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in samples)
    drops = [b.token for a, b in zip(samples, samples[1:]) if b.kv_bytes_reserved < a.kv_bytes_reserved]
    assert drops == [128]


def test_batch_two_doubles_the_cache():
    one = _engine()
    two = Engine(load_model("embedded", device="cpu"), RunSettings(batch=2), seed=0)
    a = one.prefill(_prompt(one), "p")
    b = two.prefill(_prompt(two), "p")
    assert b.kv_bytes_reserved == 2 * a.kv_bytes_reserved == b.kv_bytes_predicted


def test_gqa_to_mha_switch_gives_back_the_model_as_loaded():
    """Back to the model's own heads after a pooled gqa:2: the loaded K/V projections themselves, and the tokens
    so far re-run through them (repeating pooled heads would not give their K/V back), so that the next tokens
    are bit for bit those of the unswitched model on the same ids and schedule."""
    engine = _engine("gqa:2", attn_impl="eager")
    engine.prefill(_prompt(engine), "p")
    for _ in range(10):
        engine.step()
    event = engine.apply("attention", "mha")
    assert event.event == "switch" and "re-ran" in event.text and "as loaded" in event.text, event.text
    assert event.tokens_rerun == engine.seq_len
    assert engine._kv_origin.is_loaded(engine.base_model)
    rerun_at = engine.seq_len
    token = engine.step()  # first token generated on the restored model and the re-run cache

    reference = load_model("embedded", device="cpu").model
    reference.set_attn_implementation("eager")
    # Same schedule as the engine (one pass over the tokens at the switch, then one token per forward).
    from transformers import DynamicCache

    cache = DynamicCache(config=reference.config)
    with torch.inference_mode():
        logits = reference(input_ids=engine.ids[:, :rerun_at], cache=cache).logits[:, -1, :].float()
        for i in range(rerun_at, engine.seq_len):
            logits = reference(input_ids=engine.ids[:, i:i + 1], cache=cache).logits[:, -1, :].float()
    assert torch.equal(logits, engine._next_logits)
    assert token.kv_bytes_reserved == token.kv_bytes_predicted


def test_mha_to_mqa_changes_bytes_per_token_by_the_head_ratio():
    engine = _engine("mha")
    engine.prefill(_prompt(engine), "p")
    a, b = engine.step(), engine.step()
    engine.apply("attention", "mqa")
    c, d = engine.step(), engine.step()
    per_token_mha = b.kv_bytes_reserved - a.kv_bytes_reserved
    per_token_mqa = d.kv_bytes_reserved - c.kv_bytes_reserved
    assert per_token_mha == 8 * per_token_mqa == 8 * (2 * 4 * 32 * 4)  # 2 x 4 layers x 1 head x 32 dims x fp32


def test_every_switch_is_an_event_and_keeps_prediction_exact():
    engine = _engine()
    engine.prefill(_prompt(engine), "p")
    script = [("attention", "gqa:2"), ("attn-impl", "eager"), ("cache", "static"), ("attention", "window:16"),
              ("attention", "mqa"), ("cache", "quantized:fp8"), ("cache", "dynamic"), ("attention", "mla"),
              ("attention", "mha"), ("attn-impl", "flash")]
    for key, value in script:
        event = engine.apply(key, value)
        assert event.phase == "event" and event.event == "switch" and value in event.text
        assert event.kv_bytes_reserved == event.kv_bytes_predicted, event.text
        for _ in range(3):
            s = engine.step()
            assert s.kv_bytes_reserved == s.kv_bytes_predicted, (key, value, s.token)
    assert s.attention == "mha" and s.attn_impl == "flash" and s.cache == "dynamic"


def test_refused_switch_leaves_settings_alone():
    engine = _engine("window:16")
    engine.prefill(_prompt(engine), "p")
    with pytest.raises(Exception, match="quantized cache needs full-attention"):
        engine.apply("cache", "quantized:4")
    assert engine.settings.cache.key == "dynamic"
    with pytest.raises(Exception, match="needs CUDA"):
        engine.apply("cache", "offloaded")
    assert engine.step().kv_bytes_reserved == engine.predicted_kv()


def test_parse_switch():
    assert parse_switch("32:attention=mqa") == (32, "attention", "mqa")
    assert parse_switch("64:attn_impl=EAGER") == (64, "attn-impl", "eager")
    for bad in ("attention=mqa", "x:attention=mqa", "5:attention", "5:colour=red", "5:attention=gqa:0"):
        with pytest.raises(Exception):
            parse_switch(bad)


def test_run_generation_records_scripted_switches(tmp_path):
    record = tmp_path / "r.jsonl"
    seen = []
    request = RunRequest(max_new_tokens=24, device="cpu", record_path=str(record),
                         switches=(parse_switch("8:attention=gqa:2"), parse_switch("16:attention=mqa")))
    run_generation(request, RunHooks(emit=seen.append))
    with RecordingReader(record) as reader:
        recorded = list(reader)
        assert reader.header["model"]["num_kv_heads"] == 8 and not reader.truncated
    assert [s.to_dict() for s in recorded] == [s.to_dict() for s in seen]
    switches = [s for s in recorded if s.event == "switch"]
    assert [s.token for s in switches] == [8, 16]
    decode = [s for s in recorded if s.phase == "decode"]
    assert len(decode) == 24 and all(s.kv_bytes_reserved == s.kv_bytes_predicted for s in decode)
    per_token = {s.attention: b.kv_bytes_reserved - s.kv_bytes_reserved for s, b in zip(decode, decode[1:])
                 if s.attention == b.attention}
    assert per_token["mha"] == 4 * per_token["gqa:2"] == 8 * per_token["mqa"]


def test_memory_budget_stops_where_forecast(tmp_path):
    record = tmp_path / "b.jsonl"
    loaded = load_model("embedded", device="cpu")
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    budget = weights + 2_000_000  # room for the activations and some ~1 KiB tokens of KV
    seen = []
    with pytest.raises(BudgetExceeded, match="memory budget .* reached at token"):
        run_generation(RunRequest(max_new_tokens=2000, device="cpu", record_path=str(record), memory_budget=budget),
                       RunHooks(emit=seen.append))
    forecast = next(s for s in seen if s.event == "forecast")
    stop = next(s for s in seen if s.event == "budget")
    forecast_token = int(forecast.text.rsplit("token", 1)[1])
    assert abs(stop.token + 1 - forecast_token) <= 3
    with RecordingReader(record) as reader:
        assert [s.event for s in reader][-1] == "budget" and not reader.truncated


def test_out_of_memory_in_decode_is_recovered(tmp_path, monkeypatch):
    engine = _engine()
    seen = []
    calls = {"n": 0}
    forward = engine.model.forward

    def failing(*args, **kwargs):
        calls["n"] += 1
        # The prefill, its profiled trial pass (kvscope.core.runtimes.transformers.kernels) and 4 tokens succeed; the 5th token runs out of memory.
        if calls["n"] == 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", failing)
    from kvscope.core.live import run
    from kvscope.core.runtimes.transformers.runtime import TransformersRuntime

    request = RunRequest(max_new_tokens=20)
    with pytest.raises(GenerationError, match="out of memory in decode at token 5"):
        run._loop(request, TransformersRuntime.around(engine, request), RunHooks(), seen.append)
    assert seen[-1].event == "oom" and "predictor had said" in seen[-1].text
    assert engine.cache is None  # freed


def test_cli_run_prints_table_and_records(tmp_path):
    record = tmp_path / "r.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "run", "--tokens", "64", "--device", "cpu",
         "--switch", "16:attention=gqa:2", "--switch", "32:attention=mqa", "--record", str(record)],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "KV observed" in out.stdout and "observed == predicted at 65 of 65 samples" in out.stdout
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines[0]["format"] == "kvscope-recording"
    attention = [r["attention"] for r in lines[1:] if r["phase"] == "decode"]
    assert attention[0] == "mha" and attention[20] == "gqa:2" and attention[-1] == "mqa"
    for r in lines[1:]:
        assert {"token", "phase", "attention", "attn_impl", "cache", "kv_bytes_held", "kv_bytes_reserved", "kv_bytes_predicted"} <= set(r)


@pytest.mark.parametrize("args,message", [
    (("--attention", "gqa:3"), "does not divide 8 query heads"),
    (("--cache", "offloaded"), "needs CUDA"),
    (("--switch", "5:colour=red"), "unknown setting"),
    (("--model", "./no/such/folder"), "no such"),
])
def test_cli_run_bad_input_one_line(args, message):
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "run", "--tokens", "4", "--device", "cpu", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr

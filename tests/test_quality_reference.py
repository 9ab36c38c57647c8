"""The quality probe against the model as loaded (issue 34, item 1), on the real embedded model and on SmolLM2-135M.

Teacher-forced: one fixed text goes through the engine token by token (its sampler forced to the text's next token).
Every quality figure of a Sample (``quality_top1``, ``quality_kl``, ``quality_token``) must be the comparison of the
run's next-token distribution with the *unswitched loaded model*'s on the same tokens: checked here against logits
computed independently, on a fresh load of the model, over the whole text at once (no cache, before any switch).
The probe's reference must not follow the run: a window, MLA's twin and mean-pooled MQA make the figure fall, a
switch back to the model's own attention brings it back to top-1 100%; kernels and caches are judged too. It costs
one decode step of the loaded model per token, never a rebuild after a switch, and its cache is never counted in
the run's KV bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvscope.core.base.sample import sample_from_json
from kvscope.core.model.settings import RunSettings
from kvscope.core.runtimes.transformers import convert
from kvscope.core.runtimes.transformers.engine import Engine
from kvscope.core.runtimes.transformers.loading import load_model
from tests import helpers, real_models

_one_thread = pytest.fixture(autouse=True, scope="module")(helpers.one_torch_thread)
pytestmark = pytest.mark.usefixtures("hub_offline")
hub_offline = helpers.hub_offline

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The key-value cache is the memory a transformer keeps while it writes. For every token it has read, each "
        "layer stores a key and a value for every key-value head, so that the next token can attend to all of "
        "them without computing them again. Grouped-query attention shares one key-value head among several "
        "query heads, and multi-query attention shares a single one among all of them: the cache shrinks by the "
        "same factor, and a model trained that way loses little. A model trained with its own heads is another "
        "matter, and pooling them after training changes what it computes. ") * 2
PREFIX, BLOCK = 24, 24
#: The window switch comes at ~100 tokens of context, where a 16-token window has dropped most of the text.
WINDOW_AT = 96
TOKENS = WINDOW_AT + 8 * BLOCK  # the most a test runs
#: Same model, same tokens, a different order of the sums (a re-run's batched pass, another kernel): KL per token.
EXACT_KL = 1e-5

#: Measured (one CPU thread, sdpa, the blocks below), top-1 agreement with the loaded model and mean KL in nats per
#: token over a block of 24 tokens, the switch made at its start (window:16 at 96 tokens of context):
#:   embedded:  window:16 42%, KL 1.14; MLA twin 12%, KL 2.8; mean-pooled MQA 71%, KL 0.37; gqa:4 (pooled) 83%, KL 0.13;
#:              quantized:fp8 100%, KL 0.011; eager 100%, KL < 1e-6; back to mha after each 100%, KL < 1e-6.
#:   SmolLM2:   window:16 21%, KL 2.8; MLA twin 0%, KL 7.6; mean-pooled MQA 4%, KL 7.0; back to gqa:3 100%, KL < 1e-6;
#:              in the 16-token blocks of its test: window:16 31%, KL 2.1; MQA 0%, KL 7.3.
#: MLA is a latent of the model's own K/V (issue 34, item 3): at its default rank, half the K/V width, and 96-120
#: tokens of context it is exact (100%, KL 5e-8: the context has not passed the rank yet); mla:64 88%, KL 0.023;
#: mla:16 62%, KL 0.43 (the random-weight twin it replaced: 12%, KL 2.8).
#: The probe before issue 34 (the run against a full cache of the running model) on the same blocks: embedded
#: window:16 92%, KL 0.099; MLA 100%, KL 0; MQA 96%, KL 0.022 (SmolLM2's window:16 33%, KL 1.46: the cache converted
#: mid-run against one windowed from the start; there the per-token check against the loaded model's own logits is
#: what the old probe fails). The bounds leave room for another machine's rounding, not for a probe that follows the run.
FALLS = {  # (top-1 below, KL above)
    ("embedded", "window:16"): (0.8, 0.5), ("embedded", "mla:16"): (0.8, 0.2), ("embedded", "mqa"): (0.9, 0.1),
    ("smollm2", "window:16"): (0.6, 1.0), ("smollm2", "mqa"): (0.5, 1.0),
}
#: MQA is the aligned merge since issue 34, item 4 (kvscope.core.runtimes.transformers.merge): SmolLM2 in its 16-token
#: block 19%, KL 2.3 (the mean it replaced as the default: 0%, KL 7.3); still far from the model, as the probe says.


def _load(name: str):
    if name == "smollm2":
        return load_model(str(real_models.smollm2_folder()), device="cpu")
    return load_model("embedded", device="cpu")


_REFERENCES: dict[str, tuple[torch.Tensor, torch.Tensor, torch.nn.Module]] = {}


def _text_and_reference(name: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The text's first ``tokens`` ids [1, tokens] and the loaded model's logits at every position [tokens, vocab],
    from a fresh load, the whole text in one pass without a cache (nothing switched, nothing cached)."""
    if name not in _REFERENCES:
        loaded = _load(name)
        ids = loaded.tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :TOKENS]
        with torch.inference_mode():
            logits = loaded.model(input_ids=ids, use_cache=False).logits[0].float()
        _REFERENCES[name] = (ids, logits, loaded.model)  # that load is never switched: the loaded model to compare
    ids, logits, _ = _REFERENCES[name]
    assert ids.shape[1] >= tokens, (name, ids.shape)
    return ids[:, :tokens], logits[:tokens]


def _engine(name: str, ids: torch.Tensor, prefix: int = PREFIX, **settings) -> Engine:
    """An engine with the probe on, on a fresh load of ``name``, whose sampler takes the text's next token."""
    engine = Engine(_load(name), RunSettings(**settings), seed=0, quality_probe=True)
    engine._sample_next = lambda: ids[:, engine.seq_len:engine.seq_len + 1]
    engine.prefill(ids[:, :prefix], "p")
    return engine


def _block(engine: Engine, n: int, logits: torch.Tensor) -> tuple[float, float, list]:
    """``n`` teacher-forced steps: (top-1 agreement, mean KL) as the Samples say, each Sample checked against the
    independent loaded-model logits at its position (the figure is versus the loaded model, nothing else)."""
    samples = []
    for _ in range(n):
        s = engine.step()
        ref = logits[s.context_tokens - 1]
        ours = engine._next_logits[0]
        log_ref, log_ours = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
        kl = float((log_ref.exp() * (log_ref - log_ours)).sum())
        assert s.quality_kl == pytest.approx(max(kl, 0.0), abs=2e-4, rel=1e-3), (s.context_tokens, s.quality_kl, kl)
        assert ref[s.quality_token] >= ref.max() - 1e-4, (s.context_tokens, s.quality_token)  # the loaded model's pick
        assert s.quality_top1 == int(int(ours.argmax()) == s.quality_token)
        samples.append(s)
    return sum(s.quality_top1 for s in samples) / n, sum(s.quality_kl for s in samples) / n, samples


def _falls(name: str, switch: str, top1: float, kl: float) -> None:
    top_below, kl_above = FALLS[(name, switch)]
    assert top1 < top_below and kl > kl_above, (name, switch, top1, kl)


def _exact(top1: float, kl: float, samples: list) -> None:
    assert top1 == 1.0 and max(s.quality_kl for s in samples) < EXACT_KL, (top1, max(s.quality_kl for s in samples))


def _still_loaded(engine: Engine, name: str) -> None:
    """The reference is the model as loaded: every tensor equal to a fresh, never switched load's, the K/V projections the loaded
    tensors themselves, its own attention (heads, no window unless the model has one) and its own kernel."""
    ref = engine._reference.model
    assert engine._reference.is_loaded(engine._kv_origin)
    fresh = _REFERENCES[name][2]
    mine = dict(ref.named_parameters()) | dict(ref.named_buffers())
    for key, tensor in list(fresh.named_parameters()) + list(fresh.named_buffers()):
        assert torch.equal(mine[key], tensor), key
    assert type(ref) is type(fresh)
    for field in ("num_key_value_heads", "sliding_window", "layer_types", "_attn_implementation"):
        assert getattr(ref.config, field, None) == getattr(fresh.config, field, None), field
    assert [a.num_key_value_groups for a in convert._attention_modules(ref)] == \
        [a.num_key_value_groups for a in convert._attention_modules(fresh)]


# ------------------------------------------------------------------------------------------------ embedded


def test_unswitched_run_is_the_loaded_model():
    """Probe on, nothing switched: top-1 100% and KL ~0 at every token; the figures are those of the independent
    loaded-model logits; the prompt's pass once, then one decode step of the reference per token."""
    ids, logits = _text_and_reference("embedded", PREFIX + 2 * BLOCK)
    engine = _engine("embedded", ids)
    calls = []
    engine._reference.model.register_forward_hook(lambda m, a, kw, out: calls.append(kw["input_ids"].shape[1]),
                                                  with_kwargs=True)
    top1, kl, samples = _block(engine, 2 * BLOCK, logits)
    _exact(top1, kl, samples)
    assert calls == [1] * (2 * BLOCK) and engine._reference.rebuilds == 1
    assert all(s.quality_token_text == engine.loaded.tokenizer.decode([s.quality_token]) for s in samples)


def test_window_mla_and_mqa_fall_and_the_model_comes_back():
    """window:16 at ~100 tokens, a low-rank MLA latent (rank 16) and mean-pooled MQA each make the figure fall against
    the loaded model, MLA at its default rank keeps it; the switch back to mha after each is the loaded model again:
    top-1 100%, KL ~0. The reference is never rebuilt (one pass: the prefill's) and stays the loaded model through
    every conversion."""
    total = WINDOW_AT + 8 * BLOCK
    ids, logits = _text_and_reference("embedded", total)
    engine = _engine("embedded", ids, prefix=WINDOW_AT)
    engine.apply("attention", "mla")  # the default rank: half the K/V bytes per token
    top1, kl, _ = _block(engine, BLOCK, logits)
    assert top1 >= 0.95 and kl < 0.01, (top1, kl)
    _still_loaded(engine, "embedded")
    engine.apply("attention", "mha")
    _exact(*_block(engine, BLOCK, logits))
    figures = {}
    for switch in ("window:16", "mla:16", "mqa"):
        engine.apply("attention", switch)
        top1, kl, samples = _block(engine, BLOCK, logits)
        figures[switch] = (top1, kl)
        _falls("embedded", switch, top1, kl)
        _still_loaded(engine, "embedded")
        engine.apply("attention", "mha")
        _exact(*_block(engine, BLOCK, logits))
    assert engine._reference.rebuilds == 1, engine._reference.rebuilds
    assert engine.seq_len == total


def test_kernel_and_cache_switches_are_judged_against_the_loaded_model():
    """eager against the loaded model's sdpa: the same numbers to rounding; a quantized (fp8) cache: measured, small
    and not zero; gqa:4 (the 8 heads pooled in pairs): the figure falls, and mha after it is exact again."""
    ids, logits = _text_and_reference("embedded", PREFIX + 4 * BLOCK)
    engine = _engine("embedded", ids)
    engine.apply("attn_impl", "eager")
    _exact(*_block(engine, BLOCK, logits))
    assert engine._reference.model.config._attn_implementation == "sdpa"  # its own kernel, not the run's
    engine.apply("attention", "gqa:4")  # the embedded model's 8 K/V heads mean-pooled in pairs
    top1, kl, _ = _block(engine, BLOCK, logits)
    assert kl > 0.02, kl
    engine.apply("attention", "mha")
    _exact(*_block(engine, BLOCK, logits))
    engine.apply("cache", "quantized:fp8")
    top1, kl, samples = _block(engine, BLOCK, logits)
    assert 0 < kl < 0.1 and top1 >= 0.8, (top1, kl)
    _still_loaded(engine, "embedded")


def test_starting_settings_are_judged_too():
    """A run that starts under MQA (the conversion before the prefill): the reference was taken before it, so even
    the prefill's figure is against the loaded model."""
    ids, logits = _text_and_reference("embedded", PREFIX + BLOCK)
    engine = Engine(_load("embedded"), RunSettings(attention=_mode("mqa")), seed=0, quality_probe=True)
    engine._sample_next = lambda: ids[:, engine.seq_len:engine.seq_len + 1]
    first = engine.prefill(ids[:, :PREFIX], "p")
    assert first.quality_token is not None and logits[PREFIX - 1][first.quality_token] >= logits[PREFIX - 1].max() - 1e-4
    top1, kl, _ = _block(engine, BLOCK, logits)
    _falls("embedded", "mqa", top1, kl)
    _still_loaded(engine, "embedded")


def _mode(key: str):
    from kvscope.core.model.attention import parse_attention

    return parse_attention(key)


def test_the_reference_cache_is_not_the_runs_kv():
    """The run's KV figures are its own cache's, the same with the probe on or off and as predicted; the probe's own
    cache is reported apart (``quality_kv_bytes``: a full dynamic cache of the loaded model). A freed cache (an
    out-of-memory error) is the one case the reference is rebuilt, from every token so far."""
    ids, logits = _text_and_reference("embedded", PREFIX + 2 * BLOCK)
    on = _engine("embedded", ids)
    off = Engine(_load("embedded"), RunSettings(), seed=0)
    off._sample_next = lambda: ids[:, off.seq_len:off.seq_len + 1]
    off.prefill(ids[:, :PREFIX], "p")
    on.apply("attention", "mqa")
    off.apply("attention", "mqa")
    full_per_token = on._reference.nbytes // on.seq_len
    for _ in range(BLOCK):
        a, b = on.step(), off.step()
        assert a.kv_bytes_held == b.kv_bytes_held == a.kv_bytes_predicted, (a.kv_bytes_held, b.kv_bytes_held)
        assert a.quality_kv_bytes == a.context_tokens * full_per_token == 8 * a.kv_bytes_held
        assert b.quality_kv_bytes is None and b.quality_top1 is None
    on.free_cache()
    assert on._reference.nbytes == 0
    on.prefill(ids[:, :PREFIX + BLOCK], "p")  # a run's restart after the error: every token so far
    assert on._reference.rebuilds == 2
    _falls("embedded", "mqa", *_block(on, BLOCK, logits)[:2])


def test_the_note_the_terminal_and_a_version_2_recording(tmp_path, capsys):
    """`run --quality-probe` says what the probe compares against; the recording is version 2 with the loaded model's
    token; a version 1 recording (the shipped demo) still reads, its new fields None; damaged fields are refused."""
    from kvscope.core.live.terminal import run_terminal
    from kvscope.core.model.request import RunRequest
    from kvscope.core.records.recording import RECORDING_VERSION, RecordingReader

    record = tmp_path / "q.jsonl"
    run_terminal(RunRequest(device="cpu", max_new_tokens=10, switches=((4, "attention", "mqa"),),
                            record_path=str(record), quality_probe=True))
    out = capsys.readouterr().out
    assert "compared with the model as loaded" in out and "not counted in the KV figures" in out
    assert RECORDING_VERSION == 2
    with RecordingReader(record) as reader:
        assert reader.version == 2
        samples = [s for s in reader if not s.is_event]
    assert all(s.quality_token is not None and s.quality_kv_bytes > s.kv_bytes_held for s in samples[5:])
    assert all(s.quality_top1 in (0, 1) and s.quality_token_text is not None for s in samples)
    with RecordingReader(ROOT / "assets" / "demo" / "demo.jsonl") as reader:
        assert reader.version == 1
        old = list(reader)
    assert old and all(s.quality_token is None and s.quality_kv_bytes is None for s in old)
    line = samples[-1].to_dict()
    json.dumps(line)
    for bad in ({"quality_token": -1}, {"quality_token": True}, {"quality_token": "7"}, {"quality_kv_bytes": -4},
                {"quality_token_text": 3}, {"quality_token_text": "x" * 300}):
        with pytest.raises(ValueError, match="quality_"):
            sample_from_json(line | bad)


# ------------------------------------------------------------------------------------------------ SmolLM2


def test_smollm2_against_its_loaded_self():
    """Real pretrained weights (3 K/V heads): unswitched 100%; window:16 at ~100 tokens and mean-pooled MQA fall far
    against the loaded model (MLA's twin, measured 0%, is left to the embedded test: its build and re-run cost 5 s);
    back to gqa:3 after each, 100% again, and the reference is SmolLM2 as loaded."""
    block = 16  # 0.1 s a token on one thread, twice (the run and the reference)
    total = WINDOW_AT + 4 * block
    ids, logits = _text_and_reference("smollm2", total)
    engine = _engine("smollm2", ids, prefix=WINDOW_AT - 8)
    _exact(*_block(engine, 8, logits))
    for switch in ("window:16", "mqa"):
        engine.apply("attention", switch)
        top1, kl, _ = _block(engine, block, logits)
        _falls("smollm2", switch, top1, kl)
        engine.apply("attention", "gqa:3")
        _exact(*_block(engine, block, logits))
    assert engine._reference.rebuilds == 1 and engine.seq_len == total
    _still_loaded(engine, "smollm2")


def test_switches_prepared_off_the_token_path_change_nothing_here():
    """A low-rank MLA latent or a small window, then back to mha through ``begin_switch``: leaving either re-runs the
    tokens so far through the loaded model (on a shadow engine, on its thread, while the run goes on). The figure
    falls, then it is the loaded model again, and the reference neither followed the shadow nor was rebuilt."""
    from kvscope.core.runtimes.transformers import rerun

    ids, logits = _text_and_reference("embedded", PREFIX + 5 * BLOCK)
    engine = _engine("embedded", ids)
    _exact(*_block(engine, BLOCK // 2, logits))
    for into in ("mla:16", "window:8"):
        answer = engine.begin_switch("attention", into)  # converted in place: at once
        assert not isinstance(answer, rerun.PreparedSwitch) and answer.event == "switch", answer
        top1, kl, _ = _block(engine, BLOCK // 2, logits)
        assert kl > 0.05, (into, top1, kl)
        prepared = engine.begin_switch("attention", "mha")
        assert isinstance(prepared, rerun.PreparedSwitch), prepared
        _block(engine, 2, logits)  # tokens generated meanwhile, under the settings before
        rerun.wait(engine, prepared)
        assert engine.mode.key == "mha"
        _exact(*_block(engine, BLOCK, logits))
    assert engine._reference.rebuilds == 1
    _still_loaded(engine, "embedded")

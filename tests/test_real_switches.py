"""Attention switches judged against the model as loaded, on real pretrained weights (SmolLM2-135M-Instruct,
tests/real_models.py) and on the embedded model (issue 34, items 2 and 6).

Teacher-forced: one fixed text goes through the engine token by token (its sampler forced to the text's next
token), and after every token the engine's next-token distribution is compared with the unswitched model's,
computed once on the whole text before the engine touched the model: top-1 agreement of the argmax and KL(loaded
|| engine) in nats, over the tokens generated after each switch. Mean-pooled MQA is measured bad on SmolLM2; a
switch back to the model's own attention is the loaded model again (top-1 100%, KL ~0, the K/V projections the
loaded tensors themselves, byte for byte), through a refused switch too and off the token path.
"""

from __future__ import annotations

import pytest
import torch

from kvscope.core.model.attention import SettingsError, parse_attention
from kvscope.core.model.settings import RunSettings
from kvscope.core.runtimes.transformers import convert, rerun
from kvscope.core.runtimes.transformers.engine import Engine
from tests import helpers, real_models

_one_thread = pytest.fixture(autouse=True, scope="module")(helpers.one_torch_thread)
pytestmark = pytest.mark.usefixtures("hub_offline")
hub_offline = helpers.hub_offline

TEXT = real_models.TEXT
PREFIX, BLOCK = 24, 36  # prompt, then one block of tokens after each switch: 24 + 2 x 36 = 96 tokens
SHORT = 16  # the blocks of the exact switches that need no re-run

#: Measured (PREFIX 24, BLOCK 36, one CPU thread, sdpa), top-1 agreement with the loaded model and KL in nats per
#: token: SmolLM2's mean-pooled MQA 2 of 36 (6%), KL 6.3; the embedded model, trained to survive pooling, 28 of 36
#: (78%), KL 0.40. Back to the model's own heads before issue 34 (pooled heads repeated): SmolLM2 0 of 36, KL 6.2;
#: embedded 81%, KL 0.39. The bounds leave room for another machine's rounding, not for a model that survives.
MQA_TOP1_BELOW = {"smollm2": 0.25, "embedded": 0.9}
MQA_KL_ABOVE = {"smollm2": 3.0, "embedded": 0.2}
#: Back to the model's own heads: the same model on the same tokens, different only in the order of the sums.
EXACT_KL = 1e-6


_load = real_models.load


@pytest.fixture(scope="module", params=["smollm2", "embedded"])
def model(request):
    """(name, a fresh load, the text's ids [1, 96], the loaded model's logits at every position [96, vocab])."""
    name = request.param
    loaded = _load(name)
    ids = loaded.tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :PREFIX + 2 * BLOCK]
    assert ids.shape[1] == PREFIX + 2 * BLOCK, ids.shape
    with torch.inference_mode():
        reference = loaded.model(input_ids=ids, use_cache=False).logits[0].float()
    return name, ids, reference


def _own_kv(engine: Engine) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's k/v weight and bias tensors (no copy), as the engine's model holds them now."""
    return [tuple(t for t in (a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias) if t is not None)
            for a in convert._attention_modules(engine.base_model)]


def _bytes(tensors: list[tuple[torch.Tensor, ...]]) -> list[bytes]:
    return [t.detach().contiguous().view(torch.uint8).numpy().tobytes() for layer in tensors for t in layer]


def _engine(name: str, ids: torch.Tensor) -> Engine:
    """An engine on a fresh load of ``name`` whose sampler takes the text's next token (teacher forcing)."""
    engine = Engine(_load(name), RunSettings(), seed=0)
    engine._sample_next = lambda: ids[:, engine.seq_len:engine.seq_len + 1]
    engine.prefill(ids[:, :PREFIX], "p")
    return engine


def _quality(engine: Engine, reference: torch.Tensor, n: int) -> tuple[float, float]:
    """Teacher-force ``n`` tokens through the engine: (top-1 agreement with the loaded model, mean KL in nats)
    of the next-token distributions each of these forward passes left; the KV bytes exact at each."""
    agree, kl = 0, 0.0
    for _ in range(n):
        sample = engine.step()
        assert sample.kv_bytes_reserved == sample.kv_bytes_predicted, (engine.mode.key, sample.token)
        ours, ref = engine._next_logits[0], reference[engine.seq_len - 1]
        agree += int(ours.argmax()) == int(ref.argmax())
        log_ours, log_ref = torch.log_softmax(ours, -1), torch.log_softmax(ref, -1)
        kl += float((log_ref.exp() * (log_ref - log_ours)).sum())
    return agree / n, max(0.0, kl / n)


def test_mean_pooled_mqa_then_back_is_the_loaded_model_again(model, monkeypatch):
    name, ids, reference = model
    engine = _engine(name, ids)
    own = engine.mode.key
    loaded_kv = _own_kv(engine)
    loaded_bytes = _bytes(loaded_kv)

    event = engine.apply("attention", "mqa:mean")
    assert "approximate (heads mean-pooled" in event.text and event.tokens_rerun is None, event.text
    top1, kl = _quality(engine, reference, BLOCK)
    assert top1 < MQA_TOP1_BELOW[name] and kl > MQA_KL_ABOVE[name], (name, "mqa", top1, kl)

    # A switch back that fails (its trial pass) restores the pooled model; the tensors kept aside survive it.
    with monkeypatch.context() as patched:
        helpers.fail_the_trial_pass(patched)
        with pytest.raises(SettingsError, match="nothing was changed"):
            engine.apply("attention", own)
    assert engine.mode.key == "mqa:mean" and convert.kv_heads_of(engine.base_model) == 1

    event = engine.apply("attention", own)
    top1, kl = _quality(engine, reference, BLOCK)
    assert top1 == 1.0 and kl < EXACT_KL, (name, f"mqa -> {own}", top1, kl)
    now = _own_kv(engine)
    assert _bytes(now) == loaded_bytes
    assert all(a is b for mine, theirs in zip(now, loaded_kv) for a, b in zip(mine, theirs))
    assert "re-ran" in event.text and "as loaded" in event.text and "mean-pooled" in event.text, event.text
    assert event.tokens_rerun == PREFIX + BLOCK


@pytest.mark.parametrize("model", ["smollm2"], indirect=True)  # the embedded model is MHA: no count above its own
def test_repeated_heads_and_back_never_re_run(model):
    """Up to MHA repeats the model's own heads (exact); back down to them takes one of each repeated head of the
    cache and the loaded tensors: no re-run, and still the loaded model."""
    name, ids, reference = model
    engine = _engine(name, ids)
    own = engine.mode.key
    assert own == "gqa:3"
    loaded_bytes = _bytes(_own_kv(engine))
    event = engine.apply("attention", "mha")
    assert "exact (heads repeated)" in event.text and event.tokens_rerun is None, event.text
    top1, kl = _quality(engine, reference, SHORT)
    assert top1 == 1.0 and kl < EXACT_KL, (name, "mha", top1, kl)
    event = engine.apply("attention", own)
    assert "exact: the model's own K/V projections as loaded" in event.text and event.tokens_rerun is None, event.text
    assert _bytes(_own_kv(engine)) == loaded_bytes
    top1, kl = _quality(engine, reference, SHORT)
    assert top1 == 1.0 and kl < EXACT_KL, (name, f"mha -> {own}", top1, kl)


def test_back_from_mqa_off_the_token_path():
    """The re-run a pooled cache needs is prepared off the token path (rerun.may_rerun agrees with the engine),
    and what it leaves is the loaded model."""
    loaded = _load("embedded")
    ids = loaded.tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :PREFIX + 2 * BLOCK]
    with torch.inference_mode():
        reference = loaded.model(input_ids=ids, use_cache=False).logits[0].float()
    engine = _engine("embedded", ids)
    loaded_bytes = _bytes(_own_kv(engine))
    engine.apply("attention", "mqa")
    _quality(engine, reference, 8)
    assert rerun.may_rerun(engine, "attention", parse_attention("mha"))
    assert not rerun.may_rerun(engine, "attention", parse_attention("mqa"))
    prepared = engine.begin_switch("attention", "mha")
    assert isinstance(prepared, rerun.PreparedSwitch)
    event = rerun.wait(engine, prepared)
    assert "re-ran" in event.text and "as loaded" in event.text, event.text
    assert engine._kv_origin.is_loaded(engine.base_model) and _bytes(_own_kv(engine)) == loaded_bytes
    top1, kl = _quality(engine, reference, 16)
    assert top1 == 1.0 and kl < EXACT_KL, ("embedded", "mqa -> mha off the token path", top1, kl)


def test_every_head_change_starts_from_the_loaded_projections():
    """gqa:2 then gqa:4 is gqa:4 pooled from the model's own 8 heads, not gqa:2's pooled heads repeated."""
    direct, detour = _load("embedded").model, _load("embedded").model
    kept = convert.keep_kv_projections(direct)
    assert convert.set_kv_heads(direct, 4, origin=kept) is False
    origin = convert.keep_kv_projections(detour)
    convert.set_kv_heads(detour, 2, origin=origin)
    convert.set_kv_heads(detour, 4, origin=origin)
    for a, b in zip(convert._attention_modules(direct), convert._attention_modules(detour)):
        assert torch.equal(a.k_proj.weight, b.k_proj.weight) and torch.equal(a.v_proj.weight, b.v_proj.weight)
    assert convert.set_kv_heads(detour, 8, origin=origin) is True and origin.is_loaded(detour)

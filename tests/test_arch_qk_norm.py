"""Fewer K/V heads on models with a norm on K after its projection (issue 34: Qwen3, Gemma 3, OLMo 2...).

A head merge is correct when the cache it leaves is what the switched model itself computes for the same tokens:
the next token's logits from the converted cache equal those of the switched model run on every token from scratch.
Without a norm on K the aligned merge's maps commute with the projection and rotary, and that holds. With one, the
keys are normalized per head after the projection, and neither a merged nor a mean-pooled cache of the normalized
keys is what the merged model computes: such a switch is refused with the reason, or, where it applies, passes this
check. Tiny random models from the architecture matrix (``tests/archs.py``), one real engine each.
"""

from __future__ import annotations

import pytest
import torch

from tests import archs

#: Architectures of the matrix with q/k norms after the projections (a survey of the registry with
#: ``merge.QK_NORMS``: 50 model types of transformers 5.24), a few of each kind: per head (Qwen3, Gemma 3, its
#: sliding layers), over all heads at once (OLMo 2), a LayerNorm (LFM2); and Llama (no norm on K) as the control.
NORMED = ("qwen3", "gemma3_text", "olmo2", "lfm2")
PLAIN = ("llama",)

#: Measured before the switch rules knew of it (2026-12-04): a live switch below the model's own heads mean-pooled the
#: cache's normalized keys in place, which is not what the pooled model computes from the same layer inputs (worst
#: relative difference 0.48 Qwen3, 0.50 Gemma 3, 0.57 LFM2), and OLMo 2 (one k_norm over all K/V heads at once) was
#: refused by the trial pass with an internal error. Now the tokens so far re-run through the model with fewer heads
#: (``merge.normalized_keys_rerun``), and OLMo 2 is refused with its norm named (``merge.head_change_problem``).
REFUSED = ("olmo2",)


def _engine(model_type: str, root):
    from kvscope.core.model.request import DEFAULT_PROMPT
    from kvscope.core.model.settings import RunSettings
    from kvscope.core.runtimes.transformers.engine import Engine
    from kvscope.core.runtimes.transformers.loading import load_model

    folder = archs.build_tiny_folder(model_type, root)
    loaded = load_model(str(folder), device="cpu")
    engine = Engine(loaded, RunSettings(), seed=0)
    prompt = loaded.tokenizer(DEFAULT_PROMPT, return_tensors="pt")["input_ids"][:, :24]
    engine.prefill(prompt, DEFAULT_PROMPT)
    for _ in range(3):
        engine.step()
    return engine


def _layer_inputs(engine) -> list[torch.Tensor]:
    """Each attention layer's input over the tokens so far, as the model as loaded computes it (the hidden states a
    conversion in place keeps: only layer 0's would be the same through the switched model)."""
    from kvscope.core.runtimes.transformers import convert

    seen: list[torch.Tensor] = []

    def keep(module, args, kwargs):
        seen.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach().clone())

    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True)
             for m in convert._attention_modules(engine.base_model)]
    try:
        _fresh_cache(engine)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _fresh_cache(engine, inputs: list[torch.Tensor] | None = None):
    """The cache the model in force fills for every token so far; with ``inputs``, each attention layer fed the
    loaded model's own input to it (what a conversion in place must equal)."""
    from transformers import DynamicCache

    from kvscope.core.runtimes.transformers import convert

    modules = convert._attention_modules(engine.base_model)
    hooks = []
    if inputs is not None:
        def feed(i):
            def swap(module, args, kwargs):
                if "hidden_states" in kwargs:
                    return args, dict(kwargs, hidden_states=inputs[i])
                return (inputs[i],) + tuple(args[1:]), kwargs
            return swap
        hooks = [m.register_forward_pre_hook(feed(i), with_kwargs=True) for i, m in enumerate(modules)]
    cache = DynamicCache(config=engine.model.config)
    try:
        with torch.inference_mode():
            engine.model(input_ids=engine.ids[:, :engine.seq_len], cache=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return cache


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qk-norm")


@pytest.mark.parametrize("model_type", NORMED + PLAIN)
def test_a_key_norm_is_named_where_it_is(model_type, root):
    from kvscope.core.runtimes.transformers import convert, merge

    engine = _engine(model_type, root)
    model = engine.base_model
    norms = {n for m in convert._attention_modules(model) for n in merge.QK_NORMS
             if isinstance(getattr(m, n, None), torch.nn.Module)}
    assert bool(norms) == (model_type in NORMED), (model_type, norms)
    why = merge.problem(model)
    assert (why is not None) == (model_type in NORMED)
    if why:
        assert any(n in why for n in norms), why


@pytest.mark.parametrize("value", ["mqa", "mqa:mean"])
@pytest.mark.parametrize("model_type", NORMED + PLAIN)
def test_fewer_heads_leave_the_cache_the_switched_model_computes_or_are_refused(model_type, value, root):
    from kvscope.core.model.attention import SettingsError
    from kvscope.core.runtimes.transformers import convert

    torch.set_num_threads(1)
    engine = _engine(model_type, root)
    own = convert.kv_heads_of(engine.base_model)
    assert own >= 2, (model_type, own)
    before = (engine.mode.key, engine.seq_len, convert.kv_heads_of(engine.base_model))
    inputs = _layer_inputs(engine)
    try:
        event = engine.apply("attention", value)
    except SettingsError as exc:
        assert model_type in REFUSED, f"{model_type} {value} refused: {exc}"
        assert "k_norm" in str(exc) and "all heads" in str(exc), str(exc)  # the reason names the norm
        assert (engine.mode.key, engine.seq_len, convert.kv_heads_of(engine.base_model)) == before
        return
    assert model_type not in REFUSED, event.text
    assert event.event == "switch", event.text
    # A norm on K: the tokens so far go through the model with fewer heads again, and the event says why.
    assert ("re-ran" in event.text and "normalizes its keys" in event.text) == (model_type in NORMED), event.text
    assert convert.kv_heads_of(engine.base_model) == 1
    # In place: each layer's K/V as the switched layer computes them from the loaded model's inputs to it; re-run:
    # as the switched model computes them from the tokens.
    expected = _fresh_cache(engine, None if "re-ran" in event.text else inputs)
    worst = 0.0
    for i, (live, want) in enumerate(zip(engine.cache.layers, expected.layers)):
        n = want.keys.shape[-2]
        for a, b in ((live.keys, want.keys), (live.values, want.values)):
            a = a[..., -n:, :] if a.shape[-2] <= n else a[..., :n, :]  # (a sliding layer holds its window)
            b = b[..., -a.shape[-2]:, :]
            worst = max(worst, float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6)))
    assert worst < 1e-4, (f"{model_type} {value}: {event.text}; the converted cache is not what the switched "
                          f"model's layers compute from the same inputs (worst relative difference {worst:.3g})")
    sample = engine.step()
    assert sample.kv_bytes_held == sample.kv_bytes_predicted

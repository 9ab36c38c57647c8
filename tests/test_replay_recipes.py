"""The activation replay's recipes (kvscope.core.prediction.replay): one per architecture family, over shared blocks.

What is checked here is the registry and its shape: every recipe is one the allocator check replays
(tests/test_prefill_peak.py runs each of them against PyTorch's CPU allocator, prefill and decode), each names a
modeling file transformers really has, a model type without a recipe gets Llama's layer and says so, a new
architecture is a recipe and one line of the registry, and no block or recipe grows back into a long function.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.prediction import replay
from kvscope.core.prediction.predict import decode_peak, prefill_peak
from kvscope.core.prediction.replay.decoder import Decoder
from kvscope.core.prediction.replay.registry import DEFAULT, RECIPES, recipe_for
from kvscope.core.prediction.replay.gemma import Gemma2
from kvscope.core.prediction.replay.neox import LayerNormDecoder

REPLAY_DIR = Path(replay.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400


def _transformers_models_dir() -> Path:
    found = importlib.util.find_spec("transformers")
    if found is None or not found.submodule_search_locations:
        pytest.skip("transformers is not installed")
    return Path(next(iter(found.submodule_search_locations))) / "models"


def test_every_recipe_is_checked_against_the_allocator():
    """The registry and tests/test_prefill_peak.py's EXACT are the same set: a recipe added without its allocator
    check (or a check of a type that has no recipe, replayed by the default) fails here."""
    pytest.importorskip("torch")
    from tests.test_prefill_peak import EXACT

    assert set(RECIPES) == set(EXACT), (sorted(set(RECIPES) - set(EXACT)), sorted(set(EXACT) - set(RECIPES)))


def test_every_recipe_type_is_one_the_arch_matrix_builds():
    """Each recipe's model type is in transformers' causal-LM registry (tests/archs.py's list), so that the arch
    matrix and the allocator check build it tiny and run it for real."""
    pytest.importorskip("transformers")
    from tests import archs

    registered = set(archs.registry_model_types())
    for model_type in RECIPES:
        assert model_type in registered, f"{model_type} is not in transformers' causal-LM registry"


def test_each_recipe_follows_a_modeling_file_transformers_has():
    models = _transformers_models_dir()
    for model_type, recipe in RECIPES.items():
        assert isinstance(recipe, Decoder), model_type
        path = models.parent / recipe.follows
        assert recipe.follows.startswith("models/") and path.is_file(), \
            f"{model_type}: {recipe.follows} is not in {models}"


def _spec(name: str = "smollm2-135m", **changes):
    return dataclasses.replace(load_spec(name), **changes)


def test_a_type_without_a_recipe_gets_the_llama_layer_and_says_so():
    assert recipe_for("no_such_arch") == (DEFAULT, False)
    assert recipe_for("llama") == (RECIPES["llama"], True)
    settings = RunSettings(attn_impl="eager")
    llama, other = _spec(), _spec(model_type="no_such_arch")
    for n in (7, 300):
        ours, stand_in = prefill_peak(llama, settings, n), prefill_peak(other, settings, n)
        assert ours.exact and not stand_in.exact
        assert (stand_in.peak, stand_in.end, stand_in.where) == (ours.peak, ours.end, ours.where)


def test_a_new_architecture_is_a_recipe_and_one_registry_line(monkeypatch):
    """Registering a recipe for a model type is all it takes: the replay follows it (and calls it exact, with the
    numbers of the type it was registered from); a recipe of its own that changes two hooks (LayerNorm, a dense
    MLP) changes the peak and leaves what the pass writes (the KV, the logits) as it was."""
    spec = _spec(model_type="new_arch")
    settings = RunSettings(attn_impl="eager")
    before = prefill_peak(spec, settings, 64)
    monkeypatch.setitem(RECIPES, "new_arch", Gemma2())
    as_gemma2 = prefill_peak(spec, settings, 64)
    assert as_gemma2.exact and not before.exact
    assert as_gemma2 == prefill_peak(dataclasses.replace(spec, model_type="gemma2"), settings, 64)
    assert as_gemma2.end == before.end  # the same KV written, the same logits

    class DenseNewArch(LayerNormDecoder):
        follows = "models/gpt_neox/modeling_gpt_neox.py"

    monkeypatch.setitem(RECIPES, "new_arch", DenseNewArch())
    dense = prefill_peak(spec, settings, 64)
    assert dense.exact and dense.end == before.end and dense.peak != before.peak


def test_windows_and_kernels_are_shared_by_every_recipe():
    """The blocks every recipe shares: a decode step past a sliding window is not replayed (exact False whatever the
    recipe), a window that bites gives sdpa a mask, a second CPU thread adds at most one thread's sdpa buffers
    (tests/test_prefill_peak.py checks them against the allocator at 1 and 2 threads), a GPU has none."""
    from kvscope.core.model.spec import SLIDING_ATTENTION

    from kvscope.core.prediction.replay.attention import sdpa_cpu_buffers

    full = _spec()
    sliding = dataclasses.replace(full, layer_types=(SLIDING_ATTENTION,) * len(full.layer_types), sliding_window=16)
    settings = RunSettings(attn_impl="sdpa")
    for model_type in ("llama", "gemma2", "gpt_neox", "olmo2", "no_such_arch"):
        typed = dataclasses.replace(sliding, model_type=model_type)
        assert not decode_peak(typed, settings, 100).exact, model_type
        assert decode_peak(dataclasses.replace(full, model_type=model_type), settings, 100).exact == (
            model_type in RECIPES), model_type
        assert prefill_peak(typed, settings, 64).peak > prefill_peak(dataclasses.replace(typed, sliding_window=None,
                                                                                         layer_types=full.layer_types),
                                                                      settings, 64).peak, model_type
    one, two = (prefill_peak(full, settings, 256, cpu_threads=t) for t in (1, 2))
    gpu = prefill_peak(full, settings, 256, device="cuda")
    per_thread = sum(sdpa_cpu_buffers(1, full.num_query_heads, 256, 256, full.head_dim, 4, 1))
    assert gpu.peak <= one.peak <= two.peak <= one.peak + per_thread  # at most one more thread's buffers


def _sizes(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_no_long_function_or_class_in_the_replay():
    files = sorted(REPLAY_DIR.glob("*.py")) + [REPLAY_DIR.parent / "predict.py"]
    assert len(files) >= 8
    for path in files:
        for node, lines in _sizes(path):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            assert lines <= limit, f"{path.name}:{node.lineno} {node.name} is {lines} lines (at most {limit})"

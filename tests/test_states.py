"""States beside K/V (``kvscope.core.model.states``): linear-attention, state-space and convolution layers keep fixed-size
states that the predictor adds, in the model's dtype or their own, measured once per config on the meta device
(``kvscope.core.model.hf.probe_states``); the architecture matrix checks them in float32 against real caches, this file in
bfloat16 (where a float32 recurrent state and a bfloat16 conv state differ) and the view's storage."""

from __future__ import annotations

import pytest

from kvscope.core.model.caches import kv_layout
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import NO_KV, ConfigView, ModelFacts
from kvscope.core.model.states import LayerState, state_bytes

torch = pytest.importorskip("torch")


def _view(**changes):
    good = ConfigView(True, ("no_kv", "full_attention"), None, ModelFacts(10, 2, False, True),
                      (LayerState(768, 4096), LayerState(0, 0)), False).to_json()
    return good | changes


def test_a_view_keeps_states_and_tying_and_refuses_damaged_ones():
    assert ConfigView.from_json(_view()).states == (LayerState(768, 4096), LayerState(0, 0))
    assert ConfigView.from_json(_view()).tied is False
    # A view stored before states existed (a preset's): no states, tying as config.json says.
    old = {k: v for k, v in _view().items() if k not in ("states", "tied")}
    assert ConfigView.from_json(old).states is None and ConfigView.from_json(old).tied is None
    for damaged in ({"states": [[1, 2]]}, {"states": [[1, -2], [0, 0]]}, {"states": [[1, 2, 3], [0, 0]]},
                    {"states": "many"}, {"states": [[True, 0], [0, 0]]}, {"tied": "yes"},
                    {"layer_types": ["no_kv", "nonsense"]}):
        assert ConfigView.from_json(_view(**damaged)) is None, damaged


def test_state_bytes_follow_the_model_dtype_except_fixed_ones():
    states = (LayerState(768, 4096), LayerState(0, 0))
    assert state_bytes(states, 1, 2, 5) == 768 * 2 + 4096
    assert state_bytes(states, 3, 4, 5) == 3 * (768 * 4 + 4096)
    assert state_bytes(states, 1, 2, 0) == 0 and state_bytes(None, 1, 2, 9) == 0


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba", "lfm2_moe", "mamba"])
def test_states_are_exact_in_bfloat16(model_type, tmp_path):
    """bfloat16 weights: conv states in bfloat16, recurrent states (Qwen3-Next, Mamba) kept in float32."""
    from transformers import DynamicCache

    from kvscope.core.model.settings import RunSettings
    from kvscope.core.prediction.predict import kv_bytes
    from kvscope.core.runtimes.transformers.measure import cache_bytes
    from tests import archs

    folder = archs.build_tiny_folder(model_type, tmp_path)
    found = load_spec(str(folder))
    assert found.layer_states and NO_KV in found.layer_types
    assert len(kv_layout(found)) == found.num_kv_layers < found.num_layers
    model = archs.build_tiny_model(model_type).to(torch.bfloat16)
    ids = torch.arange(3, 24).unsqueeze(0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
        for n in range(22, 25):
            model(input_ids=ids[:, :1], cache=cache, use_cache=True)
            assert cache_bytes(cache).logical == kv_bytes(found, RunSettings(weight_dtype="bfloat16"), n)

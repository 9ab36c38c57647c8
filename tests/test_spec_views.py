"""What transformers makes of a config (``kvscope.core.model.spec.ConfigView``) is found once and then read without it:
presets carry it (and must carry the view a fresh transformers gives), the on-disk memo keeps it per
config and transformers version, and both are read as untrusted input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.core.model import spec
from kvscope.core.model.hf import compute_view
from kvscope.core.model.hf_config import config_key, config_view, spec_from_config
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import PRESETS_DIR, ConfigView, _text_config

PRESETS = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_carries_the_view_transformers_gives_now(name):
    """Stale after a pin bump or a preset edit: run scripts/refresh_presets.py."""
    cfg = json.loads((PRESETS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    shipped = ConfigView.from_json(cfg["_kvscope"].get("view"))
    assert shipped is not None, f"{name}: no view for transformers {spec.transformers_version()}"
    assert shipped == compute_view(config_key(_text_config(cfg)))


def test_spec_from_a_shipped_view_equals_the_spec_found_with_transformers():
    cfg = json.loads((PRESETS_DIR / "gemma-3-27b.json").read_text(encoding="utf-8"))
    bare = {k: v for k, v in cfg.items() if k != "_kvscope"}
    with_view, found = load_spec("gemma-3-27b"), spec_from_config(bare, "gemma-3-27b")
    assert with_view.layer_types == found.layer_types and with_view.sliding_window == found.sliding_window == 1024
    assert with_view.num_parameters == found.num_parameters == 27_009_346_304


def _view_json(**changes):
    good = ConfigView(True, ("full_attention", "sliding_attention"), 8, spec.ModelFacts(10, 2, True, False)).to_json()
    return good | changes


@pytest.mark.parametrize("changes", [
    {"transformers": "0.0.1"}, {"known": "yes"}, {"layer_types": ["full_attention", "nonsense"]},
    {"layer_types": "full_attention"}, {"sliding_window": -4}, {"sliding_window": 2.5}, {"sliding_window": True},
    {"facts": [1, 2, 3]}, {"facts": [1, -2, 0, 1]}, {"facts": ["1", 2, 0, 1]}, {"facts": {"parameters": 1}},
])
def test_a_damaged_or_stale_view_is_not_used(changes):
    assert ConfigView.from_json(_view_json()) is not None
    assert ConfigView.from_json(_view_json(**changes)) is None
    assert ConfigView.from_json([1, 2]) is None and ConfigView.from_json("view") is None


def test_memo_is_written_once_and_a_damaged_memo_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path))
    cfg = json.loads((PRESETS_DIR / "smollm2-135m.json").read_text(encoding="utf-8"))
    cfg = {k: v for k, v in cfg.items() if k != "_kvscope"} | {"num_hidden_layers": 3}
    view = config_view(cfg)
    store = tmp_path / "config_views.json"
    memo = json.loads(store.read_text(encoding="utf-8"))
    assert list(memo.values()) == [view.to_json()] and view.facts.parameters < 134_515_008
    for damaged in ("{not json", "[]", json.dumps({k: {"known": 3} for k in memo})):
        store.write_text(damaged, encoding="utf-8")
        assert config_view(cfg) == view
        assert json.loads(store.read_text(encoding="utf-8")) == memo  # rebuilt
    assert Path(store).is_file() and not list(tmp_path.glob("*.tmp"))

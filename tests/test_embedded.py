"""The embedded demo model: built offline, deterministic, loadable, with a working tokenizer."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch

from core import embedded
from core.embedded import EMBEDDED_LABEL, EmbeddedBuildError, embedded_model_dir, folder_bytes
from core.loading import LoadError, load_model
from core.spec import load_spec


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A private KVSCOPE_CACHE for this module, with the embedded model built once in it."""
    root = tmp_path_factory.mktemp("kvscope-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSCOPE_CACHE", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        embedded_model_dir()
        yield root


@pytest.fixture(scope="module")
def built(cache_root) -> Path:
    return embedded_model_dir()


@pytest.fixture(scope="module")
def loaded(built):
    return load_model("embedded", device="cpu")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_build_is_byte_identical_in_another_cache(built, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "other"))
    again = embedded_model_dir()
    assert again != built and again.name == built.name  # same recipe hash, different cache
    assert (again / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert _digests(again) == _digests(built)  # every file, tokenizer included


def test_folder_holds_safetensors_config_and_tokenizer(built):
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth"))]  # safetensors only
    assert built.parent == Path(embedded.embedded_cache_root())
    assert built.name.endswith(embedded.recipe_digest())
    cfg = json.loads((built / "config.json").read_text())
    preset = json.loads(embedded.PRESET_PATH.read_text())
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id"):
        assert cfg[key] == preset[key], key
    # 3.43 M fp32 parameters, tied head stored once: about 13 MiB in all.
    assert 13_000_000 < folder_bytes(built) < 14_500_000


def test_second_call_reuses_the_folder(built):
    before = (built / "model.safetensors").stat().st_mtime_ns
    assert embedded_model_dir() == built
    assert (built / "model.safetensors").stat().st_mtime_ns == before


def test_incomplete_folder_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path))
    folder = embedded_model_dir()
    good = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()  # e.g. a user's half-done cleanup
    messages: list[str] = []
    assert embedded_model_dir(progress=messages.append) == folder
    assert (folder / "model.safetensors").read_bytes() == good
    assert messages == ["building embedded model…"]


def test_two_concurrent_builds_leave_one_complete_folder(tmp_path, monkeypatch):
    """Both builders finish their temp folder before either renames: one rename loses, cleanly."""
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path))
    barrier = threading.Barrier(2, timeout=60)
    real_build = embedded.build_into

    def build_then_wait(folder):
        real_build(folder)
        barrier.wait()  # force the race on the rename

    monkeypatch.setattr(embedded, "build_into", build_then_wait)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker():
        try:
            results.append(embedded_model_dir())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, name=f"embedded-build-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert len(results) == 2 and results[0] == results[1]
    root = embedded.embedded_cache_root()
    assert [p.name for p in root.iterdir()] == [results[0].name]  # no .build-* leftovers
    assert embedded._is_complete(results[0])


def test_unwritable_cache_gives_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVSCOPE_CACHE", str(blocker / "cache"))
    with pytest.raises(EmbeddedBuildError, match="KVSCOPE_CACHE"):
        embedded_model_dir()
    with pytest.raises(LoadError) as info:
        load_model("embedded", device="cpu")
    assert "cannot write the KV Scope cache" in str(info.value)
    assert info.value.offer_embedded is False  # the embedded model is what failed


def test_tokenizer_round_trips_and_matches_config(loaded):
    tok = loaded.tokenizer
    assert len(tok) == 1024
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for text in ["The lighthouse keeper counted the waves.", "Ünïcödé, 你好, emoji 🙂 and\ttabs\nnew lines",
                 "  leading spaces", "x" * 300]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert max(ids) < 1024
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Trained on the corpus: common words are single tokens, so English compresses well.
    assert len(tok("the market square is already busy")["input_ids"]) < 12


def test_spec_matches_preset(loaded):
    spec, preset = loaded.spec, load_spec("embedded")
    assert (spec.num_layers, spec.num_query_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (4, 8, 8, 32, 1024)
    for field in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size",
                  "num_parameters", "tie_word_embeddings", "layer_types", "dtype"):
        assert getattr(spec, field) == getattr(preset, field), field
    assert spec.num_parameters == sum(p.numel() for p in loaded.model.parameters())
    assert loaded.label == EMBEDDED_LABEL == spec.label
    assert (loaded.device, loaded.dtype, loaded.source) == ("cpu", "float32", "embedded")
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == "sdpa"


def test_forward_pass(loaded):
    ids = loaded.tokenizer("Measure twice, cut once.", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = loaded.model(ids)
    assert out.logits.shape == (1, ids.shape[1], 1024)
    assert torch.isfinite(out.logits).all()
    assert out.logits[0, -1].std() > 1.0  # logits spread out: sampling is not uniform noise


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generation_is_varied_nonsense(loaded, sample):
    ids = loaded.tokenizer("The lighthouse keeper", return_tensors="pt").input_ids
    torch.manual_seed(0)
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=64, do_sample=sample, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 64  # never stops early on </s>
    assert len(set(new)) >= 10, new

"""The embedded demo model: built offline, deterministic, loadable, with a working tokenizer and
the shipped trained weights (SHA-256 checked; random weights, said so, when the file is damaged)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from kvscope.core.model import embedded
from kvscope.core.model.embedded import (EMBEDDED_LABEL, RANDOM_WEIGHTS_LABEL, EmbeddedBuildError, corpus_word_share,
                                         embedded_build, embedded_model_dir, folder_bytes)
from kvscope.core.model.request import DEFAULT_PROMPT
from kvscope.core.model.sources import load_spec
from kvscope.core.runtimes.transformers.loading import LoadError, load_model


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

    def build_then_wait(folder, **kwargs):
        real_build(folder, **kwargs)
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
    """An unwritable cache builds this run's copy in the temporary folder (issue 38); with that unwritable too, the
    error says so in one line."""
    import tempfile

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVSCOPE_CACHE", str(blocker / "cache"))
    build = embedded_build()
    assert build.folder.parent == Path(tempfile.gettempdir()) and "for this run only" in build.note
    shutil.rmtree(build.folder)
    monkeypatch.setattr(tempfile, "tempdir", str(blocker / "tmp"))
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
    assert len(tok("the cache grows with every token")["input_ids"]) == 7  # <s> and one token a word


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


def _top_k_text(model, tokenizer, prompt: str, n: int, *, greedy: bool, seed: int = 0) -> str:
    """``n`` tokens after ``prompt`` as the engine samples them (top-k 40 at temperature 1), or greedy."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        cache = None
        step_ids = ids
        for _ in range(n):
            res = model(input_ids=step_ids, cache=cache, use_cache=True)
            cache, logits = res.cache, res.logits[:, -1, :].float()
            if greedy:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                top = torch.topk(logits, 40, dim=-1)
                nxt = top.indices.gather(-1, torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen))
            out.append(int(nxt))
            step_ids = nxt
    return tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_trained_model_writes_corpus_english_from_the_default_prompt(loaded, greedy):
    assert loaded.label == EMBEDDED_LABEL and not loaded.notes
    text = _top_k_text(loaded.model, loaded.tokenizer, DEFAULT_PROMPT, 120, greedy=greedy)
    share, n_words = corpus_word_share(text)
    assert n_words >= 40, text  # words, not digits or punctuation
    assert share >= 0.95, text  # random weights score about 0.4 (test below)


def test_generation_runs_its_length_and_varies(loaded):
    ids = loaded.tokenizer(DEFAULT_PROMPT, return_tensors="pt").input_ids
    torch.manual_seed(0)
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 64  # never stops early on </s>
    assert len(set(new)) >= 20, new  # not a loop of a few tokens


# ------------------------------------------------------------------------------ shipped weights


def test_shipped_weights_are_the_ones_the_loader_expects():
    from safetensors import safe_open

    data = embedded.WEIGHTS_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == embedded.WEIGHTS_SHA256
    assert 6_500_000 < len(data) < 7_500_000  # 3.43 M fp16 parameters, tied head stored once
    assert embedded.weights_problem() is None and embedded._header_problem() is None
    with safe_open(str(embedded.WEIGHTS_PATH), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
        n = sum(int(torch.tensor(f.get_slice(k).get_shape()).prod()) for k in f.keys())
    assert n == load_spec("embedded").num_parameters == 3_426_560


def test_built_folder_holds_the_shipped_weights(built):
    from safetensors.torch import load_file

    assert json.loads((built / "kvscope_recipe.json").read_text())["weights"] == "trained"
    shipped = embedded._trained_state_dict()
    folder = load_file(str(built / "model.safetensors"))
    assert folder.keys() == shipped.keys()
    assert all(torch.equal(folder[k], shipped[k]) and folder[k].dtype == torch.float32 for k in folder)


@pytest.fixture
def weights_copy(tmp_path, monkeypatch):
    """A private cache and a copy of the shipped weights the test may damage (never the real file)."""
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "model.safetensors"
    copy.write_bytes(embedded.WEIGHTS_PATH.read_bytes())
    monkeypatch.setattr(embedded, "WEIGHTS_PATH", copy)
    return copy


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _assert_random_fallback(says: str, loaded_fallback, messages: list[str]) -> None:
    assert loaded_fallback.label == RANDOM_WEIGHTS_LABEL == loaded_fallback.spec.label
    note = messages[-1]  # the last status line, after "ready: ...": it stays on screen
    assert note.startswith("note: the trained weights") and says in note and "random weights" in note, messages
    assert "\n" not in note and loaded_fallback.notes == (note,)
    assert messages[-2].startswith(f"ready: {RANDOM_WEIGHTS_LABEL}")
    spec = loaded_fallback.spec
    assert (spec.num_parameters, spec.num_kv_heads, spec.head_dim) == (3_426_560, 8, 32)  # same model, same bytes


def test_intact_copy_loads_the_trained_weights(weights_copy):
    build = embedded_build()
    assert build.trained and build.note is None and build.label == EMBEDDED_LABEL
    messages: list[str] = []
    lm = load_model("embedded", device="cpu", progress=messages.append)
    assert lm.label == EMBEDDED_LABEL and lm.notes == () and messages[-1].startswith("ready:")


def test_missing_weights_fall_back_to_random_and_say_so(weights_copy):
    weights_copy.unlink()
    trained_folder = embedded.embedded_cache_root() / f"llama-4x256-{embedded.recipe_digest(True)}"
    messages: list[str] = []
    lm = load_model("embedded", device="cpu", progress=messages.append)
    _assert_random_fallback("is missing", lm, messages)
    build = embedded_build()
    assert not build.trained and build.folder != trained_folder
    assert json.loads((build.folder / "kvscope_recipe.json").read_text())["weights"] == "random"
    # Random weights write byte-level fragments: few of their words are the corpus's.
    text = _top_k_text(lm.model, lm.tokenizer, DEFAULT_PROMPT, 120, greedy=False)
    assert corpus_word_share(text)[0] < 0.7, text


def test_damaged_weights_fall_back_to_random_and_say_so(weights_copy):
    _flip_byte(weights_copy, weights_copy.stat().st_size // 2)  # one byte of one tensor
    messages: list[str] = []
    lm = load_model("embedded", device="cpu", progress=messages.append)
    _assert_random_fallback("is damaged", lm, messages)
    assert embedded.recipe_digest() == embedded.recipe_digest(False)


@pytest.mark.parametrize("damage", ["header", "truncated", "empty"])
def test_bad_header_falls_back_even_when_the_hash_is_its_own(weights_copy, monkeypatch, damage):
    """Past the SHA-256 (patched here to the damaged file's own), the safetensors header is checked too."""
    if damage == "header":
        _flip_byte(weights_copy, 12)  # inside the header's JSON
    elif damage == "truncated":
        weights_copy.write_bytes(weights_copy.read_bytes()[:4096])
    else:
        weights_copy.write_bytes(b"")
    monkeypatch.setattr(embedded, "WEIGHTS_SHA256", hashlib.sha256(weights_copy.read_bytes()).hexdigest())
    messages: list[str] = []
    lm = load_model("embedded", device="cpu", progress=messages.append)
    _assert_random_fallback("not valid safetensors", lm, messages)


def test_weights_that_do_not_fit_the_preset_fall_back(weights_copy, monkeypatch):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights_copy))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(weights_copy))
    monkeypatch.setattr(embedded, "WEIGHTS_SHA256", hashlib.sha256(weights_copy.read_bytes()).hexdigest())
    messages: list[str] = []
    lm = load_model("embedded", device="cpu", progress=messages.append)
    _assert_random_fallback("does not fit", lm, messages)


def test_the_window_shows_the_fallback_in_its_badge_and_status_bar(qtbot, thread_window, weights_copy):
    """On screen: the model badge names the random weights and the status bar says why (no new widget)."""
    from kvscope.core.model.request import RunRequest
    from tests.helpers import run_in_window

    weights_copy.unlink()
    shown: list[str] = []
    thread_window.status_line.message_changed.connect(shown.append)
    run_in_window(qtbot, thread_window, RunRequest(source="embedded", device="cpu", max_new_tokens=4))
    assert thread_window.last_error == ""
    assert thread_window.badges["model"].text() == RANDOM_WEIGHTS_LABEL
    notes = [m for m in shown if m.startswith("note: the trained weights")]
    # The load's last line, then the run's note event, say it (the same line).
    assert 1 <= len(notes) <= 2 and all("is missing" in n and "random weights" in n for n in notes), shown
    # ... and it is an event of the run: in the events table (and so in a recording).
    rows = [r for r in thread_window.events_table.rows if "trained weights" in r.detail]
    assert len(rows) == 1 and "is missing" in rows[0].detail

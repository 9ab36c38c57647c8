"""The models already on the machine (kvscope.core.model.installed): the Hugging Face cache, Ollama, LM Studio and added
folders, built in a temporary home; then the window's Source list and the calculator's model picker."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import huggingface_hub.constants
import pytest
from huggingface_hub import scan_cache_dir
from PySide6.QtCore import Qt

from kvscope.core.model import installed
from kvscope.core.model.installed import InstalledModel, find_installed
from kvscope.core.model.request import RunRequest
from kvscope.core.model.spec import SpecError

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "float32"}
GGUF = b"GGUF\x03\x00\x00\x00"  # listed, never parsed: any bytes after the magic will do
REV_OLD, REV_NEW = "a" * 40, "b" * 40


# ------------------------------------------------------------------------------------------------
# Building a machine


def hf_repo(cache: Path, folder: str, revisions: dict[str, dict[str, bytes]], main: str, mtimes=None) -> Path:
    """A repo as huggingface_hub stores it: blobs by content hash, snapshots/<rev>/<file> symlinks to them,
    refs/main naming a revision."""
    repo = cache / folder
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(main)
    for rev, files in revisions.items():
        for name, data in files.items():
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            if mtimes and rev in mtimes:
                os.utime(blob, (mtimes[rev], mtimes[rev]))
            link = repo / "snapshots" / rev / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    return repo


def ollama_blob(store: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def ollama_manifest(store: Path, name: str, layers: list[tuple[str, str]] | bytes) -> None:
    """manifests/<registry>/<namespace>/<model>/<tag> (``name`` is that path)."""
    path = store / "manifests" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(layers, bytes):
        path.write_bytes(layers)
        return
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64},
           "layers": [{"mediaType": media, "digest": digest, "size": 1} for media, digest in layers]}
    path.write_text(json.dumps(doc))


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A home with every kind of store, some of it broken. Returns the folders and the added folder."""
    tmp_path = tmp_path.resolve()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    hf_home = home / ".cache" / "huggingface"
    cache = hf_home / "hub"
    # huggingface_hub reads its environment once, at import: the constant is what it (and we) use.
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    store = tmp_path / "ollama-store"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))

    config = json.dumps(TINY_LLAMA).encode()
    hf_repo(cache, "models--HuggingFaceTB--SmolLM2-135M",
            {REV_OLD: {"config.json": config, "model.safetensors": b"old" * 10},
             REV_NEW: {"config.json": config + b" ", "model.safetensors": b"new" * 100, "tokenizer.json": b"{}"}},
            main=REV_NEW, mtimes={REV_OLD: 1_600_000_000, REV_NEW: 1_700_000_000})
    hf_repo(cache, "models--org--tokenizer-only", {REV_OLD: {"tokenizer.json": b"{}"}}, main=REV_OLD)
    hf_repo(cache, "datasets--org--data", {REV_OLD: {"config.json": config}}, main=REV_OLD)
    hf_repo(cache, "models--bartowski--Tiny-GGUF",
            {REV_OLD: {"Tiny-Q4_K_M.gguf": GGUF + b"q4" * 50, "mmproj-Tiny-f16.gguf": GGUF, "README.md": b"#"}},
            main=REV_OLD)
    # A model whose only config.json sits in a subfolder (a sentence-transformers module): not a model.
    hf_repo(cache, "models--org--pooling-only", {REV_OLD: {"1_Pooling/config.json": b'{"word_embedding_dimension": 8}'}},
            main=REV_OLD)

    model = ollama_blob(store, GGUF + b"m" * 1000)
    params = ollama_blob(store, json.dumps({"num_ctx": 8192, "stop": ["<|eot_id|>"]}).encode())
    bad_params = ollama_blob(store, b"{not json")
    other = ollama_blob(store, GGUF + b"o" * 500)
    M, P = installed.OLLAMA_MODEL, installed.OLLAMA_PARAMS
    ollama_manifest(store, "registry.ollama.ai/library/llama3.2/1b", [(M, model), (P, params)])
    ollama_manifest(store, "registry.ollama.ai/library/llama3.2/latest", [(M, model)])
    ollama_manifest(store, "registry.ollama.ai/someone/tuned/q4", [(M, other), (P, bad_params)])
    ollama_manifest(store, "hf.co/bartowski/SmolLM2-GGUF/Q8_0", [(M, other)])
    ollama_manifest(store, "registry.ollama.ai/library/broken/latest", b"{this is not json")
    ollama_manifest(store, "registry.ollama.ai/library/gone/latest", [(M, "sha256:" + "f" * 64)])
    ollama_manifest(store, "registry.ollama.ai/library/escape/latest", [(M, "sha256:../../../../etc/passwd")])
    ollama_manifest(store, "registry.ollama.ai/library/upper/latest", [(M, model.upper().replace("SHA256", "sha256"))])
    ollama_manifest(store, "registry.ollama.ai/library/no-layers/latest", b'{"layers": {"a": 1}}')
    # Valid JSON naming a real blob, but far larger than any manifest: not read.
    huge = json.dumps({"layers": [{"mediaType": M, "digest": model}]}) + " " * installed.MAX_MANIFEST_BYTES
    ollama_manifest(store, "registry.ollama.ai/library/huge/latest", huge.encode())
    os.mkfifo(store / "manifests" / "registry.ollama.ai" / "library" / "llama3.2" / "fifo")  # never opened

    lms = home / ".lmstudio" / "models"
    write(lms / "lmstudio-community" / "Qwen-GGUF" / "Qwen-Q4_K_M.gguf", GGUF + b"q" * 300)
    write(lms / "lmstudio-community" / "Qwen-GGUF" / "mmproj-Qwen-f16.gguf", GGUF)
    write(lms / "big" / "Big-GGUF" / "Big-Q4-00001-of-00002.gguf", GGUF + b"1" * 100)
    write(lms / "big" / "Big-GGUF" / "Big-Q4-00002-of-00002.gguf", GGUF + b"2" * 100)
    write(lms / "mlx-community" / "Tiny-4bit" / "config.json", json.dumps(TINY_LLAMA))
    write(lms / "mlx-community" / "Tiny-4bit" / "model.safetensors", b"w" * 64)
    write(home / ".cache" / "lm-studio" / "models" / "TheBloke" / "Old-GGUF" / "old.Q4_0.gguf", GGUF + b"x" * 10)

    added = tmp_path / "my-models"
    write(added / "org" / "tiny-llama" / "config.json", json.dumps(TINY_LLAMA))
    write(added / "org" / "tiny-llama" / "model.safetensors", b"w" * 200)
    write(added / "org" / "tiny-llama" / "1_Pooling" / "config.json", json.dumps(TINY_LLAMA))  # inside a model
    write(added / "notes" / "config.json", '{"theme": "dark"}')  # some app's config, not a model's
    write(added / "loose.gguf", GGUF + b"l" * 20)
    write(added / "a" / "b" / "c" / "d" / "e" / "too-deep.gguf", GGUF)
    write(added / ".trash" / "deleted.gguf", GGUF)
    os.mkfifo(added / "pipe.gguf")
    (added / "loop").symlink_to(added)  # a folder that contains itself
    return {"home": home, "cache": cache, "store": store, "lms": lms, "added": added}


def rows(models: list[InstalledModel], m) -> list[tuple]:
    """The models with paths shortened to the fixture's names, for exact comparisons."""
    names = {str(m["cache"]): "HF", str(m["store"]): "OLLAMA", str(m["lms"]): "LMS", str(m["added"]): "ADDED",
             str(m["home"]): "HOME"}
    out = []
    for x in models:
        source = x.source
        for path, name in names.items():
            source = source.replace(path, name)
        out.append((x.label, source, x.kind, x.origin, x.size_bytes, x.num_ctx))
    return out


SMOL_SIZE = len(json.dumps(TINY_LLAMA)) + 1 + 300 + 2
EXPECTED = [
    ("bartowski/Tiny-GGUF/Tiny-Q4_K_M.gguf", f"HF/models--bartowski--Tiny-GGUF/snapshots/{REV_OLD}/Tiny-Q4_K_M.gguf",
     "gguf", "hf-cache", 108, None),
    ("HuggingFaceTB/SmolLM2-135M", f"HF/models--HuggingFaceTB--SmolLM2-135M/snapshots/{REV_NEW}", "hf", "hf-cache",
     SMOL_SIZE, None),
    ("hf.co/bartowski/SmolLM2-GGUF:Q8_0", "OLLAMA/blobs/sha256-", "gguf", "ollama", 508, None),
    ("llama3.2:1b", "OLLAMA/blobs/sha256-", "gguf", "ollama", 1008, 8192),
    ("llama3.2:latest", "OLLAMA/blobs/sha256-", "gguf", "ollama", 1008, None),
    ("someone/tuned:q4", "OLLAMA/blobs/sha256-", "gguf", "ollama", 508, None),
    ("Big-Q4-00001-of-00002.gguf", "LMS/big/Big-GGUF/Big-Q4-00001-of-00002.gguf", "gguf", "lm-studio", 216, None),
    ("old.Q4_0.gguf", "HOME/.cache/lm-studio/models/TheBloke/Old-GGUF/old.Q4_0.gguf", "gguf", "lm-studio", 18, None),
    ("Qwen-Q4_K_M.gguf", "LMS/lmstudio-community/Qwen-GGUF/Qwen-Q4_K_M.gguf", "gguf", "lm-studio", 308, None),
    ("Tiny-4bit", "LMS/mlx-community/Tiny-4bit", "mlx", "lm-studio", len(json.dumps(TINY_LLAMA)) + 64, None),  # runs in MLX
    ("loose.gguf", "ADDED/loose.gguf", "gguf", "folder", 28, None),
    ("org/tiny-llama", "ADDED/org/tiny-llama", "hf", "folder", len(json.dumps(TINY_LLAMA)) + 200, None),
]


def shortened(found):
    """Ollama blob names are content hashes: compared by prefix (the blob itself is checked elsewhere)."""
    return [r[:1] + (r[1][:len("OLLAMA/blobs/sha256-")] if r[1].startswith("OLLAMA/") else r[1],) + r[2:]
            for r in found]


# ------------------------------------------------------------------------------------------------
# kvscope.core.model.installed


def test_the_hf_cache_layout_is_huggingface_hubs_own(machine):
    info = scan_cache_dir(machine["cache"])
    assert not info.warnings
    assert sorted(r.repo_id for r in info.repos) == ["HuggingFaceTB/SmolLM2-135M", "bartowski/Tiny-GGUF", "org/data",
                                                    "org/pooling-only", "org/tokenizer-only"]


def test_every_store_is_listed_exactly(machine):
    found = find_installed(extra_folders=[str(machine["added"]), str(machine["added"] / "no-such-folder")])
    assert shortened(rows(found, machine)) == EXPECTED
    by_label = {m.label: m for m in found}
    store = machine["store"]
    blob = Path(by_label["llama3.2:1b"].source)
    assert blob.parent == store / "blobs" and blob.read_bytes().startswith(GGUF)
    assert by_label["llama3.2:latest"].source == by_label["llama3.2:1b"].source  # two tags, one blob
    assert by_label["someone/tuned:q4"].source == by_label["hf.co/bartowski/SmolLM2-GGUF:Q8_0"].source
    assert by_label["llama3.2:1b"].describe() == "llama3.2:1b \u00b7 Ollama \u00b7 1008 B \u00b7 num_ctx 8,192"
    assert (Path(by_label["HuggingFaceTB/SmolLM2-135M"].source) / "config.json").is_file()


def test_the_default_ollama_store_is_in_the_home_folder(machine, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS")
    assert not [m for m in find_installed() if m.origin == "ollama"]
    default = machine["home"] / ".ollama" / "models"
    default.parent.mkdir()
    machine["store"].rename(default)
    assert [m.label for m in find_installed() if m.origin == "ollama"] == [
        "hf.co/bartowski/SmolLM2-GGUF:Q8_0", "llama3.2:1b", "llama3.2:latest", "someone/tuned:q4"]
    other = machine["home"].parent / "elsewhere"
    (other / ".ollama").mkdir(parents=True)
    default.rename(other / ".ollama" / "models")
    assert len([m for m in find_installed(home=other) if m.origin == "ollama"]) == 4  # home= is honoured


def test_an_added_folder_that_is_a_store_already_is_listed_once(machine):
    found = find_installed(extra_folders=[machine["lms"], machine["added"] / "org" / "tiny-llama"])
    labels = [(m.label, m.origin) for m in found if m.origin in ("lm-studio", "folder")]
    assert labels == [("Big-Q4-00001-of-00002.gguf", "lm-studio"), ("old.Q4_0.gguf", "lm-studio"),
                      ("Qwen-Q4_K_M.gguf", "lm-studio"), ("Tiny-4bit", "lm-studio"), ("tiny-llama", "folder")]


def test_nothing_installed_is_an_empty_list(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "no-cache"))
    assert find_installed() == []
    assert find_installed(extra_folders=["", "~nosuchuser/x", tmp_path / "missing", "\0bad"]) == []


def test_a_broken_cache_and_unreadable_entries_never_raise(machine, monkeypatch):
    cache = machine["cache"]
    # A dangling snapshot link: huggingface_hub reports the repo as corrupt; the others are still listed.
    (cache / "models--org--dangling" / "snapshots" / REV_OLD).mkdir(parents=True)
    (cache / "models--org--dangling" / "snapshots" / REV_OLD / "config.json").symlink_to("../../blobs/nothing")
    write(cache / "not-a-repo", b"")
    write(machine["store"] / "manifests" / "registry.ollama.ai" / "stray-file", b"")
    found = find_installed()
    assert "HuggingFaceTB/SmolLM2-135M" in [m.label for m in found]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(machine["store"] / "blobs" / "x"))  # a file's child
    assert [m.origin for m in find_installed()][:1] == ["ollama"]

    def boom(*_a, **_k):
        raise RuntimeError("a bug in one source")

    monkeypatch.setattr(installed, "_ollama", boom)
    assert "ollama" not in {m.origin for m in find_installed()} and find_installed()  # the rest still comes


def test_walks_are_bounded(machine, monkeypatch):
    monkeypatch.setattr(installed, "MAX_ENTRIES", 3)
    found = [m for m in find_installed(extra_folders=[machine["added"]]) if m.origin == "folder"]
    assert len(found) <= 3
    monkeypatch.setattr(installed, "MAX_MODELS", 2)
    assert len(find_installed()) == 2


def test_origins_limit_the_look(machine):
    found = find_installed(extra_folders=[machine["added"]], origins=("ollama", "folder"))
    assert {m.origin for m in found} == {"ollama", "folder"}
    assert [m.label for m in found if m.origin == "folder"] == ["loose.gguf", "org/tiny-llama"]


@pytest.mark.parametrize("params, num_ctx", [
    ({"num_ctx": 4096}, 4096), ({"num_ctx": 4096.0}, 4096), ({"num_ctx": True}, None), ({"num_ctx": -1}, None),
    ({"num_ctx": "4096"}, None), ({"num_ctx": 1.5}, None), ([4096], None), ({"temperature": 0.2}, None)])
def test_num_ctx_is_only_a_positive_whole_number(tmp_path, monkeypatch, params, num_ctx):
    store = tmp_path / "store"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    model = ollama_blob(store, GGUF)
    ollama_manifest(store, "registry.ollama.ai/library/m/t",
                    [(installed.OLLAMA_MODEL, model), (installed.OLLAMA_PARAMS, ollama_blob(store, json.dumps(params).encode()))])
    assert [(m.label, m.num_ctx) for m in find_installed(home=tmp_path, origins=("ollama",))] == [("m:t", num_ctx)]


# ------------------------------------------------------------------------------------------------
# The window's Source list and the calculator's model picker (real Qt, offscreen)


def scanned(qtbot, installed) -> None:
    qtbot.waitUntil(lambda: installed.scanned and not installed.busy, timeout=30_000)


def smol(m) -> str:
    return str(m["cache"] / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / REV_NEW)


def test_the_calculator_lists_installed_models_after_the_presets_and_loads_one(qtbot, machine, settings):
    from kvscope.core.model.spec import preset_names
    from kvscope.ui.calculator import CalculatorTab

    settings.setValue("model_folders", [str(machine["added"])])
    tab = CalculatorTab()
    qtbot.addWidget(tab)
    tab.restore_settings(settings)
    scanned(qtbot, tab.installed)
    combo = tab.model_combo
    presets = preset_names()
    n = len(presets)
    assert [combo.itemText(i) for i in range(n)] == list(presets)
    assert combo.itemText(n) == "" and combo.itemData(n) is None  # the separator
    listed = [(combo.itemText(i), combo.itemData(i)) for i in range(n + 1, combo.count())]
    assert listed == [(m.describe(), m.source) for m in find_installed(extra_folders=[machine["added"]])]
    assert ("llama3.2:1b \u00b7 Ollama \u00b7 1008 B \u00b7 num_ctx 8,192" in dict(listed))

    i = combo.findData(smol(machine))
    combo.setCurrentIndex(i)
    combo.activated.emit(i)  # what a click on the entry does
    qtbot.waitUntil(lambda: tab.spec is not None and tab.spec.num_layers == 2, timeout=60_000)
    assert tab.current_source() == smol(machine)
    assert combo.currentText() == "HuggingFaceTB/SmolLM2-135M \u00b7 Hugging Face cache \u00b7 " + installed_size(machine)
    tab.save_settings(settings)
    assert settings.value("calculator/model") == smol(machine)  # the path, not the entry's text
    tab.shutdown()


def installed_size(m) -> str:
    from kvscope.core.model.spec import human_bytes

    return human_bytes(SMOL_SIZE)


def test_a_typed_installed_name_loads_that_model(qtbot, machine, settings):
    from kvscope.ui.calculator import CalculatorTab

    settings.setValue("model_folders", [str(machine["added"])])
    tab = CalculatorTab()
    qtbot.addWidget(tab)
    tab.restore_settings(settings)
    scanned(qtbot, tab.installed)
    tab.model_combo.setEditText("org/tiny-llama")
    tab.load_model(tab.model_combo.currentText())  # what Enter does
    qtbot.waitUntil(lambda: tab.spec is not None and tab.spec.num_layers == 2, timeout=60_000)
    assert tab.current_source() == str(machine["added"] / "org" / "tiny-llama")
    tab.shutdown()


def test_the_source_list_offers_installed_models_and_an_added_folder(qtbot, machine, settings, tmp_path):
    from kvscope.ui.controls import SOURCES, saved_folders
    from kvscope.ui.main_window import MainWindow

    settings.setValue("model_folders", [str(machine["added"])])
    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    c = w.controls
    scanned(qtbot, c.installed)
    assert c.installed is w.calculator.installed  # one scan, both lists
    assert [c.source_combo.itemData(i) for i in range(c.source_combo.count())] == list(SOURCES)
    combo = c.installed_combo
    expected = find_installed(extra_folders=[machine["added"]])
    assert [(combo.itemText(i), combo.itemData(i)) for i in range(combo.count())] == [
        (m.describe(), m.source) for m in expected]

    c.source_combo.setCurrentIndex(SOURCES.index("installed"))
    assert c.source_stack.currentIndex() == SOURCES.index("installed") and not c.source_stack.isHidden()
    i = combo.findData(smol(machine))
    combo.setCurrentIndex(i)
    combo.activated.emit(i)
    assert w.build_request().source == smol(machine)  # the snapshot folder, as every model entry point takes it
    assert "Hugging Face cache" in combo.itemData(i, Qt.ItemDataRole.ToolTipRole)
    assert smol(machine) in combo.itemData(i, Qt.ItemDataRole.ToolTipRole)

    more = tmp_path / "more"
    write(more / "sub" / "new-Q8_0.gguf", GGUF + b"n" * 4)
    c.add_model_folder(str(more))  # what "Add folder..." does once the folder is chosen
    qtbot.waitUntil(lambda: combo.currentData() == str(more / "sub" / "new-Q8_0.gguf"), timeout=30_000)
    assert saved_folders(settings) == [str(machine["added"]), str(more)]
    assert w.calculator.model_combo.findData(str(more / "sub" / "new-Q8_0.gguf")) >= 0  # listed there too
    assert w.build_request().source == str(more / "sub" / "new-Q8_0.gguf")
    w.save_settings()
    w.shutdown()

    again = MainWindow(settings=settings, start_engine=False)  # remembered: the kind, the model, the folders
    qtbot.addWidget(again)
    assert again.controls.source_combo.currentData() == "installed"
    assert again.build_request().source == str(more / "sub" / "new-Q8_0.gguf")  # before the scan is back, too
    scanned(qtbot, again.controls.installed)
    assert again.controls.installed_combo.currentText() == "sub/new-Q8_0.gguf \u00b7 added folder \u00b7 12 B"
    again.apply_request(RunRequest(source=smol(machine)))
    assert again.controls.source_combo.currentData() == "installed"
    assert again.controls.installed_combo.currentData() == smol(machine)
    again.shutdown()


def test_with_nothing_installed_the_list_says_so(qtbot, settings):
    from kvscope.ui.main_window import MainWindow

    w = MainWindow(settings=settings, start_engine=False)  # the tests' own empty home (conftest)
    qtbot.addWidget(w)
    scanned(qtbot, w.controls.installed)
    combo = w.controls.installed_combo
    assert [combo.itemText(i) for i in range(combo.count())] == ["None found: add a folder"]
    w.controls.source_combo.setCurrentIndex(1)
    with pytest.raises(SpecError, match="pick an installed model"):
        w.controls.build_request()
    w.shutdown()


def test_an_ollama_model_loads_in_the_calculator_from_its_blob(qtbot, tmp_path, monkeypatch, settings):
    """An Ollama blob has no .gguf suffix: picking the model loads it all the same (kvscope.core.model.gguf reads the magic)."""
    from kvscope.ui.calculator import CalculatorTab
    from tests import gguf_models

    store = tmp_path / "store"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    built = gguf_models.llama(tmp_path / "tiny.gguf", n_layer=3)
    digest = ollama_blob(store, built.read_bytes())
    params = ollama_blob(store, json.dumps({"num_ctx": 2048}).encode())
    ollama_manifest(store, "registry.ollama.ai/library/tiny/latest",
                    [(installed.OLLAMA_MODEL, digest), (installed.OLLAMA_PARAMS, params)])
    tab = CalculatorTab()
    qtbot.addWidget(tab)
    tab.restore_settings(settings)
    scanned(qtbot, tab.installed)
    i = tab.model_combo.findText("tiny:latest", Qt.MatchFlag.MatchStartsWith)
    assert i > 0 and tab.model_combo.itemData(i).endswith("sha256-" + digest.split(":")[1])
    tab.model_combo.setCurrentIndex(i)
    tab.model_combo.activated.emit(i)
    qtbot.waitUntil(lambda: tab.spec is not None and tab.spec.num_layers == 3, timeout=60_000)
    assert (tab.spec.num_query_heads, tab.spec.num_kv_heads) == (4, 2)
    # A GGUF is what llama.cpp runs: the tab shows llama.cpp's allocation, at the Modelfile's num_ctx.
    assert tab.runtime == "llama.cpp" and tab.state.context == 2048
    assert tab.state.kv == 2048 * 3 * 2 * 64 * 2  # 2,048 cells x 3 layers x (K + V of 2 heads x 32) x 2 B
    tab.shutdown()


def test_an_installed_gguf_runs_with_llamacpp_and_ollamas_num_ctx(qtbot, tmp_path, monkeypatch, settings, capsys):
    """An Ollama model is a GGUF blob: the Source list's request runs it with llama.cpp, at the num_ctx its
    Modelfile sets (Max context, when set, wins), and llama.cpp runs the blob as it is (no .gguf suffix)."""
    from kvscope import main
    from kvscope.ui.controls import SOURCES
    from kvscope.ui.main_window import MainWindow
    from tests import gguf_models

    store = tmp_path / "store"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    digest = ollama_blob(store, gguf_models.llama(tmp_path / "tiny.gguf").read_bytes())
    params = ollama_blob(store, json.dumps({"num_ctx": 1024}).encode())
    ollama_manifest(store, "registry.ollama.ai/library/tiny/latest",
                    [(installed.OLLAMA_MODEL, digest), (installed.OLLAMA_PARAMS, params)])
    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    c = w.controls
    scanned(qtbot, c.installed)
    c.source_combo.setCurrentIndex(SOURCES.index("installed"))
    i = c.installed_combo.findText("tiny:latest", Qt.MatchFlag.MatchStartsWith)
    c.installed_combo.setCurrentIndex(i)
    c.max_context_spin.setValue(0)
    request = w.build_request()
    blob = c.installed_combo.itemData(i)
    assert (request.runtime, request.source, request.options_for("llama.cpp").n_ctx) == ("llama.cpp", blob, 1024)
    c.max_context_spin.setValue(2048)
    assert w.build_request().options_for("llama.cpp").n_ctx == 2048
    w.shutdown()
    pytest.importorskip("llama_cpp")
    assert main.main(["run", "--runtime", "llama.cpp", "--model", blob, "-c", "1024", "--tokens", "3"]) == 0
    assert "llama.cpp reserved 524,288 B at load" in capsys.readouterr().out  # 1,024 cells x 512 B, from the blob


def test_a_config_nested_absurdly_deep_hides_nothing_else(tmp_path):
    """An untrusted config.json nested 200,000 deep (json raises RecursionError) is no model, and the GGUF beside it
    is still listed (one bad file used to drop its whole origin)."""
    folder = tmp_path / "models"
    write(folder / "odd" / "config.json", b"[" * 200_000)
    write(folder / "tiny-Q8_0.gguf", GGUF + b"x" * 4)
    found = find_installed(home=tmp_path / "home", extra_folders=[folder], origins=("folder",))
    assert [m.source for m in found] == [str(folder / "tiny-Q8_0.gguf")]


# ------------------------------------------------------------------------------------------------
# Hostile stores and the window (issue 29, item 3; the seeded store fuzzer is tests/test_store_fuzz.py)

QUIT_SCRIPT = r"""
import os, sys, time
from PySide6.QtCore import QSettings, QTimer
from kvscope.ui.app import _application
from kvscope.ui.main_window import MainWindow

app = _application()
settings = QSettings(sys.argv[1], QSettings.Format.IniFormat)
settings.setValue("app/first_start_done", True)
w = MainWindow(settings=settings)
w.show()
wait_for_scan = sys.argv[2] == "scan"
start = time.monotonic()

def check():
    installed = w.controls.installed
    if not wait_for_scan or (installed is not None and installed.scanned) or time.monotonic() - start > 60:
        if installed is not None and installed.scanned:
            print("LISTED", "|".join(m.label for m in installed.models), flush=True)
            print("NOTES", "|".join(installed.notes), flush=True)
            print("TIP", w.controls.installed_combo.toolTip().replace("\n", "|"), flush=True)
        print("CLOSING", time.monotonic(), flush=True)
        w.close()
        return
    QTimer.singleShot(50, check)

QTimer.singleShot(0, check)
code = app.exec()
print("QUIT", time.monotonic(), flush=True)
sys.exit(code)
"""


def test_the_window_quits_with_a_fifo_in_the_hf_cache(tmp_path, when="scan"):
    """The real window (offscreen, KVSCOPE_ENGINE=thread) over a Hugging Face cache whose refs/main is a FIFO
    (huggingface_hub's scanner blocked on it for ever, and the window never exited): the scan lists the repo
    and its neighbour, a note says what was skipped, and the window quits in seconds, after the scan or while
    it is still under way."""
    import subprocess
    import sys
    import time

    home = tmp_path / "home"
    cache = home / ".cache" / "huggingface" / "hub"
    cfg = json.dumps(TINY_LLAMA).encode()
    hf_repo(cache, "models--org--good", {REV_OLD: {"config.json": cfg}}, main=REV_OLD)
    fifo_repo = hf_repo(cache, "models--org--fifo", {REV_OLD: {"config.json": cfg}}, main=REV_OLD)
    (fifo_repo / "refs" / "main").unlink()
    os.mkfifo(fifo_repo / "refs" / "main")
    (cache / "models--org--zero" / "refs").mkdir(parents=True)
    (cache / "models--org--zero" / "snapshots").mkdir()
    (cache / "models--org--zero" / "refs" / "main").symlink_to("/dev/zero")
    env = dict(os.environ, HOME=str(home), HF_HUB_CACHE=str(cache), KVSCOPE_ENGINE="thread", QT_QPA_PLATFORM="offscreen")
    env.pop("OLLAMA_MODELS", None)
    root = Path(__file__).resolve().parent.parent
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", QUIT_SCRIPT, str(tmp_path / "kvscope.ini"), when], cwd=root, env=env,
                          capture_output=True, text=True, timeout=180)
    took = time.monotonic() - started
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] if " " in line else "" for line in proc.stdout.splitlines()}
    assert proc.returncode == 0, proc.stderr[-2000:]
    closing, quit_at = float(lines["CLOSING"]), float(lines["QUIT"])
    assert quit_at - closing < 5, f"the window took {quit_at - closing:.1f} s to quit"
    if when == "scan":
        assert lines["LISTED"].split("|") == ["org/fifo", "org/good"]
        notes = lines["NOTES"].split("|")
        assert any("models--org--fifo/refs/main" in n and "FIFO" in n for n in notes), notes
        assert any("models--org--zero/refs/main" in n and "character device" in n for n in notes), notes
        assert "Skipped (2)" in lines["TIP"]
    print(f"window with a FIFO in the HF cache ({when}): quit {quit_at - closing:.2f} s after close, "
          f"{took:.1f} s in all")


def test_a_model_picked_runs_as_built_and_as_its_users_name_it(qtbot, machine, settings):
    """Issue 37, item 4: after a run that ended in MHA with a static cache and eager attention, picking another model
    puts its own attention, sdpa and a dynamic cache back (a 1-KV-head model ran as MHA, 4x its KV, unasked); an
    installed model's request carries its users' name (the repo id, the Ollama tag), not the snapshot hash or the
    blob's digest, and the run names it so in the model's info and its load event."""
    from kvscope.core.live.run import run_generation
    from kvscope.core.model.request import RunHooks, RunRequest
    from kvscope.ui.controls import SOURCES
    from kvscope.ui.main_window import MainWindow

    w = MainWindow(settings=settings, start_engine=False)
    qtbot.addWidget(w)
    c = w.controls
    scanned(qtbot, c.installed)
    for combo, key in ((c.attention_combo, "mha"), (c.impl_combo, "eager"), (c.cache_combo, "static")):
        assert c.select(combo, key)  # what the engine reported at the end of the last run
    c.source_combo.setCurrentIndex(SOURCES.index("installed"))
    combo = c.installed_combo
    i = combo.findData(smol(machine))
    combo.setCurrentIndex(i)
    combo.activated.emit(i)
    request = w.build_request()
    assert request.settings.attention is None and request.settings.cache.key == "dynamic"
    assert request.settings.attn_impl == "sdpa"
    assert request.label == "HuggingFaceTB/SmolLM2-135M" and REV_NEW in request.source
    c.select(c.attention_combo, "mqa")  # asked after picking: kept
    assert w.build_request().settings.attention.key == "mqa"
    tag = next(k for k in range(combo.count()) if combo.itemText(k).startswith("llama3.2:1b"))
    combo.setCurrentIndex(tag)
    combo.activated.emit(tag)
    gguf = w.build_request()
    assert gguf.label == "llama3.2:1b" and "sha256-" in gguf.source
    assert c.attention_combo.currentData() == ""  # another model: as built again
    c.source_combo.setCurrentIndex(SOURCES.index("embedded"))
    assert w.build_request().label is None
    w.shutdown()

    seen = []
    run_generation(RunRequest(source="embedded", device="cpu", max_new_tokens=1, label="someone/tiny-llama"),
                   RunHooks(emit=seen.append, loaded=lambda info: seen.append(info)))
    info = next(x for x in seen if not hasattr(x, "phase"))
    assert info.label == "someone/tiny-llama"
    assert any(getattr(x, "event", None) == "load" and "loaded someone/tiny-llama on" in x.text for x in seen)

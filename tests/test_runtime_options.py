"""A runtime brings everything a user touches through the registry (issue 36, item 1): ``tests/paged_runtime.py`` has
options, a flag, a calc answer and a Source list entry, and its addition is its own module and one registry line.

Checked through the real surfaces: ``main.main`` (run and calc: the flag, its range, the refusal of it under another
runtime), the real ControlsPanel (the entry, the request its form makes, shown back), the one run loop (the options
reach the runtime), and the tree: no file of main.py, ui/, workers/ or core/ names it, and the engine host applies no
other runtime's backend rule to its switches.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvscope.core import runtimes
from kvscope.core.live.run import run_generation
from kvscope.core.model.request import RunHooks, RunRequest
from tests import paged_runtime

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def paged():
    info = paged_runtime.register_paged()
    yield info
    runtimes.unregister(paged_runtime.NAME)


def test_its_flag_makes_its_options_and_they_reach_the_run(paged, tmp_path, capsys):
    from kvscope import main

    record = tmp_path / "paged.jsonl"
    assert main.main(["run", "--runtime", paged_runtime.NAME, paged_runtime.FLAG, "48", "--tokens", "20",
                      "--record", str(record)]) == 0
    capsys.readouterr()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    header, samples = lines[0], lines[1:]
    assert header["settings"]["runtime"] == paged_runtime.NAME and header["settings"]["page"] == 48
    reserved = {s["kv_bytes_reserved"] for s in samples if s.get("kv_bytes_reserved")}
    per_page = 48 * (samples[-1]["kv_bytes_held"] // samples[-1]["context_tokens"])
    assert reserved and all(r % per_page == 0 for r in reserved), (reserved, per_page)
    # Its range is the command line's rule, in the flag's words.
    assert main.main(["run", "--runtime", paged_runtime.NAME, paged_runtime.FLAG, "0"]) == 2
    assert f"{paged_runtime.FLAG} must be 1 to 4,096 (tokens per page)" in capsys.readouterr().err
    # Another runtime's run refuses it in one line (it was silently ignored).
    assert main.main(["run", "--runtime", "transformers", paged_runtime.FLAG, "48", "--tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{paged_runtime.FLAG} is --runtime {paged_runtime.NAME}'s flag" in err and len(err.splitlines()) == 1
    # calc takes the same flag and answers with the runtime's own figures.
    assert main.main(["calc", "--runtime", paged_runtime.NAME, paged_runtime.FLAG, "100", "--context", "150"]) == 0
    out = capsys.readouterr().out
    assert "150 tokens:" in out and "in pages of 100" in out


def test_its_options_default_and_are_keyed_by_runtime(paged):
    request = RunRequest(runtime=paged_runtime.NAME, options={paged_runtime.NAME: paged_runtime.PagedOptions(page=8)})
    assert runtimes.options_of(request).page == 8
    assert runtimes.options_of(RunRequest(runtime=paged_runtime.NAME)) == paged_runtime.PagedOptions()
    assert hash(request) == hash(RunRequest(runtime=paged_runtime.NAME, options=request.options))  # still a value
    samples: list = []
    run_generation(RunRequest(runtime=paged_runtime.NAME, max_new_tokens=5,
                              options={paged_runtime.NAME: paged_runtime.PagedOptions(page=8)}),
                   RunHooks(emit=samples.append))
    assert {s.cache for s in samples} == {"chunk:8"} and all(s.runtime == paged_runtime.NAME for s in samples)


def test_its_source_entry_makes_its_request_in_the_window(paged, qtbot, settings):
    from kvscope.ui.controls import ControlsPanel

    panel = ControlsPanel()
    qtbot.addWidget(panel)
    i = panel.source_combo.findData(paged_runtime.ENTRY)
    assert i >= 0 and panel.source_combo.itemText(i) == "Paged cache (tests)"
    assert panel.source_combo.model().item(i).isEnabled()
    panel.source_combo.setCurrentIndex(i)
    panel.max_context_spin.setValue(1024)
    panel.max_tokens_spin.setValue(7)
    request = panel.build_request()
    assert request.runtime == paged_runtime.NAME and request.max_new_tokens == 7
    assert request.options_for(paged_runtime.NAME) == paged_runtime.PagedOptions(page=16)
    panel.source_combo.setCurrentIndex(panel.source_combo.findData("embedded"))
    panel.apply_request(request)  # from the command line: its entry is chosen again
    assert panel.source_combo.currentData() == paged_runtime.ENTRY
    runtimes.unregister(paged_runtime.NAME)
    gone = ControlsPanel()
    qtbot.addWidget(gone)
    assert gone.source_combo.findData(paged_runtime.ENTRY) < 0  # its entry came from the registry only


def test_nothing_outside_its_module_names_it():
    """Its addition is its module and the registry line in it: main.py, ui/, workers/ and core/ never name the
    runtime, its flag or its entry (the built-in runtimes reach them the same way)."""
    words = re.compile("|".join(re.escape(w) for w in (paged_runtime.NAME, paged_runtime.FLAG, paged_runtime.ENTRY,
                                                       "page_tokens", "PagedOptions")))
    files = [ROOT / "main.py", *(p for d in ("ui", "workers", "core") for p in (ROOT / d).rglob("*.py"))]
    assert len(files) > 50
    named = [f"{p.relative_to(ROOT)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
             if words.search(line)]
    assert named == []
    own = (ROOT / "tests" / "paged_runtime.py").read_text()
    assert own.count("runtimes.register(") == 1


def test_the_engine_host_asks_each_runtime_what_a_switch_waits_for(paged):
    """transformers' quantized cache needs a backend built first; no other runtime's switch spelled the same waits
    for it (an MLX ``cache=quantized:4`` started building optimum-quanto's kernels)."""
    from kvscope.core.live.engine_process import RunDriver

    sent: list = []
    driver = RunDriver(RunRequest(runtime=paged_runtime.NAME), lambda kind, payload: sent.append((kind, payload)))
    assert driver._ready({"cache": ("cache", "quantized:4")}) == [("cache", "quantized:4")]
    assert runtimes.prepare_switch("mlx", "cache", "quantized:4") is None
    assert runtimes.prepare_switch(paged_runtime.NAME, "cache", "quantized:4") is None
    assert sent == []


def test_at_most_ten_lines_outside_the_runtimes_name_a_built_in_one():
    """Issue 36's measure (``grep -rniE "llama\\.?cpp|llamacpp|\\bmlx\\b"`` over main.py, ui/, workers/, core/live/ and
    the request): 124 lines before the registry carried options, flags, Source entries, requests and host hooks;
    what is left is user text (the credits, a server's name) and comments, at most 10 lines."""
    pattern = re.compile(r"llama\.?cpp|llamacpp|\bmlx\b", re.IGNORECASE)
    files = [ROOT / "main.py", ROOT / "core" / "model" / "request.py",
             *(p for d in ("ui", "workers", "core/live") for p in sorted((ROOT / d).rglob("*.py")))]
    named = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert len(named) <= 10, "\n".join(named)


def test_an_mlx_quantized_switch_in_the_engine_host_applies_without_quanto(monkeypatch):
    """The bug the issue names, end to end: a live ``cache=quantized:4`` in a real MLX run through the engine host's
    RunDriver reaches MLX at the next token (which answers for itself: the embedded model's head dim of 32 needs a
    group of 32), and ``quantized:4:32`` switches; transformers' backend preparation (optimum-quanto's kernels),
    which this spelling started before, never starts."""
    import threading
    import time

    from kvscope.core.live.engine_process import RunDriver
    from kvscope.core.runtimes.transformers import prepare

    why = runtimes.missing("mlx")
    if why:
        pytest.skip(why)
    monkeypatch.setattr(prepare, "_jobs", {})  # as in a fresh engine process: nothing prepared yet
    messages: list = []
    lock = threading.Lock()

    def send(kind, payload):
        with lock:
            messages.append((kind, payload))

    def samples():
        with lock:
            return [s for kind, batch in messages if kind == "samples" for s in batch]

    driver = RunDriver(RunRequest(runtime="mlx", max_new_tokens=40, device="cpu"), send)
    runner = threading.Thread(target=driver.run, name="test-mlx-run", daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while not any(s.phase == "decode" for s in samples()) and time.monotonic() < deadline:
        time.sleep(0.02)
    driver.command("switch", "cache", "quantized:4")
    while not any(s.event == "refused" for s in samples()) and time.monotonic() < deadline:
        time.sleep(0.02)
    driver.command("switch", "cache", "quantized:4:32")
    runner.join(120)
    assert not runner.is_alive()
    answers = [(s.event, s.switch_after, s.text) for s in samples() if s.event in ("switch", "refused")]
    assert [a[:2] for a in answers] == [("refused", "quantized:4"), ("switch", "quantized:4:32")], answers
    assert "group size" in answers[0][2] and "quanto" not in answers[0][2]
    with lock:
        progress = [p for kind, p in messages if kind == "progress"]
    assert prepare._jobs == {} and not any("preparing quantized cache" in p for p in progress), progress


def test_a_runtime_entrys_file_is_kept_under_its_own_settings_key(qtbot, settings):
    """An entry with a file field saves it under its ``SourceEntry.saved_as`` (llama.cpp's: ``gguf``, the key the
    window used before the registry made the entry), so a user's chosen GGUF survives the change."""
    from kvscope.ui.controls import ControlsPanel

    (name, entry), = [(n, e) for n, e in runtimes.source_entries() if e.file_field]
    settings.setValue("run/source_kind", entry.key)
    settings.setValue(f"run/{entry.saved_as}", "/models/old.gguf")
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.restore(settings)
    assert panel.source_combo.currentData() == entry.key and entry.saved_as == "gguf"
    assert panel.source.file_edit(entry.key).text() == "/models/old.gguf"
    panel.source.file_edit(entry.key).setText("/models/new.gguf")
    panel.save(settings)
    assert settings.value(f"run/{entry.saved_as}") == "/models/new.gguf"
    assert panel.build_request().source == "/models/new.gguf" and panel.build_request().runtime == name

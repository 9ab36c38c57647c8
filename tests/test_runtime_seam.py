"""The Runtime seam (issue 26 item 2): a runtime is one module and one registry entry.

The proof is ``tests/tiny_runtime.py``, a pure-Python runtime whose fake cache allocates in chunks: registered
here through ``kvscope.core.runtimes.register`` (no other file names it), it runs through ``run`` on the command line
(the terminal's table, a scripted switch and a refused one, a recording), the window (offscreen, a screenshot),
and the recording replays. Plus: the registry's answers, the one loop's refusals as one kind of event, and
the KV figures held/reserved filled by every runtime, old recordings mapped.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import re
import textwrap
import typing
from typing import Any

import pytest

from kvscope.core import runtimes
from kvscope.core.base.sample import sample_from_json
from kvscope.core.live.run import run_generation
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.request import RunHooks, RunRequest
from kvscope.core.records.recording import RecordingReader
from kvscope.core.runtimes import parse_switch
from tests import tiny_runtime
from tests.helpers import run_in_window


@pytest.fixture
def tiny():
    info = tiny_runtime.register_tiny()
    yield info
    runtimes.unregister(tiny_runtime.NAME)


def _run(request: RunRequest, switches: list | None = None) -> list:
    samples: list = []
    pending = list(switches or [])
    run_generation(request, RunHooks(emit=samples.append, poll=lambda: [pending.pop(0)] if pending else []))
    return samples


def test_the_registry_names_and_decides(tiny):
    assert {"transformers", "llama.cpp", tiny_runtime.NAME} <= set(runtimes.names())
    assert runtimes.get(None).name == runtimes.DEFAULT == "transformers"
    assert runtimes.runtime_for_source("/models/x.gguf") == "llama.cpp"  # llama.cpp's entry claims a GGUF
    assert runtimes.runtime_for_source("embedded") == "transformers"
    with pytest.raises(SettingsError, match="unknown runtime 'nope'"):
        runtimes.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        runtimes.register(runtimes.RuntimeInfo(name=tiny_runtime.NAME, open=lambda r, p: None))
    # Each runtime checks its own switch keys, before a run (the command line, the window).
    assert parse_switch("4:cache=chunk:32", tiny_runtime.NAME) == (4, "cache", "chunk:32")
    with pytest.raises(SettingsError, match="chunk:N"):
        parse_switch("4:cache=dynamic", tiny_runtime.NAME)
    with pytest.raises(SettingsError, match="unknown llama.cpp cache type"):
        parse_switch("4:cache-type=q3_x", "llama.cpp")
    assert runtimes.reloads_cache("llama.cpp") and not runtimes.reloads_cache("transformers")
    assert runtimes.find("a runtime of a newer build") is None and not runtimes.reloads_cache("unknown")


def test_the_tiny_runtime_runs_through_the_one_loop(tiny, tmp_path):
    record = tmp_path / "tiny.jsonl"
    request = RunRequest(runtime=tiny_runtime.NAME, max_new_tokens=40, record_path=str(record),
                         switches=((10, "cache", "chunk:64"), (12, "attention", "mqa"), (14, "cache", "chunk:64")))
    samples = _run(request, switches=[("cache", "chunk:bad")])
    events = [(s.event, s.switch_key) for s in samples if s.is_event]
    # A refused switch is one kind of answer whatever refused it (parse or the runtime); a no-op is a note.
    assert events == [("load", None), ("refused", "cache"), ("switch", "cache"), ("refused", "attention"),
                      ("note", "cache")]
    decodes = [s for s in samples if s.phase == "decode"]
    assert len(decodes) == 40 and all(s.runtime == tiny_runtime.NAME for s in samples)
    per_token = decodes[0].kv_bytes_held // decodes[0].context_tokens
    for s in decodes:  # held: the tokens; reserved: whole chunks (16, then 64 from token 10 on)
        chunk = 16 if s.token <= 10 else 64
        assert s.kv_bytes_held == s.context_tokens * per_token
        assert s.kv_bytes_reserved == math.ceil(s.context_tokens / chunk) * chunk * per_token >= s.kv_bytes_held
        assert s.kv_bytes_reserved == s.kv_bytes_predicted
    with RecordingReader(record) as reader:
        back, header = list(reader), reader.header
    assert back == samples and header["settings"]["runtime"] == tiny_runtime.NAME


def test_every_options_a_runtime_does_not_take_are_refused_before_it_opens(tiny):
    for request, flag in ((RunRequest(runtime=tiny_runtime.NAME, memory_budget=1 << 30), "--memory-budget"),
                          (RunRequest(runtime=tiny_runtime.NAME, quality_probe=True), "--quality-probe"),
                          (RunRequest(runtime=tiny_runtime.NAME, snapshot_path="x.pickle"), "--snapshot")):
        with pytest.raises(SettingsError, match=f"{flag}: not for a {tiny_runtime.NAME} run"):
            run_generation(request, RunHooks())


def test_the_cli_runs_the_tiny_runtime_and_it_replays(tiny, tmp_path, capsys, qtbot, settings):
    from kvscope import main

    record = tmp_path / "cli.jsonl"
    rc = main.main(["run", "--runtime", tiny_runtime.NAME, "--tokens", "30", "--switch", "8:cache=chunk:64",
                    "--switch", "9:attention=mqa", "--record", str(record)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "KV reserved" in out and "[switch]" in out and "[refused]" in out  # its entry: reserves ahead
    assert f"{tiny_runtime.NAME} reserved" in out and f"recorded to {record}" in out
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines[0]["settings"]["runtime"] == tiny_runtime.NAME and len(lines) == 1 + 1 + 1 + 30 + 2
    assert main.main(["run", "--runtime", tiny_runtime.NAME, "--switch", "1:cache=dynamic"]) == 2
    assert "chunk:N" in capsys.readouterr().err
    # Replay: the window plays the recording back through the same reader.
    from kvscope.ui.main_window import MainWindow

    window = MainWindow(settings=settings)
    qtbot.addWidget(window)
    window.show()
    with qtbot.waitSignal(window.run_finished, timeout=120_000):
        assert window.open_recording(str(record), speed=100.0)
    assert window.decode_tokens == 30 and window.last_error == ""
    window.shutdown()


def test_the_window_runs_the_tiny_runtime_and_draws_it(tiny, qtbot, thread_window, tmp_path):
    """In the window (generation on a thread of this process, where the test registered the runtime): its
    samples reach the plots as reserved and used curves, its switch marker is drawn, and the screenshot has
    pixels."""
    from kvscope.ui.screenshot import save_widget

    window = thread_window
    request = RunRequest(runtime=tiny_runtime.NAME, max_new_tokens=50, switches=((20, "cache", "chunk:64"),))
    run_in_window(qtbot, window, request)
    assert window.last_error == ""
    window._redraw()
    _, reserved = window.plots.curve_data("kv_reserved")
    _, used = window.plots.curve_data("kv_used")
    assert window.plots.curve_visible("kv_reserved") and len(reserved) and max(reserved) > max(used) > 0
    assert window.session.info.runtime == tiny_runtime.NAME
    png = save_widget(window, tmp_path / "tiny.png")
    assert png.stat().st_size > 10_000


def test_old_recordings_map_to_held_and_reserved():
    """A transformers line of before the split (kv_bytes_observed only) is held == reserved; a llama.cpp line
    (observed + used) is reserved + held; held above reserved is a damaged line."""
    with RecordingReader("assets/demo/demo.jsonl") as reader:
        demo = [s for s in reader if s.phase == "decode"]
    assert demo and all(s.kv_bytes_held == s.kv_bytes_reserved is not None for s in demo)
    base = demo[0].to_dict()
    del base["kv_bytes_held"], base["kv_bytes_reserved"]
    old_llama = sample_from_json({**base, "kv_bytes_observed": 4096, "kv_bytes_used": 1024, "runtime": "llama.cpp"})
    assert (old_llama.kv_bytes_reserved, old_llama.kv_bytes_held) == (4096, 1024)
    for bad in ({"kv_bytes_held": 5, "kv_bytes_reserved": 4}, {"kv_bytes_observed": 4, "kv_bytes_used": 5},
                {"kv_bytes_used": -1}, {"kv_bytes_held": "4096"}, {"kv_bytes_reserved": True}):
        with pytest.raises(ValueError):
            sample_from_json({**base, **bad})


# ------------------------------------------------------------------------------------------------ every entry resolves

#: A hook field's string: ``"package.module:attribute[.attribute]"`` (``kvscope.core.runtimes.base.resolve``).
_HOOK_STRING = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_ABSENT = object()


def _hook_fields(info: runtimes.RuntimeInfo) -> dict[str, Any]:
    """The entry's fields that name something to import (a "module:attribute" string) or are callables."""
    values = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    return {name: value for name, value in values.items()
            if (isinstance(value, str) and _HOOK_STRING.fullmatch(value)) or callable(value)}


def _assigned_attributes(cls: type) -> set[str]:
    """Every ``self.X = ...`` (or ``self.X: T = ...``) in the class's own methods and those of its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def _protocol_problems(cls: type) -> list[str]:
    """Where ``cls`` falls short of ``runtimes.Runtime``: a method missing, one that cannot be called as the loop calls
    it (the protocol's parameters, by position and by name; its ``*args``/``**kwargs``), a data member never set."""
    problems = []
    members = [n for n in vars(runtimes.Runtime) if not n.startswith("_")]
    for name in members:
        wanted = getattr(runtimes.Runtime, name)
        have = inspect.getattr_static(cls, name, _ABSENT)
        if have is _ABSENT:
            problems.append(f"{name}: missing")
            continue
        if not callable(wanted):
            continue
        if not callable(have):
            problems.append(f"{name}: not a method")
            continue
        theirs = inspect.signature(getattr(cls, name))
        ours = [p for p in inspect.signature(wanted).parameters.values() if p.name != "self"]
        positional = [p for p in ours if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keyword = {p.name: None for p in ours if p.kind is p.KEYWORD_ONLY}
        calls = {"by position": ((None, *[None] * len(positional)), keyword),
                 "by name": ((None,), {**keyword, **{p.name: None for p in positional}})}
        for how, (args, kwargs) in calls.items():
            try:
                theirs.bind(*args, **kwargs)
            except TypeError as exc:
                problems.append(f"{name}{theirs}: cannot be called {how} as {name}{inspect.signature(wanted)} ({exc})")
        for kind, spelled in ((inspect.Parameter.VAR_POSITIONAL, "*args"), (inspect.Parameter.VAR_KEYWORD, "**kwargs")):
            if any(p.kind is kind for p in ours) and not any(p.kind is kind for p in theirs.parameters.values()):
                problems.append(f"{name}{theirs}: takes no {spelled}, as {name}{inspect.signature(wanted)} does")
    assigned = _assigned_attributes(cls)
    for attr in vars(runtimes.Runtime).get("__annotations__", {}):  # data members: name, spec, generated
        if attr not in assigned and inspect.getattr_static(cls, attr, _ABSENT) is _ABSENT:
            problems.append(f"{attr}: never set (no class attribute, property or self.{attr} = ...)")
    return problems


def _entry_problems(info: runtimes.RuntimeInfo) -> list[str]:
    """Each hook string of the entry that does not import and resolve (to a callable, except the calculator's rules),
    and where the class its ``open`` returns (its annotation) falls short of the protocol."""
    problems = []
    hooks = _hook_fields(info)
    if "open" not in hooks:
        return [f"{info.name}.open: {info.open!r} names nothing to import"]
    for field_name in hooks:
        try:
            target = info.hook(field_name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{info.name}.{field_name} = {getattr(info, field_name)!r}: {type(exc).__name__}: {exc}")
            continue
        if target is None or (field_name != "calculator" and not callable(target)):
            problems.append(f"{info.name}.{field_name} = {getattr(info, field_name)!r}: resolves to {target!r}")
    try:
        made = typing.get_type_hints(info.hook("open")).get("return")
    except (ImportError, AttributeError, NameError):
        return problems  # said above (or an annotation naming what its module cannot see)
    if not isinstance(made, type):
        return problems + [f"{info.name}.open: say the Runtime class it returns (-> SomeRuntime), got {made!r}"]
    return problems + [f"{info.name} ({made.__qualname__}).{problem}" for problem in _protocol_problems(made)]


def test_every_registered_runtime_meets_the_protocol_and_every_hook_resolves(tiny):
    """``Runtime`` is ``runtime_checkable`` and the registry holds its hooks as strings imported only when used: an
    entry whose string names a moved function, or a runtime that lost a method or renamed a parameter, failed only
    when a run reached it. Every entry (the built-in ones and the test's): each hook string imports and resolves to
    something (a callable, except the calculator's rules), and the class ``open`` returns (its annotation) has every
    method of the protocol, callable as the loop calls it, and its data members."""
    assert {"transformers", "llama.cpp", "mlx", tiny_runtime.NAME} <= set(runtimes.names())
    problems = [problem for name in runtimes.names() for problem in _entry_problems(runtimes.get(name))]
    assert problems == [], "\n".join(problems)
    # The check can fail: a hook naming a function that moved, a module that is not there, a class without a
    # method or whose apply takes other arguments.
    broken = runtimes.RuntimeInfo(name="broken", open="kvscope.core.runtimes.transformers.runtime:open_runtime",
                                  parse_switch="kvscope.core.model.settings:no_such_function",
                                  missing="kvscope.core.runtimes.no_such_module:missing")
    said = _entry_problems(broken)
    assert len(said) == 2 and "no_such_function" in said[0] and "No module named" in said[1], said

    class Short:
        name = "short"
        spec = None
        generated = 0

        def apply(self, key: str) -> None: ...
    said = _protocol_problems(Short)
    assert "load: missing" in said and any(p.startswith("apply(") and "cannot be called by position" in p for p in said)
    assert not any(p.startswith(("name", "spec", "generated")) for p in said)  # class attributes count as set

"""One error hierarchy (issue 26 item 3): every error class KV Scope defines derives from KVScopeError with a
category, and the command line and the engine process (the window's messages) decide by type, the same way.

The classes are found, not listed: every class in core/, ui/, workers/ and main.py that derives from an
exception. For each, and for an exception of none of ours, the CLI's exit status, stderr and the window's
one line are checked: a user's error is one line (exit 2, no traceback); an internal one shows its traceback
in both (exit 1).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from kvscope.core.base.errors import CATEGORIES, INTERNAL, KVScopeError, category_of, is_user_error, one_line

ROOT = Path(__file__).resolve().parent.parent


def _error_classes() -> list[type]:
    found = []
    paths = [*ROOT.glob("core/**/*.py"), *ROOT.glob("ui/**/*.py"), *ROOT.glob("workers/**/*.py"), ROOT / "main.py"]
    for path in sorted(paths):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.bases]
        if not names:
            continue
        module_name = ".".join(("kvscope", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        if any(part in module_name for part in ("mlx",)):  # a runtime whose package may need its own extra
            continue
        text = path.read_text(encoding="utf-8")
        if not any(word in text for word in ("Error", "Exception", "Exceeded", "Failed", "Crashed")):
            continue
        module = importlib.import_module(module_name)
        for name in names:
            cls = getattr(module, name, None)
            if (isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == module_name
                    and not name.startswith("_")):
                found.append(cls)
    return found


ERRORS = _error_classes()


def _instance(cls: type) -> BaseException:
    return cls("the reason, for the user\nand a second line")


def test_every_error_class_has_one_base_and_a_category():
    names = {cls.__name__ for cls in ERRORS}
    # The 15 of before plus the two the seam added; none may be missed by a rename.
    assert {"CliError", "OutputError", "SpecError", "SettingsError", "LoadError", "RecordingError", "GenerationError",
            "BudgetExceeded", "LlamaCppRunError", "MetricsError", "ScrapeError", "ProbeError", "EmbeddedBuildError",
            "ScreenshotError", "SelfTestFailed", "RuntimeCrashed"} <= names, names
    for cls in ERRORS:
        assert issubclass(cls, KVScopeError), f"{cls.__module__}.{cls.__name__} does not derive from KVScopeError"
        assert cls.category in CATEGORIES, cls


@pytest.mark.parametrize("cls", [*ERRORS, ValueError, KeyError], ids=lambda c: c.__name__)
def test_the_cli_and_the_window_decide_by_type(cls, monkeypatch, capsys):
    from kvscope import main
    from kvscope.core.live import engine_process

    exc = _instance(cls)
    user = is_user_error(exc)
    assert user == (category_of(exc) != INTERNAL) == (isinstance(exc, KVScopeError) and cls.category != INTERNAL)
    # The command line.
    def fail(args):
        raise exc

    monkeypatch.setattr(main, "cmd_export", fail)
    monkeypatch.delenv("KVSCOPE_DEBUG", raising=False)
    rc = main.main(["export", "x.jsonl", "--csv", "-"])
    err = capsys.readouterr().err
    if user:
        assert rc == 2 and "Traceback" not in err and err.strip().startswith("kvscope: the reason, for the user")
    else:
        assert rc == 1 and "Traceback" in err and f"internal error: {cls.__name__}" in err
    # The engine process: what the window shows, and the traceback on its stderr for an internal error.
    sent = []
    monkeypatch.setattr("kvscope.core.live.run.run_generation", lambda request, hooks: (_ for _ in ()).throw(exc))
    engine_process.RunDriver(object(), lambda kind, payload: sent.append((kind, payload))).run()
    err = capsys.readouterr().err
    assert ("errored", one_line(exc)) in sent
    if user:
        assert one_line(exc) == str(exc).splitlines()[0] and one_line(exc).startswith("the reason, for the user")
        assert "Traceback" not in err
    else:
        assert one_line(exc).startswith(f"{cls.__name__}: ") and "Traceback" in err

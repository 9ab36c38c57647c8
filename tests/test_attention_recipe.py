"""Recipe 3 of docs/extending.md: a new attention mode is its class and one entry in ``ATTENTION_MODES``
(issue 36). ``tests/tiny_attention.py``'s ``half`` (half the model's own K/V heads) is added by that one line and
then answers everywhere a mode is named: the parser and its message, the command line's help and its empty-value
hint, calc's bytes, the window's Attention combo, and a live switch under transformers whose bytes stay exact;
no file of main.py, ui/, workers/ or core/ names it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvscope.core.model.attention import parse_attention
from kvscope.core.model.settings import SettingsError, attention_choices
from dataclasses import replace

from kvscope.core.model.sources import load_spec
from tests import tiny_attention

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def half():
    tiny_attention.register_half()
    yield tiny_attention.NAME
    tiny_attention.unregister_half()


def test_the_parser_help_and_messages_name_it(half, capsys):
    from kvscope import main

    assert parse_attention("half").key == "half" and parse_attention(" HALF ").key == "half"
    with pytest.raises(SettingsError, match=r"use mha, .*window:W or half$"):
        parse_attention("thirds")
    with pytest.raises(SettingsError, match="takes no argument"):
        parse_attention("half:2")
    parser = main.build_parser()
    calc = next(a for a in parser._subparsers._group_actions[0].choices["calc"]._actions
                if "--attention" in a.option_strings)
    assert calc.help.startswith("mha | gqa:N | mqa | mla | window:W | half"), calc.help
    assert main.main(["calc", "--attention", "", "--context", "1k"]) == 2
    assert "give mha, gqa:N, mqa, mla, window:W or half" in capsys.readouterr().err


def test_calc_and_the_window_offer_it_where_it_applies(half, capsys):
    from kvscope import main

    def kv(attention: str) -> int:
        assert main.main(["calc", "--model", "embedded", "--attention", attention, "--context", "1k", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["rows"][0]["kv_cache_bytes"]

    assert kv("half") * 2 == kv("mha") == 2 * kv("gqa:4")  # the embedded model: 8 K/V heads, half is 4
    assert "half" in attention_choices(load_spec("embedded"))
    assert "half" not in attention_choices(replace(load_spec("embedded"), num_kv_heads=1))  # nothing to halve
    assert main.main(["calc", "--model", "smollm2-135m", "--attention", "half", "--context", "1k"]) == 2
    assert "half needs an even number of K/V heads; SmolLM2-135M has 3" in capsys.readouterr().err


def test_a_live_switch_to_it_runs_and_its_bytes_are_exact(half, tmp_path, capsys):
    from kvscope import main

    record = tmp_path / "half.jsonl"
    assert main.main(["run", "--model", "embedded", "--tokens", "16", "--switch", "8:attention=half",
                      "--record", str(record)]) == 0
    capsys.readouterr()
    samples = [json.loads(line) for line in record.read_text().splitlines()[1:]]
    tokens = [s for s in samples if s.get("phase") == "decode"]
    assert {s["attention"] for s in tokens} == {"mha", "half"}, {s["attention"] for s in tokens}
    assert all(s["kv_bytes_held"] == s["kv_bytes_predicted"] for s in tokens) and len(tokens) == 16
    before = [s for s in tokens if s["attention"] == "mha"]
    after = [s for s in tokens if s["attention"] == "half"]
    per_token = lambda run: (run[-1]["kv_bytes_held"] - run[0]["kv_bytes_held"]) // (run[-1]["token"] - run[0]["token"])  # noqa: E731
    assert per_token(after) * 2 == per_token(before), (per_token(before), per_token(after))


def test_nothing_else_in_the_tree_names_it():
    named = [str(p.relative_to(ROOT)) for folder in ("ui", "workers", "core") for p in (ROOT / folder).rglob("*.py")
             if re.search(r"\bHalf\b|tiny_attention", p.read_text(encoding="utf-8"))]
    named += ["main.py"] if re.search(r"\bHalf\b|tiny_attention", (ROOT / "main.py").read_text()) else []
    assert not named, named

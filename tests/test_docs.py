"""The documentation holds: the map names every module, every link in README.md and docs/*.md resolves to a file
and heading that exist, the README stays a front door (short, a table of contents, the commands CI runs, the keys
ui/menus.py really binds, a link to every chapter), and every command-line flag is documented somewhere."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 400


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def all_docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in doc_files())


def test_docs_map_names_every_module():
    listed = subprocess.run(["git", "ls-files", "core", "ui", "workers"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    modules = {f for f in listed if f.endswith(".py") and (not f.endswith("__init__.py") or f.count("/") > 1)}
    modules |= set(str(p.relative_to(ROOT)) for d in ("core", "ui", "workers") for p in (ROOT / d).rglob("*.py")
                   if p.name != "__init__.py" and "__pycache__" not in p.parts)
    text = (ROOT / "docs" / "map.md").read_text(encoding="utf-8")
    missing = sorted(m for m in modules if f"`{m}`" not in text)
    assert not missing, f"docs/map.md does not name: {', '.join(missing)}"


# ------------------------------------------------------------------------------------------------ links

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks and indented code, inline code spans blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|", "!", "[")):
            continue
        yield number, re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (but - and _) dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower().replace("`", "")
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of ``path`` whose file, or whose #heading in that file, does not exist."""
    problems = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                problems.append(f"{where}: no heading #{anchor} in {dest.name}")
    return problems


def test_every_link_resolves():
    problems = [p for doc in doc_files() for p in broken_links(doc)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "b.md").write_text("# Where it is\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    (tmp_path / "a.md").write_text(
        "# A\n\nfine: [b](b.md), [b's heading](b.md#where-it-is), [the second](b.md#twice-1), [here](#a)\n"
        "broken: [gone](gone.md), [no heading](b.md#nowhere), [no anchor here](#b)\n"
        "```\n[in code](ignored.md)\n```\n`[inline](ignored.md)` ![picture](missing.png)\n", encoding="utf-8")
    found = broken_links(tmp_path / "a.md", root=tmp_path)
    assert [p.split(": ", 1)[1] for p in found] == [
        "gone.md: no such file", "b.md#nowhere: no heading #nowhere in b.md", "#b: no heading #b in a.md",
        "missing.png: no such file"], found


def test_slugs_are_githubs():
    assert slug("calc: what will this context cost me?") == "calc-what-will-this-context-cost-me"
    assert slug("What a cache costs in quality: `--quality-probe`") == "what-a-cache-costs-in-quality---quality-probe"
    assert slug("llama.cpp's whole allocation: KV, compute and output buffers") == \
        "llamacpps-whole-allocation-kv-compute-and-output-buffers"


# ------------------------------------------------------------------------------------------------ the README

def test_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; chapters belong in docs/"
    assert "## Contents" in text
    for command in ("make run", "make test"):
        assert command in text, command
    # The README's test command is what CI runs.
    assert re.search(r"^\s*make test\s*$", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M)
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    for command in ("calc", "run", "replay", "watch", "export"):
        assert f"python main.py {command}" in text, command


def test_readme_links_every_chapter():
    text = README.read_text(encoding="utf-8")
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"](docs/{p.name}" not in text]
    assert not unlinked, f"README.md links no chapter: {', '.join(unlinked)}"


def key_map() -> tuple[tuple[str, str], ...]:
    """``ui/menus.py``'s KEY_MAP, read without importing Qt."""
    tree = ast.parse((ROOT / "ui" / "menus.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "KEY_MAP" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("ui/menus.py has no KEY_MAP")


@pytest.mark.parametrize("doc", ["README.md", "docs/window.md"])
def test_the_keys_are_the_ones_the_window_binds(doc):
    """Each key of the Help > Keys list (the menus bind the same) is a row of the doc's keys table, and the table
    has no key the window does not bind."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    keys = dict(key_map())
    section = re.search(r"^#+ [^\n]*\bkeys\b[^\n]*\n(.*?)(?=^#)", text, re.M | re.S | re.I)
    assert section, f"{doc} has no section about the keys"
    rows = dict(re.findall(r"^\| (\S+) \| (.+?) \|$", section.group(1), re.M))
    table = {k: v for k, v in rows.items() if k not in ("key", "---") and not k.startswith("`")}
    assert set(table) == set(keys), (sorted(set(keys) - set(table)), sorted(set(table) - set(keys)))
    for key, what in keys.items():
        first = re.split(r"[:(]", what)[0].strip().lower()
        assert first in table[key].lower(), (key, what, table[key])


# ------------------------------------------------------------------------------------------------ the flags

def test_every_command_line_flag_is_documented():
    from kvscope import main

    text = all_docs_text()
    parser = main.build_parser()
    flags = sorted({option for p in main._parsers(parser) for action in p._actions for option in action.option_strings
                    if option.startswith("--") and option != "--help"})
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)]
    assert not missing, f"flags no README.md or docs/*.md mentions: {', '.join(missing)}"

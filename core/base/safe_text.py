"""Text from a file or a server, made safe to print: no control character reaches a terminal or a table raw.

A model's name in a GGUF header, a config's ``_name_or_path``, a server's model name in ``watch``, a path in a
model store: any of them can hold ESC sequences (set the terminal's title, clear the screen, move the cursor and
print a fake line), a carriage return that overwrites what came before, or Unicode's bidirectional overrides that
show text in another order than it is stored ("Trojan Source", CVE-2021-42574). ``safe_text`` shows each such
character as an escape (``\\x1b``, ``\\r``, ``\\u202e``) and leaves everything else as it is; ``safe_lines`` does
the same but keeps line breaks and tabs, for text that is meant to have several lines.

Used wherever KV Scope prints or shows something it did not write itself: ``calc``, ``run``'s terminal view,
``watch``, the error line of every command, the TUI and the window's events table.
"""

from __future__ import annotations

import re

__all__ = ["NAME_LIMIT", "safe_text", "safe_lines", "is_safe"]

# C0 controls (ESC, BEL, CR, LF, backspace...), DEL and the C1 controls (U+0080-U+009F: a terminal reads U+009B as
# CSI, the start of an escape sequence), the line and paragraph separators, the bidirectional marks, embeddings,
# overrides and isolates (U+061C, U+200E-U+200F, U+202A-U+202E, U+2066-U+2069), and lone surrogates (which would
# make printing itself fail with UnicodeEncodeError).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# The same, without line feed and tab.
_UNSAFE_KEEP_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                                "\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: The most characters of a model's name a table or a title line shows (a name of 60,000 characters is cut).
NAME_LIMIT = 200


def _escape(match: re.Match) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _clip(text: str, limit: int | None) -> str:
    if limit is not None and len(text) > limit:
        return text[: max(0, limit - 1)] + "…"
    return text


def safe_text(text: object, limit: int | None = None) -> str:
    """``text`` (anything: ``str()`` of it) as one printable line: every control character, line break, bidi
    override and lone surrogate shown as an escape (``\\x1b``, ``\\n``, ``\\u202e``). ``limit``: at most that many
    characters, the rest cut and marked with "…" (a name of 1 MB is not printed whole)."""
    text = text if isinstance(text, str) else str(text)
    if _UNSAFE.search(text):
        text = _UNSAFE.sub(_escape, text)
    return _clip(text, limit)


def safe_lines(text: object, limit: int | None = None) -> str:
    """As ``safe_text``, but line feeds and tabs stay (generated text, a multi-line note); a carriage return, ESC
    or any other control is still escaped."""
    text = text if isinstance(text, str) else str(text)
    if _UNSAFE_KEEP_LINES.search(text):
        text = _UNSAFE_KEEP_LINES.sub(_escape, text)
    return _clip(text, limit)


def is_safe(text: str) -> bool:
    """True when ``safe_text`` would leave ``text`` as it is (no character in it needs escaping)."""
    return _UNSAFE.search(text) is None

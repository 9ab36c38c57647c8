"""The streamed text: the prompt (dim), the generated tokens and switch markers, as they arrive.

Pieces wait in ``pending`` until the next frame's ``flush``; consecutive pieces of one kind go in as
one insertion, in paragraphs of at most TEXT_BLOCK_CHARS (see ``flush``). A theme change recolours
what is already there (``recolor``).
"""

from __future__ import annotations

from PySide6.QtGui import QColor, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QPlainTextEdit, QWidget

from kvscope.ui.theme import Theme

#: The longest paragraph the text view is given (characters); longer streams are cut into paragraphs.
TEXT_BLOCK_CHARS = 2048
#: Paragraphs kept (the oldest go first).
MAX_BLOCKS = 2000


def _insert_bounded(cursor: QTextCursor, text: str, fmt: QTextCharFormat, block_len: int) -> int:
    """Insert ``text`` at ``cursor`` (the end of the text view), starting a new paragraph whenever the
    current one (``block_len`` characters so far) would pass TEXT_BLOCK_CHARS: at the last space in
    reach if there is one near the limit, else at the limit. Returns the last paragraph's length."""
    pos = 0
    while pos < len(text):
        if block_len >= TEXT_BLOCK_CHARS:
            cursor.insertBlock()
            block_len = 0
        room = TEXT_BLOCK_CHARS - block_len
        piece = text[pos:pos + room]
        cut = len(piece) == room and pos + room < len(text) and "\n" not in piece
        if cut:
            space = piece.rfind(" ", room * 3 // 4)
            if space > 0:
                piece = piece[:space + 1]
        cursor.insertText(piece, fmt)
        newline = piece.rfind("\n")
        block_len = len(piece) - newline - 1 if newline >= 0 else block_len + len(piece)
        if cut:
            block_len = TEXT_BLOCK_CHARS  # this paragraph is full: the rest starts the next one
        pos += len(piece)
    return block_len


class StreamView(QPlainTextEdit):
    """Read-only text that grows at the end; ``pending`` holds (kind, text) until ``flush``."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setReadOnly(True)
        self.setToolTip("The prompt (dim) and the generated text as it streams. Markers show where a "
                        "switch took effect.")
        self.setMaximumBlockCount(MAX_BLOCKS)
        self.pending: list[tuple[str, str]] = []  # (kind: prompt | token | marker, text)

    def reset(self) -> None:
        self.clear()
        self.pending.clear()

    def recolor(self, old: Theme, new: Theme) -> None:
        """Text already streamed takes the new theme's colours (prompt, tokens, markers): light text
        from the dark theme would be unreadable on the light background."""
        mapping = {QColor(old.muted).rgb(): QColor(new.muted), QColor(old.text).rgb(): QColor(new.text),
                   QColor(old.curves["marker"]).rgb(): QColor(new.curves["marker"])}
        if all(QColor(c).rgb() == k for k, c in mapping.items()):
            return
        cursor = QTextCursor(self.document())
        block = self.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                colour = mapping.get(fragment.charFormat().foreground().color().rgb())
                if fragment.isValid() and colour is not None:
                    cursor.setPosition(fragment.position())
                    cursor.setPosition(fragment.position() + fragment.length(), QTextCursor.MoveMode.KeepAnchor)
                    f = QTextCharFormat()
                    f.setForeground(colour)
                    cursor.mergeCharFormat(f)
                it += 1
            block = block.next()

    def flush(self, t: Theme) -> None:
        """Insert the pending pieces in ``t``'s colours and scroll to the end."""
        if not self.pending:
            return
        cursor = self.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        formats = {}
        for kind, color, bold in (("prompt", t.muted, False), ("token", t.text, False),
                                  ("marker", t.curves["marker"], True)):
            f = QTextCharFormat()
            f.setForeground(QColor(color))
            if bold:
                f.setFontWeight(700)
            formats[kind] = f
        # Consecutive pieces of the same kind go in as one insertion, cut into paragraphs of at most
        # TEXT_BLOCK_CHARS: Qt lays out a whole paragraph on every insertion into it, and a stream of
        # tokens without newlines would otherwise grow one paragraph forever (quadratic: 200 KB without
        # a space took minutes). setMaximumBlockCount then bounds what is kept.
        block_len = cursor.block().length() - 1
        run_kind, run_text = None, []
        for kind, text in self.pending + [(None, "")]:
            if kind != run_kind and run_text:
                block_len = _insert_bounded(cursor, "".join(run_text), formats[run_kind], block_len)
                run_text = []
            run_kind = kind
            run_text.append(text)
        self.pending.clear()
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

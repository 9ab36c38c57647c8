"""The badge row over the plots: the model (elided to one line), attention, kernel and cache in force (the
attention's badge with the quality probe's running figure, "MQA · top-1 96%", while the probe runs), the run
state, a busy bar while loading and a lasting REC badge while a run records."""

from __future__ import annotations

import html

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFont, QFontMetrics
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QSizePolicy, QWidget

from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.base.sample import Sample

#: The narrowest a settings badge gets on a small screen (text px; its padding comes on top).
BADGE_FLOOR = 44
#: What the state badge says.
STATE_TEXT = {"idle": "idle", "loading": "\u25d0 loading", "running": "\u25cf running",
              "paused": "\u275a\u275a paused", "stopping": "stopping\u2026"}


def plain_tip(text: str) -> str:
    """A tooltip shown as the text it is: Qt renders a tooltip that looks like HTML as HTML (a model named
    "<img src=...>" would load an image), so such text is escaped into HTML that shows it literally."""
    if "<" not in text:
        return text
    return "<p style='white-space:pre-wrap'>" + html.escape(text) + "</p>"


class ElidedLabel(QLabel):
    """One line of text, cut with an ellipsis where it does not fit; ``text()`` stays the whole text."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._full = ""
        self.setTextFormat(Qt.TextFormat.PlainText)  # a model's name comes from a file or a recording: never HTML
        # (A style sheet's padding and border are in the contents margins once it applies: contentsRect leaves
        # them out, and the indent QLabel adds for them is indent_px.)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 - Qt's name
        self._full = str(text)
        self._elide()

    def text(self) -> str:
        return self._full

    #: Shown after the text, never part of ``text()`` (the attention badge's quality figure: "top-1 96%").
    suffix = ""

    def shown_text(self) -> str:
        """What the badge says whole: its text, and its suffix after a dot."""
        return f"{self._full} \u00b7 {self.suffix}" if self.suffix else self._full

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._elide()

    def changeEvent(self, event) -> None:  # noqa: N802 - a new font (presenter mode, theme) re-elides
        super().changeEvent(event)
        self._elide()

    #: The width this label asks for whatever it says now (``BadgeRow.reserve``); it yields below it, elided.
    reserved = 0
    #: Never narrower than this where a width is reserved (a badge stays a badge: 'MQA', 'sta…').
    floor = 0

    def indent_px(self) -> int:
        """The indent QLabel puts before the text of its own accord: half an 'x' where the label has a frame
        width, which a style sheet's padding gives it (the status bar's labels: their last 4 px were cut)."""
        indent = self.indent()
        if indent < 0:
            indent = self.fontMetrics().horizontalAdvance("x") // 2 if self.frameWidth() > 0 else 0
        horizontal = self.alignment() & (Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignRight)
        return indent if horizontal else 0

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name: as wide as the whole text wants
        m = self.contentsMargins()
        hint = super().sizeHint()
        return QSize(max(self.fontMetrics().horizontalAdvance(self.shown_text()) + m.left() + m.right()
                         + self.indent_px() + 2,
                         self.minimumWidth(), self.reserved), max(hint.height(), self._line_height()))

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - never the text's width: it yields, elided
        return QSize(self.minimumWidth() or min(self.reserved, self.floor) or 24,
                     max(super().minimumSizeHint().height(), self._line_height()))

    def _line_height(self) -> int:
        """A line's height, whether the label shows its text or, where nothing fits, none (an empty QLabel is
        shorter: the badge row lost a pixel of height each time the model's name went)."""
        m = self.contentsMargins()
        line = self.fontMetrics().size(Qt.TextFlag.TextSingleLine, "X").height()
        return line + m.top() + m.bottom() + 2 * self.margin()

    #: Fewer characters than this left after eliding: show nothing rather than a stub ("em…").
    min_shown = 0

    def _elide(self) -> None:
        room = max(self.contentsRect().width() - self.indent_px(), 1)
        whole = self.shown_text()
        shown = self.fontMetrics().elidedText(whole, Qt.TextElideMode.ElideRight, room)
        if self.suffix and shown != whole and self.fontMetrics().horizontalAdvance(self._full) <= room:
            shown = self._full  # the setting whole before a cut figure (the tooltip has the figure)
        if shown != whole and len(shown) - 1 < self.min_shown:
            shown = ""
        if shown and self.fontMetrics().horizontalAdvance(shown) > room:
            shown = ""  # not even one character and the '…' (Qt leaves a one-character text as it is)
        if shown != super().text():
            super().setText(shown)
            self.setToolTip(plain_tip(whole) + (f"\n{self._tip}" if self.suffix else "") if shown != whole
                            else self._tip)

    _tip = ""

    def set_tip(self, tip: str) -> None:
        """The tooltip shown while the whole text fits (an elided text shows itself whole instead)."""
        self._tip = plain_tip(tip)
        self.setToolTip(self._tip)


def _extra(label: ElidedLabel) -> int:
    """What a badge's width adds to its text's (as its ``sizeHint`` counts): margins, padding, border."""
    m = label.contentsMargins()
    return m.left() + m.right() + label.indent_px() + 2


class RecBadge(ElidedLabel):
    """The REC badge: its whole text, or where the row is short only its dot (``compact``), so that it never
    takes the settings badges' room; ``text()`` and the tooltip keep the whole."""

    compact = False

    def _elide(self) -> None:
        shown = self._full[:1] if self.compact else self._full
        if shown != QLabel.text(self):
            QLabel.setText(self, shown)
            self.updateGeometry()

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name: what it shows
        return QLabel.sizeHint(self)

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        return QLabel.minimumSizeHint(self)


class BadgeRow(QWidget):
    """``badges[key]`` for model, attention, kernel, cache and state; ``loading_bar``; ``recording``."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.badges: dict[str, ElidedLabel] = {}
        self.names: list[QLabel] = []  # "attention", "kernel", "cache": shown where the row has room
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(10)
        for key, name, tip in (
            ("model", "", "The model generating"),
            ("attention", "attention", "Attention mode in force"),
            ("kernel", "kernel", "The attention kernel that actually ran (e.g. sdpa-math when flash is "
                                 "unavailable)"),
            ("cache", "cache", "Cache strategy in force"),
            ("state", "", "Run state"),
        ):
            box = QHBoxLayout()
            box.setSpacing(4)
            box.setContentsMargins(0, 0, 0, 0)
            if name:
                label = QLabel(name)
                label.setObjectName("badgeName")
                # Never part of the row's minimum: where the values need the room (1280x720, presenter
                # type), the names go (each badge's tooltip still says what it is).
                label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
                box.addWidget(label)
                self.names.append(label)
            # Every value yields width when the row is narrow (1280x720): cut with an ellipsis, whole in its
            # tooltip, never widening the window past the screen.
            # QLabel#badge's padding and border (#modelName's padding) are in its contents margins once the style
            # sheet is applied: counted there, not again (a pad of 22 px cut 'WINDOW:256' at 1024 px).
            value = ElidedLabel("\u2014")
            value.setObjectName("modelName" if key == "model" else "badge")
            if key == "model":
                # A long model name yields its width to the settings: one line, elided (the tooltip and
                # the window title have it whole), gone rather than a stub where the row is too narrow.
                value.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
                value.setMinimumWidth(0)
                value.min_shown = 6
            value.set_tip(tip)
            box.addWidget(value)
            self.badges[key] = value
            if key == "model":
                box.setStretch(box.count() - 1, 1)
            row.addLayout(box, 1 if key == "model" else 0)
        # Loading takes seconds (importing torch, the weights): a busy bar says so where people look.
        self.loading_bar = QProgressBar()
        self.loading_bar.setRange(0, 0)
        self.loading_bar.setTextVisible(False)
        self.loading_bar.setFixedSize(90, 10)
        self.loading_bar.setToolTip("Loading the model in the engine process")
        self.loading_bar.setVisible(False)
        row.addWidget(self.loading_bar, 0, Qt.AlignmentFlag.AlignVCenter)
        self.recording = RecBadge("\u25cf REC")
        self.recording.setObjectName("recording")
        self.recording.setVisible(False)
        row.addWidget(self.recording)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._fit_names()

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - the names never widen the window: they show where there is room
        hint = super().minimumSizeHint()
        names = sum(n.sizeHint().width() + 4 for n in self.names if n.isVisibleTo(self))
        return QSize(max(hint.width() - names, 0), hint.height())

    #: The type size of the badges as the theme has it (``reserve`` says it), and as shown (``_fit_type``).
    point_size = 0
    shown_pt = 0
    #: The smallest type a badge steps down to before its text is cut.
    FLOOR_PT = 8

    def _fit_type(self) -> None:
        """The settings and state badges whole where the row has room: the REC badge first shrinks to its dot
        (its tooltip says the rest), then the badges' type steps down a point at a time (presenter type on
        1024 px cut 'static' to '…'), down to ``FLOOR_PT``; below that they elide."""
        if not self.point_size:
            return
        layout = self.layout()
        keys = [k for k in self.badges if k != "model"]
        extras = self.loading_bar.width() + layout.spacing() if not self.loading_bar.isHidden() else 0
        room = self.width() - layout.spacing() * len(self.badges) - extras - 4
        # The model's name keeps a few letters' room (issue 37: in full-screen presenter mode at 1024 px it was gone,
        # and so was the window's title): the settings' type steps down first.
        model = self.badges.get("model")
        if model is not None and model.text() not in ("", "\u2014"):
            mm = QFontMetrics(model.font())
            room -= min(mm.horizontalAdvance(model.text()), mm.horizontalAdvance("M" * 7)) + _extra(model)

        def widths(pt: int, reserved: bool = True) -> dict[str, int]:
            font = QFont(self.badges[keys[0]].font())
            font.setPointSize(pt)
            font.setBold(True)
            metrics = QFontMetrics(font)
            # what each badge asks for at that size: its text, or the room reserved for its longest choice
            return {k: max(metrics.horizontalAdvance(self.badges[k].shown_text()) + _extra(self.badges[k]),
                           round(getattr(self.badges[k], "reserved_full", 0) * pt / self.point_size) if reserved else 0)
                    for k in keys}

        def need(pt: int) -> int:
            return sum(widths(pt).values())

        rec_on = not self.recording.isHidden()
        metrics = QFontMetrics(self.recording.font())
        compact = rec_on and need(self.point_size) + metrics.horizontalAdvance(self.recording.text()) + 24 > room
        if compact != self.recording.compact:
            self.recording.compact = compact
            self.recording._elide()
        if rec_on:
            room -= metrics.horizontalAdvance(self.recording.text()[:1] if compact else self.recording.text()) + 24
        # The room reserved for longer choices yields first (each badge keeps at least its text), then the type.
        pt = self.point_size
        while pt > self.FLOOR_PT and sum(widths(pt, reserved=False).values()) > room:
            pt -= 1
        if pt != self.shown_pt:
            self.shown_pt = pt
            for k in keys:
                self._restyle(k)
        # Where the reserved room does not fit, it is given up (each badge asks for its text alone): never a
        # minimum width here, which would feed back into the window's minimum and resize it again.
        short = need(pt) > room
        for k in keys:
            label = self.badges[k]
            want = 0 if short else getattr(label, "reserved_full", 0)
            scaled = round(want * (self.shown_pt or self.point_size) / max(self.point_size, 1))
            if label.reserved != scaled:
                label.reserved = scaled
                label.updateGeometry()

    def _restyle(self, key: str) -> None:
        """A badge's own style: its colour (the state's) and, where the row is short, a smaller type."""
        parts = [f"color: {self._colors[key]};"] if key in self._colors else []
        if self.shown_pt and self.shown_pt != self.point_size:
            parts.append(f"font-size: {self.shown_pt}pt;")
        label = self.badges[key]
        label.setStyleSheet(" ".join(parts))
        full = getattr(label, "reserved_full", label.reserved)
        label.reserved = round(full * (self.shown_pt or self.point_size) / max(self.point_size, 1))
        label.updateGeometry()

    _colors: dict[str, str] = {}

    def _fit_names(self) -> None:
        """Show the names only when the row can give every value its whole text and each name its own."""
        self._fit_type()
        layout = self.layout()
        values = sum(b.sizeHint().width() for k, b in self.badges.items() if k != "model")
        extras = sum(w.sizeHint().width() for w in (self.loading_bar, self.recording) if w.isVisible())
        names = sum(n.fontMetrics().horizontalAdvance(n.text()) + 6 for n in self.names)
        spacing = layout.spacing() * len(self.badges) + 4 * len(self.names)
        # 40: some room for a model name. Not before the row is on screen: its width is a guess until then, and
        # names shown at a guessed 1,003 px widened the window at its first show.
        show = self.isVisible() and values + extras + names + spacing + 40 <= self.width()
        for n in self.names:
            if n.isVisibleTo(self) != show:  # (isVisible: False while the window is hidden, so never hidden)
                n.setVisible(show)
            # Shown, a name has its text's width (Fixed: as its font is now, presenter type or not); hidden, none.
            # Ignored alone gave it no width at all: the names were never seen, even at 1920 px.
            horizontal = QSizePolicy.Policy.Fixed if show else QSizePolicy.Policy.Ignored
            if n.sizePolicy().horizontalPolicy() != horizontal:
                n.setSizePolicy(horizontal, QSizePolicy.Policy.Preferred)

    def reserve(self, key: str, texts, point_size: int, most: int = 130) -> None:
        """Keep ``badges[key]`` as wide as the widest of ``texts`` (what it can come to say) in bold type of
        ``point_size`` (the theme's badge type), padding included, at most ``most`` px, so that a switch to
        a longer setting ('quantized:hqq:4' after 'dynamic') does not shift the row mid-run. It is the width
        the badge asks for, not its minimum: on a small screen (1024x768, presenter type) the badges yield,
        elided with the whole text in the tooltip, down to ``BADGE_FLOOR`` px each, and the window fits."""
        font = QFont(self.badges[key].font())
        font.setPointSize(point_size)
        font.setBold(True)
        metrics = QFontMetrics(font)
        widest = max((metrics.horizontalAdvance(t) for t in texts), default=0)
        label = self.badges[key]
        label.setMinimumWidth(0)
        label.reserved = min(widest + _extra(label) + 2, most) if widest else 0
        label.reserved_full = label.reserved
        label.floor = BADGE_FLOOR + _extra(label)
        label.updateGeometry()
        if point_size != self.point_size:
            self.point_size, self.shown_pt = point_size, 0
            self._fit_names()

    def show_settings(self, s: Sample) -> None:
        self.badges["attention"].setText(s.attention.upper())
        self.badges["kernel"].setText(s.kernel or s.attn_impl)
        self.badges["cache"].setText(s.cache)
        self._fit_names()

    def show_quality(self, figure) -> None:
        """The quality probe's running figure on the attention badge ("MQA \u00b7 top-1 96%"): ``figure`` is a
        ``kvscope.ui.plots.quality.QualityFigure`` of the setting in force, or None (no probe: nothing shown)."""
        badge = self.badges["attention"]
        suffix = "" if figure is None else f"top-1 {figure.percent}%"
        tip = "Attention mode in force"
        if figure is not None:
            tip += (f"\nQuality probe, against the model as loaded, over the last {figure.tokens} tokens of this "
                    f"setting: the next token the same at {100 * figure.top1:.1f}%, KL {figure.kl:.3g} nats")
        if (suffix, tip) == (badge.suffix, badge._tip):
            return
        badge.suffix = suffix
        badge.set_tip(tip)
        badge._elide()
        badge.updateGeometry()
        self._fit_names()

    def show_state(self, state: str, color: str) -> None:
        self.badges["state"].setText(STATE_TEXT[state])
        self._colors = {**self._colors, "state": color}
        self._restyle("state")
        self.loading_bar.setVisible(state == "loading")
        self._fit_names()

    def show_model(self, info) -> None:
        name = safe_text(info.label, limit=NAME_LIMIT)  # from a file, a config or a recording: escaped
        self.badges["model"].setText(name)
        self.badges["model"].set_tip(f"{name}\nsource: {safe_text(info.source)}\n{info.spec.num_layers} layers, "
                                        f"{info.spec.num_query_heads} query / {info.spec.num_kv_heads} KV heads of "
                                        f"{info.spec.head_dim}, {info.dtype}")
        self._fit_names()  # the name's room is counted once there is a name

    def show_recording(self, recording: str | None, armed: str | None) -> None:
        """'● REC' while a live run records to ``recording``; '○ REC next run' while File › Record is armed."""
        self.recording.setVisible(bool(recording or armed))
        if recording:
            self.recording.setText("\u25cf REC")
            self.recording.setToolTip(f"recording this run to {recording}")
        elif armed:
            self.recording.setText("\u25cb REC next run")
            self.recording.setToolTip(f"the next run will be recorded to {armed}")
        self._fit_names()

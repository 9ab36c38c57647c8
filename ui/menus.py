"""The window's menus: File, Run (the speaker's keys as entries, so the menu shows which number is
which mode), View (themes, presenter mode, the sampler's rate) and Help (the key map, About)."""

from __future__ import annotations

from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMessageBox

from kvscope.core import __version__
from kvscope.core.model.spec import ASSETS

ATTENTION_KEYS = {1: "MHA", 2: "GQA", 3: "MQA", 4: "MLA", 5: "Sliding window"}
KEY_MAP = (("1", "MHA: every query head has its own K/V head"),
           ("2", "GQA: the middle group count the model allows"),
           ("3", "MQA: one K/V head, the model's own aligned and merged"),
           ("4", "MLA: a low-rank latent of the model's own K/V (half its bytes)"),
           ("5", "sliding window: the smallest offered (its plateau shows soonest)"),
           ("F", "flash attention on / off"), ("C", "next cache strategy"), ("Space", "pause / resume"),
           ("F11", "presenter mode (Esc leaves it)"), ("Ctrl+S", "screenshot to your Pictures folder"),
           ("Ctrl+O", "open a recording"), ("Ctrl+Q", "quit"), ("F1", "this list"))
SAMPLER_RATES = (5.0, 10.0, 20.0, 50.0, 100.0)


def _add(window: QMainWindow, menu, text: str, slot, shortcut=None, tip: str = "", checkable: bool = False,
         everywhere: bool = False, group: QActionGroup | None = None) -> QAction:
    """One menu entry. ``everywhere``: its key works wherever the focus is in the window."""
    action = QAction(text, window, checkable=checkable)
    if shortcut is not None:
        action.setShortcut(QKeySequence(shortcut))
    if tip:
        action.setToolTip(tip)
    action.triggered.connect(slot)
    if everywhere:
        window.addAction(action)
    if group is not None:
        group.addAction(action)
    menu.addAction(action)
    return action


def build_menus(self: QMainWindow) -> None:
    """The menu bar of ``self`` (the MainWindow): the actions' targets are its parts, ``self.files`` (the File
    menu's outputs: ``kvscope.ui.file_actions``) and ``self.run`` (runs and replays: ``kvscope.ui.run_control``), and its looks."""
    bar = self.menuBar()
    files, run = self.files, self.run
    file_menu = self.file_menu = bar.addMenu("&File")
    self.record_action = files.record_action = _add(
        self, file_menu, "Record the next run\u2026", files.record_triggered, checkable=True,
        tip="Write every sample of the next run to a .jsonl recording (flushed per sample)")
    _add(self, file_menu, "Open recording\u2026", lambda: run.open_recording(ask=True), QKeySequence.StandardKey.Open)
    _add(self, file_menu, "Play the demo recording", self.play_demo)
    file_menu.addSeparator()
    self.export_csv_action = _add(self, file_menu, "Export CSV\u2026", lambda: files.export_csv(ask=True))
    for fmt in ("PNG", "SVG"):
        _add(self, file_menu, f"Export plots as {fmt}\u2026",
             lambda _c=False, f=fmt.lower(): files.export_plots(fmt=f, ask=True))
    _add(self, file_menu, "Export summary image\u2026", lambda: files.export_summary(ask=True))
    file_menu.addSeparator()
    _add(self, file_menu, "Save screenshot", lambda: files.save_screenshot(), "Ctrl+S",
         tip="A PNG of the window in your Pictures folder (the status bar says where)")
    _add(self, file_menu, "Save screenshot as\u2026", lambda: files.save_screenshot(ask=True))
    file_menu.addSeparator()
    _add(self, file_menu, "Quit", self.close, QKeySequence.StandardKey.Quit)

    run_menu = bar.addMenu("&Run")
    _add(self, run_menu, "Start", lambda: run.start_run())
    _add(self, run_menu, "Pause / resume", run.toggle_pause, "Space", everywhere=True)
    _add(self, run_menu, "Stop", run.stop_run)
    run_menu.addSeparator()
    # The keys a speaker presses, as menu entries: the menu shows which number is which mode.
    for n, name in ATTENTION_KEYS.items():
        _add(self, run_menu, f"{name} attention", lambda _c=False, n=n: run.attention_key(n), str(n), everywhere=True)
    _add(self, run_menu, "Flash attention on / off", run.toggle_flash, "F", everywhere=True)
    _add(self, run_menu, "Next cache strategy", run.next_cache, "C", everywhere=True)

    view = bar.addMenu("&View")
    themes = QActionGroup(self)
    self.theme_actions = {name: _add(self, view, f"&{name.capitalize()} theme", lambda _c=False, n=name: self.set_theme(n),
                                     checkable=True, group=themes) for name in ("dark", "light")}
    view.addSeparator()
    self.presenter_action = _add(self, view, "Presenter mode", lambda checked: self.set_presenter(checked), "F11",
                                 checkable=True)
    view.addSeparator()
    rate_menu = view.addMenu("Memory sampling rate")
    rates = QActionGroup(self)
    self.rate_actions = {hz: _add(self, rate_menu, f"{hz:g} Hz", lambda _c=False, r=hz: self.set_sampler_rate(r),
                                  checkable=True, group=rates) for hz in SAMPLER_RATES}
    help_menu = bar.addMenu("&Help")
    _add(self, help_menu, "Keys\u2026", lambda: show_keys(self), "F1")
    _add(self, help_menu, "About KV Scope\u2026", lambda: show_about(self))


def show_keys(self: QMainWindow) -> None:
    rows = "".join(f"<tr><td><b>{k}</b></td><td>{what}</td></tr>" for k, what in KEY_MAP)
    QMessageBox.information(self, "KV Scope keys", f"<table cellspacing='6'>{rows}</table>")


#: The licence files, as the repository (and the desktop bundle, which mirrors it) has them.
LICENSE_FILE, NOTICES_FILE = "LICENSE", "packaging/THIRD_PARTY_NOTICES.txt"


def legal_file(name: str):
    """Path of LICENSE or the third-party notices: next to core/ (a checkout, the desktop bundle), else in
    kvscope's installed dist-info (a wheel's license-files); None when neither has it."""
    import importlib.metadata
    from pathlib import Path

    candidates = [ASSETS.parent / name]
    try:
        candidates += [Path(f.locate()) for f in importlib.metadata.distribution("kvscope").files or []
                       if f.name == Path(name).name]
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((path for path in candidates if path.is_file()), None)


def about_box(self: QMainWindow) -> QMessageBox:
    """Help > About: what KV Scope is, its licence, and buttons for the licence and the third-party notices."""
    box = QMessageBox(self)
    box.setWindowTitle("About KV Scope")
    box.setText(f"<b>KV Scope {__version__}</b><p>See the KV cache grow token by token, and predict "
                "what a context will cost before anything is loaded.</p><p>Bytes = 2 \u00d7 layers "
                "\u00d7 KV heads \u00d7 head_dim \u00d7 tokens \u00d7 batch \u00d7 bytes per "
                "element.</p><p>Memory in binary units: 1 GiB = 1,073,741,824 bytes.</p>"
                "<p>Free software under the MIT licence, Copyright \u00a9 2026 KV Scope developers. It uses Qt "
                "and Qt for Python (PySide6, LGPL-3.0), torch, transformers, llama.cpp, pyqtgraph and more, "
                "each under its own licence: see the third-party notices.</p>")
    box.license_button = box.addButton("Licence\u2026", QMessageBox.ButtonRole.ActionRole)
    box.notices_button = box.addButton("Third-party notices\u2026", QMessageBox.ButtonRole.ActionRole)
    box.addButton(QMessageBox.StandardButton.Close)
    for button, name in ((box.license_button, LICENSE_FILE), (box.notices_button, NOTICES_FILE)):
        button.setEnabled(legal_file(name) is not None)
    return box


def text_dialog(self: QMainWindow, title: str, name: str):
    """A read-only window with the text of ``legal_file(name)`` (or why it is missing)."""
    from PySide6.QtGui import QFontDatabase
    from PySide6.QtWidgets import QDialog, QDialogButtonBox, QPlainTextEdit, QVBoxLayout

    path = legal_file(name)
    dialog = QDialog(self)
    dialog.setWindowTitle(title)
    view = QPlainTextEdit(dialog)
    view.setReadOnly(True)
    view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
    view.setPlainText(path.read_text(encoding="utf-8", errors="replace") if path else f"{name} was not found")
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close, parent=dialog)
    buttons.rejected.connect(dialog.reject)
    layout = QVBoxLayout(dialog)
    layout.addWidget(view)
    layout.addWidget(buttons)
    dialog.resize(820, 600)
    dialog.view = view
    return dialog


def show_about(self: QMainWindow) -> None:
    box = about_box(self)
    box.exec()
    chosen = {box.license_button: ("KV Scope licence", LICENSE_FILE),
              box.notices_button: ("Third-party notices", NOTICES_FILE)}.get(box.clickedButton())
    if chosen is not None:
        text_dialog(self, *chosen).exec()


"""The window's menus: File, Run (the speaker's keys as entries, so the menu shows which number is
which mode), View (themes, presenter mode, the sampler's rate) and Help (the key map, About)."""

from __future__ import annotations

from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMessageBox

ATTENTION_KEYS = {1: "MHA", 2: "GQA", 3: "MQA", 4: "MLA", 5: "Sliding window"}
KEY_MAP = (("1", "MHA: every query head has its own K/V head"),
           ("2", "GQA: the middle group count the model allows"),
           ("3", "MQA: one K/V head"), ("4", "MLA: a compressed latent (re-runs the tokens so far)"),
           ("5", "sliding window: the smallest offered (its plateau shows soonest)"),
           ("F", "flash attention on / off"), ("C", "next cache strategy"), ("Space", "pause / resume"),
           ("F11", "presenter mode (Esc leaves it)"), ("Ctrl+S", "screenshot to your Pictures folder"),
           ("Ctrl+O", "open a recording"), ("Ctrl+Q", "quit"), ("F1", "this list"))
SAMPLER_RATES = (5.0, 10.0, 20.0, 50.0, 100.0)


def build_menus(self: QMainWindow) -> None:
    """The menu bar of ``self`` (the MainWindow: its slots are the actions' targets)."""
    bar = self.menuBar()
    file_menu = bar.addMenu("&File")
    self.record_action = QAction("Record the next run\u2026", self, checkable=True)
    self.record_action.setToolTip("Write every sample of the next run to a .jsonl recording (flushed per sample)")
    self.record_action.triggered.connect(self._record_triggered)
    file_menu.addAction(self.record_action)
    open_action = QAction("Open recording\u2026", self)
    open_action.setShortcut(QKeySequence.StandardKey.Open)
    open_action.triggered.connect(lambda: self.open_recording(ask=True))
    file_menu.addAction(open_action)
    demo_action = QAction("Play the demo recording", self)
    demo_action.triggered.connect(self.play_demo)
    file_menu.addAction(demo_action)
    file_menu.addSeparator()
    self.export_csv_action = QAction("Export CSV\u2026", self)
    self.export_csv_action.triggered.connect(lambda: self.export_csv(ask=True))
    file_menu.addAction(self.export_csv_action)
    for fmt in ("PNG", "SVG"):
        action = QAction(f"Export plots as {fmt}\u2026", self)
        action.triggered.connect(lambda _c=False, f=fmt.lower(): self.export_plots(fmt=f, ask=True))
        file_menu.addAction(action)
    summary = QAction("Export summary image\u2026", self)
    summary.triggered.connect(lambda: self.export_summary(ask=True))
    file_menu.addAction(summary)
    file_menu.addSeparator()
    shot = QAction("Save screenshot", self)
    shot.setShortcut(QKeySequence("Ctrl+S"))
    shot.setToolTip("A PNG of the window in your Pictures folder (the status bar says where)")
    shot.triggered.connect(lambda: self.save_screenshot())
    file_menu.addAction(shot)
    shot_as = QAction("Save screenshot as\u2026", self)
    shot_as.triggered.connect(lambda: self.save_screenshot(ask=True))
    file_menu.addAction(shot_as)
    file_menu.addSeparator()
    quit_action = QAction("Quit", self)
    quit_action.setShortcut(QKeySequence.StandardKey.Quit)
    quit_action.triggered.connect(self.close)
    file_menu.addAction(quit_action)
    self.file_menu = file_menu

    run_menu = bar.addMenu("&Run")
    for text, slot, shortcut in (("Start", self.start_run, None), ("Pause / resume", self.toggle_pause, "Space"),
                                 ("Stop", self.stop_run, None)):
        action = QAction(text, self)
        action.triggered.connect(slot)
        if shortcut:
            action.setShortcut(QKeySequence(shortcut))
            self.addAction(action)  # the key works wherever the focus is in the window
        run_menu.addAction(action)
    run_menu.addSeparator()
    # The keys a speaker presses, as menu entries: the menu shows which number is which mode.
    switch_keys = [(f"{name} attention", lambda _c=False, n=n: self.attention_key(n), str(n))
                   for n, name in ATTENTION_KEYS.items()]
    switch_keys += [("Flash attention on / off", self.toggle_flash, "F"), ("Next cache strategy", self.next_cache, "C")]
    for text, slot, shortcut in switch_keys:
        action = QAction(text, self)
        action.setShortcut(QKeySequence(shortcut))
        action.triggered.connect(slot)
        self.addAction(action)
        run_menu.addAction(action)

    view = bar.addMenu("&View")
    group = QActionGroup(self)
    self.theme_actions = {}
    for name in ("dark", "light"):
        action = QAction(f"{name.capitalize()} theme", self, checkable=True)
        action.triggered.connect(lambda _c=False, n=name: self.set_theme(n))
        group.addAction(action)
        view.addAction(action)
        self.theme_actions[name] = action
    view.addSeparator()
    self.presenter_action = QAction("Presenter mode", self, checkable=True)
    self.presenter_action.setShortcut(QKeySequence("F11"))
    self.presenter_action.triggered.connect(lambda checked: self.set_presenter(checked))
    view.addAction(self.presenter_action)
    view.addSeparator()
    rate_menu = view.addMenu("Memory sampling rate")
    rate_group = QActionGroup(self)
    self.rate_actions = {}
    for hz in SAMPLER_RATES:
        action = QAction(f"{hz:g} Hz", self, checkable=True)
        action.triggered.connect(lambda _c=False, r=hz: self.set_sampler_rate(r))
        rate_group.addAction(action)
        rate_menu.addAction(action)
        self.rate_actions[hz] = action
    help_menu = bar.addMenu("&Help")
    keys = QAction("Keys\u2026", self)
    keys.setShortcut(QKeySequence("F1"))
    keys.triggered.connect(lambda: show_keys(self))
    help_menu.addAction(keys)
    about = QAction("About KV Scope\u2026", self)
    about.triggered.connect(lambda: show_about(self))
    help_menu.addAction(about)


def show_keys(self: QMainWindow) -> None:
    rows = "".join(f"<tr><td><b>{k}</b></td><td>{what}</td></tr>" for k, what in KEY_MAP)
    QMessageBox.information(self, "KV Scope keys", f"<table cellspacing='6'>{rows}</table>")


def show_about(self: QMainWindow) -> None:
    from core import __version__

    QMessageBox.about(self, "About KV Scope",
                      f"<b>KV Scope {__version__}</b><p>See the KV cache grow token by token, and predict "
                      "what a context will cost before anything is loaded.</p><p>Bytes = 2 \u00d7 layers "
                      "\u00d7 KV heads \u00d7 head_dim \u00d7 tokens \u00d7 batch \u00d7 bytes per "
                      "element.</p><p>Memory in binary units: 1 GiB = 1,073,741,824 bytes.</p>")


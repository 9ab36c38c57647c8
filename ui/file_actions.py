"""The File menu's outputs: record the next run, the allocator snapshot's file, export CSV / plots / a summary
image, screenshots. A part of the window with its own state (the paths chosen, the recording being written); it
says what happened through ``status`` and ``error`` and never reaches into the window.

Every file written goes through ``kvscope.core.records.outputs`` (never the file being read, no silent overwrite); every dialog is
``ask_save_path``. Opening and replaying a recording is the run's business (``kvscope.ui.run_control``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QAbstractButton, QFileDialog, QWidget

from kvscope.core.records.export import export_csv
from kvscope.core.records.recording import RecordingError
from kvscope.ui.screenshot import ScreenshotError, default_path, save_widget
from kvscope.ui.summary import render_summary
from kvscope.ui.theme import theme as make_theme


def demo_recording_path() -> Path:
    """The demo recording shipped in assets/ (a checkout, a wheel's kvscope/assets, a PyInstaller bundle)."""
    from kvscope.core.model.spec import ASSETS

    return ASSETS / "demo" / "demo.jsonl"


def ask_save_path(parent: QWidget, title: str, default: str | Path, filter_: str) -> str | None:
    """A save dialog; the chosen path, or None when cancelled."""
    chosen, _ = QFileDialog.getSaveFileName(parent, title, str(default), filter_)
    return chosen or None


class FileActions(QObject):
    """The File menu's outputs. ``window``: the dialogs' parent and what a screenshot grabs; ``plots``, ``stats``
    and ``session``: what the exports read; ``redraw`` and ``refresh``: bring them up to date first."""

    status = Signal(str, int)  # a status-bar message and how long it stays (ms)
    error = Signal(str)
    recording_changed = Signal()  # the REC badge: the run being recorded, or the next one armed

    def __init__(self, window: QWidget, plots, stats, session, snapshot_button: QAbstractButton,
                 redraw: Callable[[], None], refresh: Callable[[], None], theme_name: Callable[[], str]) -> None:
        super().__init__(window)
        self.window, self.plots, self.stats, self.session = window, plots, stats, session
        self.snapshot_button = snapshot_button
        self.redraw, self.refresh, self.theme_name = redraw, refresh, theme_name
        self.record_action = None  # File > Record (the menus make it: ``kvscope.ui.menus``)
        self.record_path: str | None = None  # the next run is recorded here
        self.snapshot_path: str | None = None  # the next run's allocator snapshot (CUDA)
        self.last_recording: str | None = None  # what File > Export CSV exports
        self.recording_now: str | None = None  # the live run being recorded (the REC badge names it)
        snapshot_button.toggled.connect(self._snapshot_toggled)

    # ---- the next run

    def set_record_path(self, path: str | None) -> None:
        """Record the next run to ``path`` (.jsonl); None: do not record."""
        self.record_path = str(path) if path else None
        if self.record_action is not None:
            self.record_action.setChecked(bool(path))
        self.recording_changed.emit()
        if path:
            self.status.emit(f"the next run will be recorded to {path}", 5000)

    def armed(self) -> str | None:
        """Where the next run will be recorded (None: it will not be)."""
        return self.record_path if self.record_action is not None and self.record_action.isChecked() else None

    def record_triggered(self, checked: bool) -> None:
        """File > Record: ask where (unchecking disarms it)."""
        if not checked:
            self.set_record_path(None)
            return
        chosen = ask_save_path(self.window, "Record the next run to", self.record_path or
                               Path.home() / time.strftime("kvscope-%Y%m%d-%H%M%S.jsonl"), "KV Scope recordings (*.jsonl)")
        if not chosen:
            self.record_action.setChecked(False)
            return
        self.set_record_path(chosen if chosen.endswith(".jsonl") else chosen + ".jsonl")

    def _snapshot_toggled(self, checked: bool) -> None:
        if not checked:
            self.snapshot_path = None
            return
        if self.snapshot_path is None:
            chosen = ask_save_path(self.window, "Save the allocator snapshot to", Path.home() / time.strftime(
                "kvscope-snapshot-%Y%m%d-%H%M%S.pickle"), "Snapshot (*.pickle)")
            if not chosen:
                self.snapshot_button.setChecked(False)
                return
            self.snapshot_path = chosen
        self.status.emit(f"the next run records the CUDA allocator's history to {self.snapshot_path}", 5000)

    def apply_to(self, request):
        """``request`` with File > Record's path and the snapshot button's (a request that names its own wins)."""
        if self.armed() and not request.record_path:
            request = replace(request, record_path=self.record_path)
        if self.snapshot_path and self.snapshot_button.isChecked() and not request.snapshot_path:
            request = replace(request, snapshot_path=self.snapshot_path)
        return request

    def run_started(self, request) -> None:
        """A live run started: its recording is the one exported next, and each choice serves one run only."""
        if request.record_path:
            self.last_recording = request.record_path
            self.recording_now = request.record_path
            # One recording per choice: the next run must not overwrite (or fail on) this file.
            if self.record_action is not None:
                self.record_action.setChecked(False)
            self.record_path = None
        if request.snapshot_path:
            self.snapshot_button.setChecked(False)
        self.recording_changed.emit()

    def run_ended(self) -> None:
        self.recording_now = None
        self.recording_changed.emit()

    # ---- exports

    def export_csv(self, path: str | None = None, ask: bool = False) -> int | None:
        """The current/last recording's samples as CSV (kvscope.core.records.export). Returns the rows written."""
        if not self.last_recording:
            self.error.emit("nothing to export yet: record a run (File \u203a Record) or open a recording")
            return None
        if ask:
            path = ask_save_path(self.window, "Export CSV", Path(self.last_recording).with_suffix(".csv"), "CSV (*.csv)")
            if not path:
                return None
        try:
            rows = export_csv(self.last_recording, path)
        except (RecordingError, OSError) as exc:
            self.error.emit(str(exc))
            return None
        self.status.emit(f"wrote {rows:,} samples to {path}", 5000)
        return rows

    def export_plots(self, base: str | None = None, fmt: str = "png", ask: bool = False) -> list[Path]:
        """Each plot to its own file: ``<base>-kv.<fmt>``, ``-memory``, ``-compare`` (PNG or SVG), and ``-quality``,
        ``-frontier`` where the run had the quality probe."""
        fmt = fmt.lower()
        if ask:
            base = ask_save_path(self.window, f"Export plots as {fmt.upper()}", Path.home() / f"kvscope.{fmt}",
                                 f"{fmt.upper()} (*.{fmt})")
        if not base:
            return []
        stem = Path(base)
        if stem.suffix.lower() in (".png", ".svg"):
            stem = stem.with_suffix("")
        self.redraw()
        written = []
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
            for which in self.plots.exportable_now():  # the quality probe's plots where it ran
                target = stem.with_name(f"{stem.name}-{which}.{fmt}")
                self.plots.export_plot(which, str(target))
                written.append(target)
        except (OSError, RuntimeError, ValueError) as exc:
            self.error.emit(f"cannot export the plots: {exc}")
            return written
        self.status.emit(f"saved {', '.join(p.name for p in written)} in {stem.parent}", 5000)
        return written

    def export_summary(self, path: str | None = None, ask: bool = False) -> Path | None:
        """One 1920x1080 PNG for a slide: the three plots and the key numbers."""
        if ask:
            path = ask_save_path(self.window, "Export summary image", Path.home() / "kvscope-summary.png", "PNG (*.png)")
        if not path:
            return None
        self.redraw()
        self.refresh()
        session = self.session
        info = session.info
        title = info.label if info else "KV Scope"
        s = session.last_sample
        parts = []
        if info is not None:
            parts.append(f"{info.spec.num_layers} layers, {info.spec.num_query_heads} query / "
                         f"{info.spec.num_kv_heads} KV heads of {info.spec.head_dim}")
            parts.append(info.device_name)
        if s is not None:
            parts.append(f"now: {s.attention.upper()} \u00b7 {s.kernel or s.attn_impl} \u00b7 {s.cache} cache")
        tiles = self.stats.tiles
        numbers = [(tiles[k].name.text(), tiles[k].value.text(), tiles[k].note.text())
                   for k in ("kv_now", "bytes_per_token", "kv_at_max", "tokens_fit", "oom")]
        numbers.append(("Switches / spikes", f"{session.switch_events:,} / {session.spike_count:,}",
                        f"{session.decode_tokens:,} tokens generated"))
        try:
            saved = render_summary(path, make_theme(self.theme_name(), presenter=False), title, " \u00b7 ".join(parts),
                                   numbers, self.plots.summary_panels())
        except ScreenshotError as exc:
            self.error.emit(str(exc))
            return None
        self.status.emit(f"summary saved to {saved}", 5000)
        return saved

    def save_screenshot(self, path: str | None = None, ask: bool = False) -> Path | None:
        """Save the whole window as a PNG (Ctrl+S: to the Pictures folder). Returns the path."""
        if ask:
            path = ask_save_path(self.window, "Save screenshot", default_path(), "PNG (*.png)")
            if not path:
                return None
        try:
            saved = save_widget(self.window, path or default_path())
        except ScreenshotError as exc:
            self.error.emit(str(exc))
            return None
        self.status.emit(f"screenshot saved to {saved}", 5000)
        return saved

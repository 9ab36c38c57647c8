"""The File menu's actions: open and replay a recording (the demo too), record the next run, export CSV / plots / a summary image, screenshots,
the allocator snapshot's file. A mixin of ``MainWindow`` (it uses the window's plots, stats panel,
status bar and session), kept apart so the window's file reads as the window.

Every file written goes through ``core.outputs`` (never the file being read, no silent overwrite);
every dialog is ``ask_save_path``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QWidget

from core.export import export_csv
from core.recording import RecordingError
from ui.screenshot import ScreenshotError, default_path, save_widget
from ui.summary import render_summary
from ui.theme import theme as make_theme


def demo_recording_path() -> Path:
    """The demo recording shipped in assets/ (next to the sources, or inside a PyInstaller bundle)."""
    base = Path(getattr(sys, "_MEIPASS", Path(__file__).resolve().parent.parent))
    return base / "assets" / "demo" / "demo.jsonl"


def ask_save_path(parent: QWidget, title: str, default: str | Path, filter_: str) -> str | None:
    """A save dialog; the chosen path, or None when cancelled."""
    chosen, _ = QFileDialog.getSaveFileName(parent, title, str(default), filter_)
    return chosen or None


class FileActions:
    """File-menu actions of the window (see the module docstring)."""

    record_path: str | None = None  # the next run is recorded here (File > Record)
    snapshot_path: str | None = None  # the next run's allocator snapshot (CUDA)
    last_recording: str | None = None  # what File > Export CSV exports

    def set_record_path(self, path: str | None) -> None:
        """Record the next run to ``path`` (.jsonl); None: do not record."""
        self.record_path = str(path) if path else None
        self.record_action.setChecked(bool(path))
        self.show_recording_badge()
        if path:
            self.statusBar().showMessage(f"the next run will be recorded to {path}", 5000)

    def _record_triggered(self, checked: bool) -> None:
        if not checked:
            self.set_record_path(None)
            return
        chosen = ask_save_path(self, "Record the next run to", self.record_path or
                               Path.home() / time.strftime("kvscope-%Y%m%d-%H%M%S.jsonl"), "KV Scope recordings (*.jsonl)")
        if not chosen:
            self.record_action.setChecked(False)
            return
        self.set_record_path(chosen if chosen.endswith(".jsonl") else chosen + ".jsonl")

    def export_csv(self, path: str | None = None, ask: bool = False) -> int | None:
        """The current/last recording's samples as CSV (core.export). Returns the rows written."""
        if not self.last_recording:
            self._show_error("nothing to export yet: record a run (File \u203a Record) or open a recording")
            return None
        if ask:
            path = ask_save_path(self, "Export CSV", Path(self.last_recording).with_suffix(".csv"), "CSV (*.csv)")
            if not path:
                return None
        try:
            rows = export_csv(self.last_recording, path)
        except (RecordingError, OSError) as exc:
            self._show_error(str(exc))
            return None
        self.statusBar().showMessage(f"wrote {rows:,} samples to {path}", 5000)
        return rows

    def export_plots(self, base: str | None = None, fmt: str = "png", ask: bool = False) -> list[Path]:
        """Each plot to its own file: ``<base>-kv.<fmt>``, ``-memory``, ``-compare`` (PNG or SVG)."""
        fmt = fmt.lower()
        if ask:
            base = ask_save_path(self, f"Export plots as {fmt.upper()}", Path.home() / f"kvscope.{fmt}",
                                 f"{fmt.upper()} (*.{fmt})")
        if not base:
            return []
        stem = Path(base)
        if stem.suffix.lower() in (".png", ".svg"):
            stem = stem.with_suffix("")
        self._redraw()
        written = []
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
            for which in self.plots.EXPORTABLE:
                target = stem.with_name(f"{stem.name}-{which}.{fmt}")
                self.plots.export_plot(which, str(target))
                written.append(target)
        except (OSError, RuntimeError, ValueError) as exc:
            self._show_error(f"cannot export the plots: {exc}")
            return written
        self.statusBar().showMessage(f"saved {', '.join(p.name for p in written)} in {stem.parent}", 5000)
        return written

    def export_summary(self, path: str | None = None, ask: bool = False) -> Path | None:
        """One 1920x1080 PNG for a slide: the three plots and the key numbers."""
        if ask:
            path = ask_save_path(self, "Export summary image", Path.home() / "kvscope-summary.png", "PNG (*.png)")
        if not path:
            return None
        self._redraw()
        self.refresh_stats()
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
        tiles = self.stats_panel.tiles
        numbers = [(tiles[k].name.text(), tiles[k].value.text(), tiles[k].note.text())
                   for k in ("kv_now", "bytes_per_token", "kv_at_max", "tokens_fit", "oom")]
        numbers.append(("Switches / spikes", f"{session.switch_events:,} / {session.spike_count:,}",
                        f"{session.decode_tokens:,} tokens generated"))
        try:
            saved = render_summary(path, make_theme(self.theme_name, presenter=False), title, " \u00b7 ".join(parts),
                                   numbers, [self.plots.kv_widget, self.plots.mem_widget, self.plots.cmp_widget])
        except ScreenshotError as exc:
            self._show_error(str(exc))
            return None
        self.statusBar().showMessage(f"summary saved to {saved}", 5000)
        return saved

    def save_screenshot(self, path: str | None = None, ask: bool = False) -> Path | None:
        """Save the whole window as a PNG (Ctrl+S: to the Pictures folder). Returns the path."""
        if ask:
            path = ask_save_path(self, "Save screenshot", default_path(), "PNG (*.png)")
            if not path:
                return None
        try:
            saved = save_widget(self, path or default_path())
        except ScreenshotError as exc:
            self._show_error(str(exc))
            return None
        self.statusBar().showMessage(f"screenshot saved to {saved}", 5000)
        return saved

    def _snapshot_toggled(self, checked: bool) -> None:
        if not checked:
            self.snapshot_path = None
            return
        if self.snapshot_path is None:
            chosen = ask_save_path(self, "Save the allocator snapshot to", Path.home() / time.strftime(
                "kvscope-snapshot-%Y%m%d-%H%M%S.pickle"), "Snapshot (*.pickle)")
            if not chosen:
                self.controls.snapshot_button.setChecked(False)
                return
            self.snapshot_path = chosen
        self.statusBar().showMessage(f"the next run records the CUDA allocator's history to {self.snapshot_path}",
                                     5000)

    # ---- recordings

    def open_recording(self, path: str | None = None, speed: float = 1.0, ask: bool = False) -> bool:
        """Play a recording through this window (plots, markers, text, stats) at ``speed`` x its pace."""
        if ask:
            chosen, _ = QFileDialog.getOpenFileName(self, "Open recording", str(Path.home()),
                                                    "KV Scope recordings (*.jsonl);;All files (*)")
            if not chosen:
                return False
            path = chosen
        if self.replay is None:
            self._show_error("replay is not available in this build")
            return False
        if self.state != "idle":
            self._show_error("stop the current run first (a recording replays into the same plots)")
            return False
        if not path:
            return False
        self.session.mode = "replay"
        self._replay_args = (str(path), float(speed))
        self.last_recording = str(path)
        if not self.calculator.warm:
            # Same reason as start_run: the stats use the predictor, which must not import
            # transformers while the calculator's thread does.
            self._start_after_warm_up()
            return True
        self._start_replay_now(str(path), float(speed))
        return True

    def _start_replay_now(self, path: str, speed: float) -> None:
        self.plots.drop_previous()  # a recording is not compared with the live run before it
        self._clear_view()
        self.controls.error_label.setText("")
        self.session.begin_replay()
        self._show_sampler_status()
        self.statusBar().showMessage(f"replaying {Path(path).name}" + (
            "" if speed == 1 else f" at {speed:g}x" if speed < float("inf") else " unpaced"))
        self.replay.start(path, speed)

    def play_demo(self) -> bool:
        """Replay the demo recording from assets/ (first start offers it)."""
        self.demo_banner.setVisible(False)
        path = demo_recording_path()
        if not path.is_file():
            self._show_error(f"the demo recording is missing ({path})")
            return False
        return self.open_recording(str(path))

    def _maybe_offer_demo(self) -> None:
        """First start only: a banner offering the demo (non-modal: screenshots and tests never wait on it)."""
        if self.qsettings.value("app/first_start_done", False, type=bool):
            return
        self.qsettings.setValue("app/first_start_done", True)
        self.qsettings.sync()
        if demo_recording_path().is_file():
            self.demo_banner.setVisible(True)

"""The window's entry points: what the menus, the app and the scripts call, each handed to the part that owns it.

Runs, replays, switches and keys go to the run's machinery (``kvscope.ui.run_control.RunControl``: ``self.run``), the
files a run leaves to the File menu's outputs (``kvscope.ui.file_actions.FileActions``: ``self.files``), the request
to the controls; the run's state is read from the session (``kvscope.core.live.session.Session``). ``WindowActions``
is mixed into ``kvscope.ui.main_window.MainWindow``, which builds those parts.
"""

from __future__ import annotations

from kvscope.ui.file_actions import demo_recording_path


class WindowActions:
    """The window's verbs and the session's state as the window's users (menus, the app, scripts, tests) ask them."""

    # ---- the session's state, read where the window's users look for it

    @property
    def state(self) -> str:
        return self.session.state

    @property
    def mode(self) -> str:
        return self.session.mode

    @property
    def last_error(self) -> str:
        return self.session.last_error

    @property
    def decode_tokens(self) -> int:
        return self.session.decode_tokens

    @property
    def info(self):
        return self.session.info

    # ---- the entry points: each is its part's

    def build_request(self):
        """The RunRequest the controls describe. Raises SpecError (SettingsError) with a user message."""
        return self.controls.build_request()

    def apply_request(self, request) -> None:
        """Show a RunRequest's choices in the controls (from the command line)."""
        self.controls.apply_request(request)

    def start_run(self, request=None) -> bool:
        """Start generating (``request`` or the controls' settings). False with a message if it cannot."""
        return self.run.start_run(request)

    def open_recording(self, path: str | None = None, speed: float = 1.0, ask: bool = False) -> bool:
        """Play a recording through this window at ``speed`` x its pace."""
        return self.run.open_recording(path, speed, ask)

    def play_demo(self) -> bool:
        """Replay the demo recording from assets/ (first start offers it)."""
        self.demo_banner.setVisible(False)
        path = demo_recording_path()
        if not path.is_file():
            self._show_error(f"the demo recording is missing ({path})")
            return False
        return self.run.open_recording(str(path))

    def stop_run(self) -> None:
        self.run.stop_run()

    def toggle_pause(self) -> None:
        self.run.toggle_pause()

    def request_switch(self, key: str, value: str) -> None:
        """Switch ``key`` (attention / attn-impl / cache) to ``value`` now, or set it for the next run."""
        self.run.request_switch(key, value)

    def attention_key(self, n: int) -> None:
        """Keys 1-5: mha, the middle GQA choice, mqa, mla, the smallest window."""
        self.run.attention_key(n)

    def set_record_path(self, path: str | None) -> None:
        self.files.set_record_path(path)

    def export_csv(self, path: str | None = None, ask: bool = False) -> int | None:
        return self.files.export_csv(path, ask)

    def export_plots(self, base: str | None = None, fmt: str = "png", ask: bool = False):
        return self.files.export_plots(base, fmt, ask)

    def export_summary(self, path: str | None = None, ask: bool = False):
        return self.files.export_summary(path, ask)

    def save_screenshot(self, path: str | None = None, ask: bool = False):
        return self.files.save_screenshot(path, ask)

    def set_sampler_rate(self, hz: float) -> None:
        self.sampling.set_rate(hz)
        if hz in getattr(self, "rate_actions", {}):
            self.rate_actions[hz].setChecked(True)

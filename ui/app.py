"""Entry points main.py calls: ``has_display()`` and ``run_window(request, screenshot, tokens)``."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

from ui.selftest import self_test  # noqa: F401 - main.py --self-test calls ui.app.self_test

#: How long a --screenshot run may take before it gives up (loading included).
SCREENSHOT_TIMEOUT_S = 600.0


def has_display() -> bool:
    """Whether a window can be shown: on Linux a DISPLAY/WAYLAND_DISPLAY, or Qt's offscreen platform."""
    if os.environ.get("QT_QPA_PLATFORM", "").startswith(("offscreen", "minimal", "vnc")):
        return True
    if sys.platform.startswith("linux") or "bsd" in sys.platform:
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True  # Windows and macOS always have a window system


def _application():
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    if app is None:
        app = QApplication(sys.argv[:1])
        app.setOrganizationName("KVScope")
        app.setApplicationName("KV Scope")
        app.setDesktopFileName("kvscope")  # matches packaging/kvscope.desktop, so docks group the window
        app.setWindowIcon(_app_icon())
    return app


def _app_icon():
    """The app icon at every size we ship (assets/icons/kvscope-N.png, made from kvscope.svg)."""
    from PySide6.QtGui import QIcon

    from core.spec import ASSETS

    icon = QIcon()
    for png in sorted((ASSETS / "icons").glob("kvscope-*.png")):
        icon.addFile(str(png))
    return icon


def _settle(app, window, rounds: int = 6) -> None:
    """Let layouts, the redraw timer's work and axis re-layouts finish before a grab."""
    for _ in range(rounds):
        window._redraw()
        app.processEvents()
        time.sleep(0.01)
    window.refresh_stats()
    app.processEvents()


def run_window(request=None, screenshot: str | None = None, tokens: int | None = None, *,
               presenter: bool = False, size: tuple[int, int] | None = None, settings=None) -> int:
    """Open the window. With ``request`` the run starts at once.

    With ``screenshot``: generate ``tokens`` tokens (default: the request's max_new_tokens) with the
    request's settings and scripted switches, let the plots redraw, save a PNG of the whole window
    to ``screenshot`` and return 0 (1 if the run failed; the PNG then shows the error).
    """
    app = _application()
    from PySide6.QtCore import QEventLoop, QSettings, QTimer

    from ui.main_window import MainWindow

    if screenshot is not None and settings is None:
        # A screenshot must not depend on (or change) the user's remembered window and settings.
        settings = _screenshot_settings()
    window = MainWindow(settings=settings)
    if screenshot is not None:
        window.resize(*(size or (1600, 1000)))
    elif size:
        window.resize(*size)
    if presenter:
        window.set_presenter(True, fullscreen=screenshot is None)
    window.show()

    if screenshot is None:
        if request is not None:
            window.apply_request(request)
            window.start_run(request)
        return app.exec()

    from core.generate import RunRequest

    request = request or RunRequest()
    if tokens is not None:
        request = replace(request, max_new_tokens=max(int(tokens), 1))
    window.apply_request(request)
    wanted_switches = sum(1 for at, _k, _v in request.switches if at < request.max_new_tokens)
    loop = QEventLoop()
    outcome = {"timeout": False}

    def check(_n: int = 0) -> None:
        if window.decode_tokens >= request.max_new_tokens and window.switch_events >= wanted_switches:
            loop.quit()

    window.samples_added.connect(check)
    window.run_finished.connect(loop.quit)
    timer = QTimer()
    timer.setSingleShot(True)
    timer.timeout.connect(lambda: (outcome.__setitem__("timeout", True), loop.quit()))
    timer.start(int(SCREENSHOT_TIMEOUT_S * 1000))
    if not window.start_run(request):
        code = 1
    else:
        loop.exec()
        code = 0
    timer.stop()
    return _finish_screenshot(app, window, screenshot, code, outcome["timeout"])


def _finish_screenshot(app, window, screenshot: str, code: int, timed_out: bool, extra=lambda: "") -> int:
    """Stop the window's work, draw everything, save the PNG and say so. Returns the exit status."""
    window.shutdown()
    # Drain the queued samples and the finished signal, then draw every curve and number.
    _settle(app, window)
    if timed_out:
        print(f"kvscope: gave up after {SCREENSHOT_TIMEOUT_S:.0f} s with {window.decode_tokens} tokens",
              file=sys.stderr)
        code = 2
    elif window.last_error:
        print(f"kvscope: {window.last_error}", file=sys.stderr)
        code = 1
    try:
        path = window.save_screenshot(screenshot)
    finally:
        window.close()
    if path is None:
        print(f"kvscope: could not save {screenshot}: {window.error_label.text()}", file=sys.stderr)
        return 1
    print(f"saved {path} ({window.decode_tokens} tokens, {window.switch_events} switches{extra()})")
    return code


def _screenshot_settings():
    """Throwaway settings for a --screenshot window: never the user's, and no first-start banner."""
    from PySide6.QtCore import QSettings

    settings = QSettings(os.path.join(_temp_dir(), f"kvscope-screenshot-{os.getpid()}.ini"), QSettings.Format.IniFormat)
    settings.clear()
    settings.setValue("app/first_start_done", True)
    return settings


def run_replay(path: str, speed: float = 1.0, screenshot: str | None = None, *, presenter: bool = False,
               size: tuple[int, int] | None = None, settings=None) -> int:
    """Play the recording at ``path`` in the window, ``speed`` times its recorded pace.

    Without ``screenshot`` the window stays open (returns the event loop's exit code). With it:
    play to the end, let the plots settle, save a PNG of the window and return 0. A file that is
    not a readable recording prints one line on stderr and returns 2 before any window opens; a
    recording with damaged or cut-off lines still plays what it can, says so in one line, and
    returns 1.
    """
    from core.recording import RecordingError, read_header

    if not speed or speed <= 0:
        print("kvscope: the replay speed must be positive", file=sys.stderr)
        return 2
    try:
        read_header(path)
    except (RecordingError, OSError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"kvscope: {message}", file=sys.stderr)
        return 2
    app = _application()
    from PySide6.QtCore import QEventLoop, QTimer

    from ui.main_window import MainWindow

    if screenshot is not None and settings is None:
        settings = _screenshot_settings()
    window = MainWindow(settings=settings)
    if screenshot is not None or size:
        window.resize(*(size or (1600, 1000)))
    if presenter:
        window.set_presenter(True, fullscreen=screenshot is None)
    window.show()
    if screenshot is None:
        window.open_recording(path, speed=speed)
        return app.exec()

    loop = QEventLoop()
    outcome = {"timeout": False}
    window.run_finished.connect(loop.quit)
    timer = QTimer()
    timer.setSingleShot(True)
    timer.timeout.connect(lambda: (outcome.__setitem__("timeout", True), loop.quit()))
    timer.start(int(SCREENSHOT_TIMEOUT_S * 1000))
    code = 0
    if not window.open_recording(path, speed=speed):
        code = 1
    else:
        loop.exec()
    timer.stop()
    return _finish_screenshot(app, window, screenshot, code, outcome["timeout"],
                              lambda: f", {window.spike_count} spikes")


def _temp_dir() -> str:
    import tempfile

    return tempfile.gettempdir()

"""Entry points main.py calls: ``has_display()`` and ``run_window(request, screenshot, tokens)``."""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from dataclasses import replace

from kvscope.core.model.request import RunRequest
from kvscope.core.model.spec import ASSETS
from kvscope.core.records.outputs import display_path
from kvscope.core.records.recording import RecordingError, read_header, spec_from_header
from kvscope.ui.selftest import self_test  # noqa: F401 - main.py --self-test calls kvscope.ui.app.self_test

#: How long a --screenshot run may take before it gives up (loading included).
SCREENSHOT_TIMEOUT_S = 600.0
#: How much longer a replay --screenshot's watchdog waits, past the timeout, for the window to
#: stop, draw and save, before it ends the process itself (``_watchdog``).
WATCHDOG_GRACE_S = 60.0


#: What Qt's X11 platform plugin (xcb) loads, with the Debian/Ubuntu package of each. Qt aborts the
#: process when one is missing ("could not load the Qt platform plugin"); KV Scope names them first.
XCB_LIBRARIES = (
    ("libxcb-cursor.so.0", "libxcb-cursor0"), ("libxkbcommon-x11.so.0", "libxkbcommon-x11-0"),
    ("libxcb-icccm.so.4", "libxcb-icccm4"), ("libxcb-keysyms.so.1", "libxcb-keysyms1"),
    ("libxcb-render-util.so.0", "libxcb-render-util0"), ("libxcb-image.so.0", "libxcb-image0"),
    ("libxcb-shape.so.0", "libxcb-shape0"), ("libxcb-randr.so.0", "libxcb-randr0"),
    ("libxcb-xkb.so.1", "libxcb-xkb1"), ("libEGL.so.1", "libegl1"), ("libfontconfig.so.1", "libfontconfig1"),
)


def display_problem(required: tuple[tuple[str, str], ...] = XCB_LIBRARIES) -> str | None:
    """Why no window can be shown here (None when one can): no display on Linux, or system libraries
    that Qt's X11 plugin needs and cannot load (named, with the packages that provide them)."""
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if platform.startswith(("offscreen", "minimal", "vnc")):
        return None
    if not (sys.platform.startswith("linux") or "bsd" in sys.platform):
        return None  # Windows and macOS always have a window system
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return "no display found (DISPLAY/WAYLAND_DISPLAY unset)"
    if platform.startswith("wayland") or (not platform and not os.environ.get("DISPLAY")):
        return None
    import ctypes

    missing = []
    for soname, package in required:
        try:
            ctypes.CDLL(soname)
        except OSError:
            missing.append((soname, package))
    if not missing:
        return None
    return (f"the window needs system libraries that are missing: {', '.join(s for s, _ in missing)} "
            f"(Debian/Ubuntu: sudo apt-get install {' '.join(p for _, p in missing)})")


def has_display() -> bool:
    """Whether a window can be shown here (see ``display_problem``)."""
    return display_problem() is None


def _application():
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    if app is None:
        app = QApplication(sys.argv[:1])
        app.setOrganizationName("KVScope")
        app.setApplicationName("KV Scope")
        app.setDesktopFileName("kvscope")  # matches packaging/kvscope.desktop, so docks group the window
        app.setWindowIcon(_app_icon())
        # Python's cycle collector runs only from a timer on the GUI thread (pyqtgraph's GarbageCollector): run by
        # whatever allocation came next, it could delete plot items inside a paint (a segfault in
        # GraphicsScene.prepareForPaint, seen once in the suite's window replay) or on a worker thread.
        from pyqtgraph.util.garbage_collector import GarbageCollector

        app.garbage_collector = GarbageCollector(interval=1.0)
    return app


def _app_icon():
    """The app icon at every size we ship (assets/icons/kvscope-N.png, made from kvscope.svg)."""
    from PySide6.QtGui import QIcon

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


def startup_request(window, request, tokens: int | None):
    """The run a launch starts: without ``--tokens``, as many tokens as the window's New tokens (the
    user's last choice, remembered; ``FIRST_START_TOKENS`` at first), not the terminal run's 128; the quality probe on
    where it is cheap (``kvscope.ui.controls.probe_is_cheap_for``), as the controls have it."""
    from kvscope.ui.controls import probe_is_cheap_for

    if not request.quality_probe and probe_is_cheap_for(request.source, request.runtime):  # the window's default
        request = replace(request, quality_probe=True)
    return request if tokens is not None else replace(request, max_new_tokens=window.controls.max_tokens_spin.value())


def run_window(request=None, screenshot: str | None = None, tokens: int | None = None, *,
               presenter: bool = False, size: tuple[int, int] | None = None, settings=None,
               observers: tuple = ()) -> int:
    """Open the window. With ``request`` the run starts at once.

    With ``screenshot``: generate ``tokens`` tokens (default: the request's max_new_tokens) with the
    request's settings and scripted switches, let the plots redraw, save a PNG of the whole window
    to ``screenshot`` and return 0 (1 if the run failed; the PNG then shows the error).
    """
    app = _application()
    from PySide6.QtCore import QEventLoop, QTimer

    from kvscope.ui.main_window import MainWindow  # Qt: only once display_problem() found a display

    throwaway = None
    if screenshot is not None and settings is None:
        # A screenshot must not depend on (or change) the user's remembered window and settings.
        settings = throwaway = _screenshot_settings()
    window = MainWindow(settings=settings)
    window.sample_observers.extend(observers)  # each gets every Sample the window takes (--metrics-port)
    if screenshot is not None:
        window.resize(*(size or (1600, 1000)))
    elif size:
        window.resize(*size)
    if presenter:
        window.set_presenter(True, fullscreen=screenshot is None)
    window.show()

    if screenshot is None:
        if request is not None:
            request = startup_request(window, request, tokens)
            window.apply_request(request)
            window.start_run(request)
        return app.exec()

    request = request or RunRequest()
    if tokens is not None:
        request = replace(request, max_new_tokens=max(int(tokens), 1))
    window.apply_request(request)
    wanted_switches = sum(1 for at, _k, _v in request.switches if at < request.max_new_tokens)
    loop = QEventLoop()
    outcome = {"timeout": False}

    def check(_n: int = 0) -> None:
        if window.decode_tokens >= request.max_new_tokens and window.session.switch_events >= wanted_switches:
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
    return _finish_screenshot(app, window, screenshot, code, outcome["timeout"], throwaway=throwaway)


def _finish_screenshot(app, window, screenshot, code: int, timed_out: bool, extra=lambda: "", *,
                       throwaway=None) -> int:
    """Stop the window's work, draw everything, save the PNG and say so. Returns the exit status.

    ``screenshot``: a path, or a ``kvscope.core.records.outputs.Output`` main.py checked (``-``: the PNG goes to
    standard output and the "saved" line to stderr). ``throwaway``: the QSettings of
    ``_screenshot_settings``, deleted once the window is closed.
    """
    window.shutdown()
    # Drain the queued samples and the finished signal, then draw every curve and number.
    _settle(app, window)
    if timed_out:
        print(f"kvscope: gave up after {SCREENSHOT_TIMEOUT_S:g} s with {window.decode_tokens} tokens",
              file=sys.stderr)
        code = 2
    elif window.last_error:
        print(f"kvscope: {window.last_error}", file=sys.stderr)
        code = 1
    try:
        path = window.save_screenshot(screenshot)
    finally:
        window.close()
        if throwaway is not None:
            _discard_settings(throwaway)
    if path is None:
        print(f"kvscope: could not save {display_path(str(screenshot))}: {window.controls.error_label.text()}",
              file=sys.stderr)
        return 2  # a user's error (a full disk, /dev/full), said in one line: exit 2 as every such line
    to_stdout = str(path) == "-"
    shown = "the PNG to standard output" if to_stdout else display_path(path)
    print(f"saved {shown} ({window.decode_tokens} tokens, {window.session.switch_events} switches{extra()})",
          file=sys.stderr if to_stdout else sys.stdout)
    return code


def _screenshot_settings():
    """Throwaway settings for a --screenshot window: never the user's, and no first-start banner.

    A fresh temporary INI file (``kvscope-screenshot-<pid>-*.ini`` in the temp folder), removed by
    ``_discard_settings`` when the screenshot is done, and at exit should anything fail before.
    Files a killed process left behind are removed by the next one (``_remove_stale_settings``).
    """
    import atexit
    import tempfile

    from PySide6.QtCore import QSettings

    _remove_stale_settings()
    fd, path = tempfile.mkstemp(prefix=f"kvscope-screenshot-{os.getpid()}-", suffix=".ini", dir=_temp_dir())
    os.close(fd)
    atexit.register(_remove_settings_file, path)
    settings = QSettings(path, QSettings.Format.IniFormat)
    settings.clear()
    settings.setValue("app/first_start_done", True)
    return settings


_SETTINGS_NAME = re.compile(r"^kvscope-screenshot-(\d+)(-[A-Za-z0-9_]+)?\.ini(\.lock)?$")


def _remove_stale_settings() -> None:
    """Delete ``kvscope-screenshot-<pid>[-*].ini`` files in the temp folder whose process is gone.

    Ours only (same owner), and only with a pid that is not running: a --screenshot killed before
    it could clean up, and the files older versions never removed (``kvscope-screenshot-<pid>.ini``).
    """
    import psutil

    folder = _temp_dir()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    uid = os.getuid() if hasattr(os, "getuid") else None
    for name in names:
        m = _SETTINGS_NAME.match(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(folder, name)
        try:
            if (uid is not None and os.lstat(path).st_uid != uid) or psutil.pid_exists(int(m.group(1))):
                continue
            os.remove(path)
        except (OSError, ValueError):
            pass


def _remove_settings_file(path: str) -> None:
    for name in (path, path + ".lock"):  # QSettings locks the file with a sibling while it syncs
        try:
            os.remove(name)
        except OSError:
            pass


def _discard_settings(settings) -> None:
    """Write out a throwaway QSettings (nothing left pending for its destructor to write later), then delete its file."""
    path = settings.fileName()
    settings.sync()
    _remove_settings_file(path)


def run_replay(path: str, speed: float = 1.0, screenshot: str | None = None, *, presenter: bool = False,
               size: tuple[int, int] | None = None, settings=None) -> int:
    """Play the recording at ``path`` in the window, ``speed`` times its recorded pace.

    Without ``screenshot`` the window stays open (returns the event loop's exit code). With it:
    play to the end as fast as the window takes the samples (a PNG shows the end, so ``speed`` is
    not waited for), let the plots settle, save a PNG of the window and return 0. A file that is
    not a readable recording (its header, model included, is checked) prints one line on stderr
    and returns 2 before any window opens; a recording with damaged or cut-off lines still plays
    what it can, says so in one line, and returns 1. A replay still running after
    ``SCREENSHOT_TIMEOUT_S`` is stopped, says so and returns 2; should the window stop answering
    (so that no timer can fire), a watchdog thread ends the process with status 2 shortly after.
    """
    if not speed or speed <= 0:
        print("kvscope: the replay speed must be positive", file=sys.stderr)
        return 2
    try:
        spec_from_header(read_header(path))
    except (RecordingError, OSError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"kvscope: {message}", file=sys.stderr)
        return 2
    app = _application()
    from PySide6.QtCore import QEventLoop, QTimer

    from kvscope.ui.main_window import MainWindow  # Qt: only once display_problem() found a display

    throwaway = None
    if screenshot is not None and settings is None:
        settings = throwaway = _screenshot_settings()
    window = MainWindow(settings=settings, start_engine=False)
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
    watchdog = _watchdog(SCREENSHOT_TIMEOUT_S + WATCHDOG_GRACE_S, lambda: f"{window.decode_tokens} tokens")
    try:
        code = 0
        if not window.open_recording(path, speed=math.inf):
            code = 1
        else:
            loop.exec()
        timer.stop()
        return _finish_screenshot(app, window, screenshot, code, outcome["timeout"],
                                  lambda: f", {window.session.spike_count} spikes", throwaway=throwaway)
    finally:
        watchdog.cancel()


def _watchdog(seconds: float, progress) -> threading.Timer:
    """The last resort behind a --screenshot's QTimer, which cannot fire while the GUI thread is busy
    (a layout that never ends, a blocking call): after ``seconds`` a thread prints one line and ends
    the process with status 2. ``progress()`` says how far it got (read from that thread: a plain
    attribute, no Qt call). Cancel it when the screenshot is done."""

    def fire() -> None:
        try:
            print(f"kvscope: gave up after {seconds:g} s (the window stopped responding) with {progress()}",
                  file=sys.stderr, flush=True)
        finally:
            os._exit(2)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def _temp_dir() -> str:
    import tempfile

    return tempfile.gettempdir()

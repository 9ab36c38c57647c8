"""Shared test setup: offscreen Qt before any QApplication, a per-checkout cache folder, no network."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Real Qt, no display: must be set before a QApplication exists.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# The embedded model and memoised parameter counts go to a folder of this checkout, so CI starts clean.
os.environ.setdefault("KVSCOPE_CACHE", str(ROOT / ".pytest_cache" / "kvscope"))
# Code of remote-code test models goes to one folder per session (transformers imports the
# `transformers_modules` package once, from one path), never to ~/.cache/huggingface/modules.
os.environ.setdefault("HF_MODULES_CACHE", str(ROOT / ".pytest_cache" / "hf-modules"))
# Tests never reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The window lists the models in the home folder (~/.ollama, ~/.lmstudio) and the Hugging Face cache
# (kvscope.core.model.installed): tests get an empty home of this checkout's own, so none sees the developer's models.
# Set before huggingface_hub is imported (it reads HF_HUB_CACHE once); a test builds its own stores.
_HOME = ROOT / ".pytest_cache" / "home"
_HOME.mkdir(parents=True, exist_ok=True)
os.environ["HOME"] = str(_HOME)
os.environ["HF_HUB_CACHE"] = str(_HOME / ".cache" / "huggingface" / "hub")
os.environ.pop("OLLAMA_MODELS", None)


# ------------------------------------------------------------------------------------------------
# The window, for the UI tests (Qt imported only by the tests that ask for it).

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _qt_garbage_at_safe_points(request):
    """In a test that drives Qt, Python's cycle collector runs before and after it, never inside: run by whatever
    allocation came next, it once deleted plot items inside a paint (a segfault in pyqtgraph's
    GraphicsScene.prepareForPaint during tests/test_recording_fuzz's window replay). The app does the same with
    pyqtgraph's GarbageCollector (ui/app.py)."""
    if "qtbot" not in request.fixturenames:
        yield
        return
    import gc

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


@pytest.fixture
def settings(tmp_path):
    """Throwaway QSettings, past the first start (no demo banner)."""
    from PySide6.QtCore import QSettings

    s = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    s.setValue("app/first_start_done", True)
    return s


def _shown_window(qtbot, settings, controller=None):
    """A shown MainWindow whose calculator has imported transformers (once, first)."""
    from kvscope.ui.main_window import MainWindow

    w = MainWindow(settings=settings, controller=controller)
    qtbot.addWidget(w)
    w.resize(1400, 900)
    w.show()
    qtbot.waitUntil(lambda: w.calculator.warm, timeout=60_000)
    return w


@pytest.fixture
def window(qtbot, settings):
    """The window as the app opens it (the model in the engine process), shut down after."""
    w = _shown_window(qtbot, settings)
    yield w
    w.shutdown()


@pytest.fixture
def thread_window(qtbot, settings):
    """The window with generation on a thread of this process (KVSCOPE_ENGINE=thread): for tests that
    patch the model's code here, where the engine process could not see the patch."""
    from kvscope.workers.generation import GenerationController

    w = _shown_window(qtbot, settings, GenerationController())
    yield w
    w.shutdown()

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

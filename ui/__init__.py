"""KV Scope's window (PySide6 + pyqtgraph). Never imports torch itself."""

from ui.pyside_fix import immortalize_none

immortalize_none()

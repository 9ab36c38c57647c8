"""KV Scope window: plots, calculator, stats (PySide6 + pyqtgraph; never torch)."""

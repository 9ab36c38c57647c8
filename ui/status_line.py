"""The window's status line: the device and its memory, the run state and the memory sampler's rate in the status
bar, and the sampler's longer note under the events table."""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import QLabel, QStatusBar

from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.model.spec import human_bytes
from kvscope.ui.badges import STATE_TEXT, ElidedLabel


class StatusLine(QObject):
    """The permanent labels of ``bar`` and ``sampler_label`` (placed by the window under the events table), and the
    passing message (``message_changed`` says each one, and "" when it goes, as QStatusBar's own signal did)."""

    message_changed = Signal(str)

    def __init__(self, bar: QStatusBar) -> None:
        super().__init__(bar)
        self.bar = bar
        # Elided, not as wide as their text: in presenter type on 1280 px the text alone is wider than the screen,
        # and a status bar's permanent widgets keep their minimum width.
        self.sampler_label = ElidedLabel("memory sampler: starting\u2026")
        self.sampler_label.setObjectName("statNote")
        self.device = ElidedLabel("no model loaded")
        self.device.setToolTip("The device the model runs on")
        self.memory = ElidedLabel("")
        self.memory.setToolTip("Device memory used / total (NVML), or this process's resident memory (RSS) without a GPU")
        self.state = QLabel("")
        self.sampler = QLabel("")
        self.sampler.setToolTip("The memory sampler: readings per second achieved (set in View \u203a Memory "
                                "sampling rate)")
        # The passing message (a switch, an error, the run's end): a label of its own that elides, with the whole
        # text as its tooltip. QStatusBar's own message is painted in what the permanent labels leave, cut
        # mid-word ("run ended after 120 toke" at 1024 px in presenter type).
        self.note = ElidedLabel("")
        self.note.min_shown = 6
        bar.addWidget(self.note, 1)
        self._clear = QTimer(bar)
        self._clear.setSingleShot(True)
        self._clear.timeout.connect(lambda: self.message(""))
        for w in (self.sampler, self.device, self.memory, self.state):
            bar.addPermanentWidget(w)

    def message(self, text: str, ms: int = 0) -> None:
        """Show ``text`` until the next message, or for ``ms`` milliseconds."""
        changed = text != self.note.text()
        self.note.setText(text)
        if ms > 0:
            self._clear.start(ms)
        else:
            self._clear.stop()
        if changed:
            self.message_changed.emit(text)

    def current_message(self) -> str:
        """The message shown now, whole (elided or not)."""
        return self.note.text()

    def show_sampler(self, sampling, replay: bool) -> None:
        """The sampler's achieved rate and its first note (a replay shows the memory that was recorded)."""
        rate = sampling.rate_text()
        note = sampling.notes[0] if sampling.notes else ""
        if replay:  # the sampler reads this machine; a replay shows the memory that was recorded
            note = "replay: memory as recorded (spikes from the recorded tokens)"
        self.sampler_label.setText(f"memory sampler {rate} (set {sampling.rate_hz:g} Hz)" + (f" \u00b7 {note}" if note else ""))
        self.sampler_label.setToolTip("\n".join([f"device probed: {sampling.device}"] + sampling.notes))
        self.sampler.setText(f"sampler {rate}")

    def show_model(self, info) -> None:
        memory = f" \u00b7 {human_bytes(info.total_memory)}" if info.total_memory else ""
        self.device.setText(f"{info.device_name}{memory}")
        self.message(f"loaded {safe_text(info.label, limit=NAME_LIMIT)} on {info.device_name} ({info.dtype})", 5000)

    def show_memory(self, s) -> None:
        """The device's used / total memory of a Sample, else this process's RSS."""
        if s.device_used is not None and s.device_total is not None:
            self.memory.setText(f"GPU {human_bytes(s.device_used)} / {human_bytes(s.device_total)}")
        elif s.process_rss is not None:
            self.memory.setText(f"host: this process {human_bytes(s.process_rss)} (RSS)")

    def show_state(self, state: str) -> None:
        self.state.setText(STATE_TEXT[state])

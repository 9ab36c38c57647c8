"""A speaker at the keys, on the window's live path without its pixels (issue 37, item 1).

The engine process's own driver (``kvscope.core.live.engine_process.RunDriver``: the run loop, the live
switches prepared off the token path, the backends prepared before a switch) runs a real model on a thread; the
real ``ControlsPanel`` says what each key asks from the settings the engine last reported, learns its refusals
and greys what cannot run, as in the window. Only the pipe and the plots are left out.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvscope.core.live.engine_process import RunDriver
from kvscope.core.live.session import canonical_switch
from kvscope.core.model.request import RunRequest
from kvscope.core.model.settings import ATTN_IMPLS, attention_choices, cache_choices
from kvscope.ui.controls import ControlsPanel

KEYS = ("1", "2", "3", "4", "5", "F", "C")
ANSWERS = ("switch", "refused", "note")


def press(panel: ControlsPanel, key: str) -> tuple[str, str | None]:
    """What key ``key`` asks from the settings the panel shows: (axis, value); value None when it offers nothing."""
    if key == "C":
        return ("cache", panel.next_cache())
    if key == "F":
        return ("attn-impl", panel.flash_toggled())
    return ("attention", panel.attention_for_key(int(key)))


def de_bruijn(symbols: tuple[str, ...], n: int) -> list[str]:
    """A cyclic sequence in which every string of ``n`` symbols appears exactly once as a window, unrolled so that
    the plain list holds each of them (len(symbols) ** n + n - 1 items)."""
    k = len(symbols)
    a = [0] * k * n
    out: list[int] = []

    def db(t: int, p: int) -> None:
        if t > n:
            if n % p == 0:
                out.extend(a[1:p + 1])
            return
        a[t] = a[t - p]
        db(t + 1, p)
        for j in range(a[t - p] + 1, k):
            a[t] = j
            db(t + 1, t)

    db(1, 1)
    return [symbols[i] for i in out + out[:n - 1]]


@dataclass
class Press:
    key: str
    axis: str
    value: str
    answer: Any = None  # the engine's event Sample
    longest_gap_s: float = 0.0  # between two tokens, from the press to its answer


@dataclass
class Speaker:
    """One live run and the keys pressed into it."""

    request: RunRequest
    panel: ControlsPanel
    messages: "queue.Queue[tuple[str, Any]]" = field(default_factory=queue.Queue)
    samples: list = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    presses: list[Press] = field(default_factory=list)
    last: Any = None
    finished: bool = False
    _token_times: list[float] = field(default_factory=list)

    def start(self, timeout_s: float = 180.0) -> "Speaker":
        self.driver = RunDriver(self.request, lambda kind, payload: self.messages.put((kind, payload)))
        self.thread = threading.Thread(target=self._run, name="kvscope-test-speaker-run", daemon=True)
        self.thread.start()
        self.until(lambda: self.last is not None and self.last.token >= 1, timeout_s)
        return self

    def _run(self) -> None:
        try:
            self.driver.run()
        finally:
            self.messages.put(("ended", None))

    def _take(self, kind: str, payload: Any) -> None:
        if kind == "loaded":
            info = payload
            self.panel.set_model(info.spec, str(info.device))
            self.panel.set_choices(tuple(info.attention_choices) or attention_choices(info.spec),
                                   tuple(info.cache_choices) or cache_choices(info.device),
                                   tuple(info.attn_impl_choices) or ATTN_IMPLS)
            self.panel.run_max_context = info.max_context
        elif kind == "samples":
            now = time.monotonic()
            for s in payload:
                self.samples.append(s)
                if not s.is_event:
                    self._token_times.append(now)
                self.last = s
                if s.is_event and s.event in ANSWERS:
                    self.panel.show_settings(s)  # the combos follow the engine; a refusal is learned
        elif kind == "errored":
            self.errors.append(str(payload))
        elif kind == "ended":
            self.finished = True

    def pump(self, wait_s: float = 0.02) -> None:
        try:
            self._take(*self.messages.get(timeout=wait_s))
            while True:
                self._take(*self.messages.get_nowait())
        except queue.Empty:
            pass

    def until(self, test, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.pump()
            if test():
                return True
            if self.finished or self.errors:
                return test()
        return test()

    def tokens(self, n: int, timeout_s: float = 60.0) -> None:
        """Let ``n`` more tokens come."""
        target = (self.last.token if self.last is not None else 0) + n
        self.until(lambda: self.last is not None and self.last.token >= target, timeout_s)

    def ask(self, key: str) -> Press | None:
        """Press ``key`` as the window would: what it asks from the settings shown, sent to the engine. None when
        the key offers nothing from here or asks for what already runs (the window then says so and sends nothing)."""
        self.panel.context_tokens = lambda: self.last.context_tokens
        self.panel.tokens_ahead = lambda: max(self.request.max_new_tokens - self.last.token, 0)
        self.panel.show_settings(self.last)
        axis, value = press(self.panel, key)
        if value is None:
            return None
        axis, value = canonical_switch(axis, value)
        if value == self.panel.running.get(axis):
            return None
        p = Press(key, axis, value)
        p.sent_at = len(self.samples)  # type: ignore[attr-defined]
        self.driver.command("switch", axis, value)
        self.presses.append(p)
        return p

    def answered(self, p: Press) -> bool:
        for s in self.samples[p.sent_at:]:  # type: ignore[attr-defined]
            if s.is_event and s.event in ANSWERS and s.switch_key == p.axis:
                p.answer = s
                return True
        return False

    def answer(self, p: Press, timeout_s: float = 240.0) -> Any:
        """Wait for the engine's answer to ``p`` (its switch, refusal or note on that axis)."""
        first = len(self._token_times)
        self.until(lambda: self.answered(p), timeout_s)
        if p.answer is not None:  # the gap the answer stood in counts: up to the first token after it
            after = len(self._token_times)
            self.until(lambda: len(self._token_times) > after, 30.0)
        times = self._token_times[max(first - 1, 0):]
        p.longest_gap_s = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        return p.answer

    def stop(self, timeout_s: float = 60.0) -> None:
        self.driver.stop()
        self.until(lambda: self.finished, timeout_s)
        self.thread.join(timeout_s)

    def events(self, kind: str) -> list:
        return [s for s in self.samples if s.is_event and s.event == kind]


def speaker(qtbot, request: RunRequest) -> Speaker:
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    return Speaker(request, panel).start()

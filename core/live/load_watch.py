"""SIGTERM or Ctrl+C while a terminal run is still loading its model ends the process within a second, in one line.

``run_terminal`` stops a run between two tokens: its signal handler only sets a flag. While the model loads
there is no token to stop at, and a load can block where no Python handler runs at all (a file that never
answers, read by Rust or C code: the FIFO of issue 38 ignored SIGTERM for 13 minutes). Python's C-level handler
still writes the signal's number to the wakeup descriptor (``signal.set_wakeup_fd``) at once, whatever the main
thread is doing; a thread of this module reads it, and when no Sample has arrived ``GRACE_S`` later (the model
is still loading, so nothing has been recorded) it says so on stderr, ends the runtime's child processes and
ends the process with 128 + the signal's number. Once the first Sample arrives the run's own stop applies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

__all__ = ["LoadWatch", "GRACE_S"]

#: How long the main thread has after a signal to show that the model loaded (its first Sample).
GRACE_S = 1.0
_WATCHED = {int(getattr(signal, name)): name for name in ("SIGINT", "SIGTERM") if hasattr(signal, name)}


class LoadWatch:
    """``observe`` every Sample of the run (the first one says the model has loaded); ``armed()`` around the run."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.loaded = threading.Event()

    def observe(self, _sample) -> None:
        self.loaded.set()

    @contextlib.contextmanager
    def armed(self):
        """Watch the signals for the duration of the block (only on the main thread, where signals are handled)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):  # another wakeup descriptor's owner, or no signals here
            reader.close()
            writer.close()
            yield
            return
        done = threading.Event()
        thread = threading.Thread(target=self._watch, args=(reader, done), name="kvscope-load-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            signal.set_wakeup_fd(previous)
            with contextlib.suppress(OSError):
                reader.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv
            thread.join(timeout=2)
            reader.close()
            writer.close()

    def _watch(self, reader: socket.socket, done: threading.Event) -> None:
        while not done.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            signums = [n for n in data if n in _WATCHED]
            if not signums or self.loaded.is_set():
                continue
            if self.loaded.wait(self.grace_s) or done.is_set():
                continue
            self._end(signums[0])

    @staticmethod
    def _end(signum: int) -> None:
        import multiprocessing

        os.write(2, f"kvscope: stopped by {_WATCHED[signum]} while the model was loading; nothing was generated "
                    "or recorded\n".encode())
        for child in multiprocessing.active_children():  # a runtime's own process, when it was loading there
            with contextlib.suppress(Exception):
                child.kill()
        os._exit(128 + signum)

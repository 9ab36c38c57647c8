"""Whether a process is stopped (SIGSTOP, SIGTSTP, a debugger): alive, yet it will never answer until continued."""

from __future__ import annotations

#: The states /proc/PID/stat gives a stopped process: "T" stopped by a signal, "t" stopped by a tracer.
_STOPPED = (b"T", b"t")


def is_stopped(pid: int | None) -> bool:
    """True when process ``pid`` is stopped, as Linux's ``/proc/PID/stat`` says (its third field). False where
    there is no /proc (macOS, Windows: a stopped child is then found by the caller's own timeout), for a process
    that has gone, and for ``None``."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return False
    # "PID (COMM) STATE ...": COMM may hold spaces and parentheses, so the state follows the last ')'
    _, _, rest = stat.rpartition(b")")
    return rest[1:2] in _STOPPED

"""Work around PySide6 6.12's None reference leak on Python 3.11.

PySide6 6.12 (abi3 wheels) returns ``None`` from every void method without taking a reference,
as if ``None`` were immortal (it is from Python 3.12 on, PEP 683). On 3.11 each call such as
``QPen.setWidth`` or ``QPainter.drawLine`` therefore drops one reference to ``None``, which starts
near 5,000: a window that paints at 30 Hz aborts within seconds with "Fatal Python error:
none_dealloc". Making ``None`` immortal by hand, as 3.12 does, is safe (``None`` is never freed
anyway) and is a no-op where the interpreter already does it.
"""

from __future__ import annotations

import ctypes
import sys

_HEADROOM = 1 << 60  # references: decades of leaked calls at millions per second


def immortalize_none() -> bool:
    """Give ``None`` (and ``True``/``False``) a reference count no leak can exhaust. True when applied (Python < 3.12)."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    # Methods returning bool leak True/False the same way.
    for singleton in (None, True, False):
        refcnt = ctypes.c_ssize_t.from_address(id(singleton))  # ob_refcnt is the first field of a PyObject
        if refcnt.value < _HEADROOM:
            refcnt.value += _HEADROOM
    return True

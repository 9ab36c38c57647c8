"""A switch's failure as the one line its refusal event carries: out of memory, or what transformers raised."""

from __future__ import annotations

import torch

from kvscope.core.model.spec import SettingsError, SpecError


def refuse(exc: BaseException) -> None:
    """Raise a switch's failure as the SettingsError its refusal event carries (an out-of-memory error, or what
    transformers raised, in one line); a SettingsError / SpecError as it is."""
    if isinstance(exc, (SettingsError, SpecError)):
        raise exc
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    why = "not enough memory for the conversion" if is_oom(exc) else \
        f"transformers could not run it ({type(exc).__name__}: {first})"
    raise SettingsError(f"{why}; nothing was changed") from exc


def is_oom(exc: BaseException) -> bool:
    """CUDA/MPS out-of-memory errors, and the CPU allocator's ("DefaultCPUAllocator: can't allocate memory")."""
    text = str(exc).lower()
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text \
        or "can't allocate memory" in text

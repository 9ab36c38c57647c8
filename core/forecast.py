"""OOM forecast and memory budget: plain arithmetic on bytes per token, free bytes and token rate.

"Out of memory at token N (about T s)": with ``free`` bytes left and each new token costing
``bytes_per_token``, the tokens that still fit are ``floor(free / bytes_per_token)``; the one
after them is the token that does not. The budget counts what an allocator holds for the model
(weights + KV cache + activations), not the runtime's own baseline (CUDA context, Python, torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from core.spec import human_bytes


@dataclass(frozen=True)
class Forecast:
    """The token whose memory will not fit, and about how long until it is generated.

    ``token`` counts like ``Sample.token`` (the index of the last token in the sequence).
    ``seconds`` is None when the token rate is unknown. ``free_bytes`` and ``bytes_per_token`` are
    the inputs the forecast was made from.
    """

    token: int
    seconds: float | None
    free_bytes: int
    bytes_per_token: float

    @property
    def tokens_left(self) -> int:
        """Tokens that still fit before ``token``: ``floor(free_bytes / bytes_per_token)``."""
        return int(max(self.free_bytes, 0) // self.bytes_per_token)

    def message(self) -> str:
        """``out of memory at token 5120 (about 12 s)`` — for the window and the CLI."""
        if self.seconds is None:
            return f"out of memory at token {self.token}"
        return f"out of memory at token {self.token} (about {_seconds(self.seconds)})"

    def warning(self, threshold_s: float) -> str | None:
        """A warning line when the OOM is at most ``threshold_s`` seconds away, else None."""
        if self.seconds is None or self.seconds > threshold_s:
            return None
        return (f"warning: {self.message()}: {human_bytes(max(self.free_bytes, 0))} free, "
                f"{human_bytes(self.bytes_per_token)} per token")


def _seconds(s: float) -> str:
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min"


def forecast_oom(bytes_per_token: float, free_bytes: int, tokens_per_s: float | None,
                 current_token: int) -> Forecast | None:
    """When memory runs out if each new token costs ``bytes_per_token`` bytes.

    ``free_bytes`` is what is left now (device free, or budget minus use); ``current_token`` is the
    last token generated; ``tokens_per_s`` the generation rate (None or <= 0: no time estimate).
    Returns None when memory is not growing (``bytes_per_token <= 0``): it never runs out.
    The seconds are until the failing token is generated: ``(token - current_token) / tokens_per_s``.
    """
    if not math.isfinite(bytes_per_token) or bytes_per_token <= 0:
        return None
    fit = int(max(free_bytes, 0) // bytes_per_token)
    token = current_token + fit + 1
    seconds = None
    if tokens_per_s is not None and math.isfinite(tokens_per_s) and tokens_per_s > 0:
        seconds = (token - current_token) / tokens_per_s
    return Forecast(token=token, seconds=seconds, free_bytes=int(free_bytes), bytes_per_token=float(bytes_per_token))


def estimate_bytes_per_token(tokens: Sequence[int], values: Sequence[int | None], last_n: int = 32) -> float | None:
    """Least-squares bytes per token over the last ``last_n`` (token, bytes) points, or None.

    Use the KV bytes observed (or the allocator's allocated bytes) at each decode token. Points
    with None are skipped; fewer than two distinct tokens give None.
    """
    pts = [(float(t), float(v)) for t, v in zip(tokens, values) if v is not None][-last_n:]
    if len({t for t, _ in pts}) < 2:
        return None
    mt = sum(t for t, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    cov = sum((t - mt) * (v - mv) for t, v in pts)
    return cov / var


def budget_used(weights: int, kv_observed: int, activations_predicted: int) -> int:
    """Bytes the budget counts: weights + KV cache as observed + activations as predicted."""
    for name, value in (("weights", weights), ("kv_observed", kv_observed),
                        ("activations_predicted", activations_predicted)):
        if value is None or value < 0:
            raise ValueError(f"{name} must be a non-negative number of bytes, got {value!r}")
    return int(weights) + int(kv_observed) + int(activations_predicted)


def budget_check(weights: int, kv_observed: int, activations_predicted: int, budget: int) -> bool:
    """True while weights + observed KV + predicted activations fit in ``budget`` bytes."""
    if budget <= 0:
        raise ValueError(f"memory budget must be positive, got {budget!r}")
    return budget_used(weights, kv_observed, activations_predicted) <= budget


def tokens_until_budget(weights: int, kv_observed: int, activations_predicted: int, budget: int,
                        bytes_per_token: float) -> int | None:
    """How many more tokens fit in ``budget`` bytes; 0 when it is already reached; None if not growing."""
    if budget <= 0:
        raise ValueError(f"memory budget must be positive, got {budget!r}")
    if not math.isfinite(bytes_per_token) or bytes_per_token <= 0:
        return None
    free = budget - budget_used(weights, kv_observed, activations_predicted)
    return int(max(free, 0) // bytes_per_token)


def budget_forecast(weights: int, kv_observed: int, activations_predicted: int, budget: int,
                    bytes_per_token: float, tokens_per_s: float | None, current_token: int) -> Forecast | None:
    """The token at which the budget will be exceeded, as a Forecast (see ``forecast_oom``)."""
    if budget <= 0:
        raise ValueError(f"memory budget must be positive, got {budget!r}")
    free = budget - budget_used(weights, kv_observed, activations_predicted)
    return forecast_oom(bytes_per_token, free, tokens_per_s, current_token)

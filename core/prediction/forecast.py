"""OOM forecast and memory budget: plain arithmetic on bytes per token, free bytes and token rate.

"Out of memory at token N (about T s)": with ``free`` bytes left and each new token costing
``bytes_per_token``, the tokens that still fit are ``floor(free / bytes_per_token)``; the one
after them is the token that does not. The budget counts what an allocator holds for the model
(weights + KV cache + activations), not the runtime's own baseline (CUDA context, Python, torch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.core.base.sample import Sample
from kvscope.core.model.spec import human_bytes


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
        return f"out of memory at token {self.token} (about {format_duration(self.seconds)})"

    def warning(self, threshold_s: float) -> str | None:
        """A warning line when the OOM is at most ``threshold_s`` seconds away, else None."""
        if self.seconds is None or self.seconds > threshold_s:
            return None
        return (f"warning: {self.message()}: {human_bytes(max(self.free_bytes, 0))} free, "
                f"{human_bytes(self.bytes_per_token)} per token")


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


#: The forecast turns into a warning when out of memory is this close (seconds).
OOM_WARN_S = 10.0


def format_duration(seconds: float | None) -> str:
    """'4.2 s', '38 s', '12 min', '3.5 h', '9 days' for the forecast."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.0f} days"


@dataclass(frozen=True)
class OomForecast:
    """The window's forecast: when memory (or the budget) runs out, from what."""

    forecast: Forecast
    limit: str  # "GPU memory", "host memory" or "memory budget"
    #: The token at which the run's context ends, when that comes before the memory runs out.
    context_first: int | None = None

    @property
    def token(self) -> int:
        return self.forecast.token

    @property
    def seconds(self) -> float | None:
        return self.forecast.seconds

    def message(self) -> str:
        """'out of memory at token 5,120 (about 12 s)'; 'memory budget reached at ...' for a budget;
        the context's end when it comes first."""
        if self.context_first is not None:
            return (f"the context ends at token {self.context_first:,}, before the {self.limit} would run out "
                    f"(token {self.token:,})")
        what = "memory budget reached" if self.limit == "memory budget" else "out of memory"
        when = f" (about {format_duration(self.seconds)})" if self.seconds is not None else ""
        return f"{what} at token {self.token:,}{when}"

    def warning(self, threshold_s: float = OOM_WARN_S) -> bool:
        return self.context_first is None and self.seconds is not None and self.seconds <= threshold_s


def oom_forecast(points: list[tuple[int, int]], last: Sample | None, *, free: int | None, free_source: str,
                 budget: int | None = None, max_context: int | None = None) -> OomForecast | None:
    """Forecast from recent (token, KV bytes) ``points`` (since the last switch), free bytes and a budget.

    Bytes per token is the least-squares slope of the points (``estimate_bytes_per_token``); the
    budget counts weights + KV + activations (``budget_forecast``). The earlier of the two wins.
    None when memory is not growing or nothing is known.
    """
    if last is None:
        return None
    bpt = estimate_bytes_per_token([p[0] for p in points], [p[1] for p in points])
    if bpt is None or bpt <= 0:
        return None
    best: OomForecast | None = None
    if free is not None:
        f = forecast_oom(bpt, free, last.tokens_per_s, last.token)
        if f is not None:
            best = OomForecast(f, free_source)
    if budget is not None and last.weights_bytes is not None and last.kv_bytes_reserved is not None:
        try:
            f = budget_forecast(last.weights_bytes, last.kv_bytes_reserved, last.activations_predicted or 0, budget,
                                bpt, last.tokens_per_s, last.token)
        except ValueError:
            f = None
        if f is not None and (best is None or f.token < best.token):
            best = OomForecast(f, "memory budget")
    if best is not None and max_context:
        # Tokens are counted from the first generated one; the context also holds the prompt.
        last_token = max_context - max(last.context_tokens - last.token, 0)
        if last_token < best.token:
            best = dataclasses.replace(best, context_first=last_token)
    return best

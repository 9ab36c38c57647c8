"""Observed versus predicted, like with like: the totals that can be compared for a sample, and the
error of a prediction in percent. Plain arithmetic on a Sample (no Qt), used by the plots."""

from __future__ import annotations

from kvscope.core.base.sample import Sample


def observed_and_predicted_total(s: Sample) -> tuple[int | None, int | None]:
    """Observed total and the prediction of the same quantity (like with like).

    With a device allocator (CUDA/MPS) the observed total is what it has allocated, compared with the
    predicted weights + KV + activations. Without one, it is the measured weights + KV tensors,
    compared with the predicted weights + KV.
    """
    if s.allocator_allocated is not None:
        return s.allocator_allocated, s.total_predicted
    observed = None
    if s.weights_bytes is not None and s.kv_bytes_observed is not None:
        observed = s.weights_bytes + s.kv_bytes_observed
    predicted = None
    if s.weights_predicted is not None and s.kv_bytes_predicted is not None:
        predicted = s.weights_predicted + s.kv_bytes_predicted
    return observed, predicted


def error_percent(observed: int | None, predicted: int | None) -> float | None:
    """(observed - predicted) / predicted in %, or None when either is not available or predicted is 0."""
    if observed is None or predicted is None or predicted == 0:
        return None
    return 100.0 * (observed - predicted) / predicted

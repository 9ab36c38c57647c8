"""Observed versus predicted, like with like: the totals that can be compared for a sample, and the
error of a prediction in percent. Plain arithmetic on a Sample (no Qt), used by the plots."""

from __future__ import annotations

from kvscope.core.base.sample import Sample


def observed_and_predicted_total(s: Sample) -> tuple[int | None, int | None]:
    """Observed total and the prediction of the same quantity (like with like).

    - A device allocator with a peak counter (CUDA; the engine resets it before each forward pass): the step's
      peak (weights, KV and the pass's temporaries) against ``total_predicted`` (weights + KV + the pass's
      activation peak beyond them, ``kvscope.core.prediction.predict.forward_activations``). Not the allocated bytes after the step:
      by then the temporaries are gone and the prediction counts them.
    - A runtime that reads its compute buffer back (``activations_observed``): the model buffers + KV
      reserved + compute buffer against the predicted three (the output buffer is not read back, so it is in
      neither).
    - Otherwise (the CPU, where the resident set also holds Python, libraries and freed-but-cached blocks): the
      weights and KV tensors, walked, against predicted weights + KV. Never the RSS against a prediction.
    """
    if s.allocator_peak is not None and s.total_predicted is not None:
        return s.allocator_peak, s.total_predicted
    kv_observed = s.kv_bytes_reserved
    observed = s.weights_bytes + kv_observed if s.weights_bytes is not None and kv_observed is not None else None
    predicted = (s.weights_predicted + s.kv_bytes_predicted
                 if s.weights_predicted is not None and s.kv_bytes_predicted is not None else None)
    if s.activations_observed is not None and s.activations_predicted is not None:
        observed = observed + s.activations_observed if observed is not None else None
        predicted = predicted + s.activations_predicted if predicted is not None else None
    return observed, predicted


def error_percent(observed: int | None, predicted: int | None) -> float | None:
    """(observed - predicted) / predicted in %, or None when either is not available or predicted is 0."""
    if observed is None or predicted is None or predicted == 0:
        return None
    return 100.0 * (observed - predicted) / predicted

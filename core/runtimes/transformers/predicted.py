"""What the predictor says of an engine's instant: its settings as the predictor reads them, and the peak and the
activations of a forward pass of its model (``kvscope.core.prediction.predict``), for the Sample that measures them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvscope.core.base.sample import PHASE_PREFILL
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.caches import Static
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.spec import SpecError

if TYPE_CHECKING:
    from kvscope.core.runtimes.transformers.engine import Engine


def predicted_peak(engine: "Engine", new_tokens: int, past_tokens: int) -> int | None:
    """kvscope.core.prediction.predict.prefill_peak for this engine's model, settings, device and threads (None: a spec the replay
    cannot follow)."""
    from kvscope.core.prediction.predict import prefill_peak

    try:
        return prefill_peak(engine.spec, prediction_settings(engine), new_tokens, past_tokens=past_tokens,
                            **peak_context(engine)).peak
    except (SettingsError, SpecError, ValueError, ZeroDivisionError):
        return None


def peak_context(engine: "Engine") -> dict[str, Any]:
    """What the replay needs of the machine: the device, the CPU's threads and oneDNN's matmul scratch."""
    from kvscope.core.runtimes.transformers.peak import matmul_scratch

    cpu = engine.device == "cpu"
    return {"device": "cuda" if engine.device.startswith("cuda") else engine.device,
            "cpu_threads": torch.get_num_threads(),
            "matmul_scratch": matmul_scratch(engine.model.dtype) if cpu else None}


def predicted_activations(engine: "Engine", phase: str, n: int, rerun: bool, pred: Any) -> int:
    """Bytes the forward pass that made this Sample held at its peak beyond the weights and the KV it left
    (kvscope.core.prediction.predict.forward_activations: the prefill or re-run of ``n`` tokens, else one decode step on n - 1),
    so that weights + KV + this is the predicted total of the step, what a device allocator's peak counter
    reads. oneDNN's matmul scratch is left out here (asking oneDNN costs a profiled matmul per new shape, and
    eager's decode shapes change every token; at most ~200 KB); the old estimate where the replay cannot go."""
    from kvscope.core.prediction.predict import forward_activations

    if n == 0:
        return 0  # no forward pass yet (the load event)
    full = phase == PHASE_PREFILL or rerun
    try:
        return forward_activations(engine.spec, prediction_settings(engine), n if full else 1,
                                   0 if full else max(n - 1, 0),
                                   **(peak_context(engine) | {"matmul_scratch": None}))
    except (SettingsError, SpecError, ValueError, ZeroDivisionError):
        return pred.activations_prefill if phase == PHASE_PREFILL else pred.activations_decode


def prediction_settings(engine: "Engine") -> RunSettings:
    """Settings as the predictor needs them: a static cache's preallocated length made explicit."""
    if isinstance(engine.settings.cache, Static):
        return engine.settings.with_(max_context=engine.max_context())
    return engine.settings

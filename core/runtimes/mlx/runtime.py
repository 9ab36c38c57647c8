"""The MLX runtime behind the seam (``kvscope.core.runtimes.base.Runtime``): ``MlxEngine`` in this process.

``open_runtime`` checks what it can without MLX (the folder, its config, the cache against the head dim) and
returns a runtime whose ``load`` imports mlx and mlx-lm and loads the weights.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.model.attention import SettingsError, native_attention
from kvscope.core.model.hf_config import read_config_json, spec_from_config
from kvscope.core.model.request import ModelInfo, RunRequest
from kvscope.core.model.spec import SpecError, human_bytes
from kvscope.core.runtimes.mlx.calc import MLX_LM_VERSION
from kvscope.core.runtimes.mlx.engine import MlxEngine, cache_refusal
from kvscope.core.runtimes.mlx.load import resolve_model
from kvscope.core.runtimes.mlx.predict import STEP, layers_of
from kvscope.core.runtimes.mlx.switches import MlxOptions, check_options

NAME = "mlx"


class MlxRuntime:
    """A model folder in mlx-lm, one sequence, in this process; a ``kvscope.core.runtimes.base.Runtime``."""

    name = NAME

    def __init__(self, request: RunRequest, progress: Callable[[str], None]) -> None:
        self.request = request
        self.progress = progress
        self.options: MlxOptions = request.options_for(NAME) or MlxOptions()
        self.cache = check_options(self.options)
        self.folder = resolve_model(request.source, progress, request.trust_remote_code)
        try:
            self.spec = spec_from_config(read_config_json(self.folder / "config.json"), self.folder.name)
        except SpecError as exc:
            raise SettingsError(str(exc)) from None
        # Before the weights load: mlx-lm's own word on the quantized cache (a QuantizedKVCache of zeros in the
        # config's head shapes), then the predictor's rule, which agrees with it.
        layers = layers_of(self.spec)
        problem = cache_refusal(layers, self.cache)
        if problem:
            raise SettingsError(f"--kv-group-size {self.cache.group_size}: {problem}")
        self.attention = native_attention(self.spec).key
        self.engine: Any = None
        self.generated = 0
        self.t0 = time.perf_counter()

    def load(self) -> None:
        device = str(self.request.device or "auto").lower()
        if device != "auto":
            import mlx.core as mx

            mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
        self.progress(f"loading {self.folder.name} into MLX")
        label = self.spec.label if self.request.source in ("", "embedded") else None
        self.engine = MlxEngine(self.folder, self.cache, seed=self.request.seed,
                                prefill_step=self.options.prefill_step_size, label=label)
        self.spec = self.engine.spec

    def model_info(self) -> ModelInfo:
        return self.engine.model_info(str(self.request.source))

    def settings(self, request: RunRequest) -> dict[str, Any]:
        e = self.engine

        return {"runtime": NAME, "attention": e.attention, "attn_impl": "mlx-sdpa", "cache": e.cache_key, "batch": 1,
                "max_new_tokens": request.max_new_tokens, "max_context": e.spec.max_position_embeddings,
                "dtype": str(e.dtype).replace("mlx.core.", ""), "source": request.source,
                "switches": [list(s) for s in request.switches], "memory_budget": None,
                "mlx": {"cache": e.cache_key, "prefill_step_size": e.prefill_step, "step": STEP,
                        "mlx_lm": MLX_LM_VERSION, "device": e.device, "folder": self.folder.name}}

    def start_events(self, request: RunRequest) -> list[Sample]:
        e = self.engine
        return [e.event("load", f"loaded {request.label or self.folder.name} into MLX ({human_bytes(e.weights)} of weights, "
                                f"{str(e.dtype).replace('mlx.core.', '')}) on the {e.device.upper()}"),
                e.event("note", f"MLX cache: {e.describe_cache()}; a KVCache takes {STEP} token slots at a time "
                                "(reserved: the whole steps; held: the slots with tokens)")]

    def prefill(self, request: RunRequest) -> list[Sample]:
        first = self.engine.prefill(request.prompt)
        self.generated = self.engine.generated
        return [first]

    def step(self) -> Sample:
        sample = self.engine.step()
        self.generated = self.engine.generated
        return sample

    def apply(self, key: str, value: str) -> Sample:
        return self.engine.apply(key, value)

    def event(self, kind: str, text: str, **fields: Any) -> Sample:
        if self.engine is not None and self.engine.model is not None:
            return self.engine.event(kind, text, **fields)
        return Sample(token=self.generated, phase=PHASE_EVENT, time_s=time.perf_counter() - self.t0, text=text,
                      attention=self.attention, attn_impl="mlx-sdpa", cache=self.cache.key, kernel="mlx",
                      device="n/a", dtype=self.spec.dtype, kv_bytes_held=None, kv_bytes_reserved=None,
                      kv_bytes_storage=None, weights_bytes=None, event=kind, runtime=NAME, **fields)

    def room(self) -> str | None:
        if self.engine is None or not self.engine.full():
            return None
        return (f"the context is full at {len(self.engine.tokens):,} tokens (the model's "
                f"{self.engine.spec.max_position_embeddings:,} positions); the run ends here")

    def plan(self, tokens: int) -> int | None:
        if self.engine is None or not self.engine.predictable:
            return None
        track = self.engine.track
        ahead = int(tokens) - track.offset
        if ahead < 0:
            return None
        future = type(track)(track.layers, track.cache, [t.copy() for t in track.tracks])
        future.decode(ahead)
        return future.nbytes

    def budget_need(self, ahead: int) -> int | None:  # noqa: ARG002
        return None

    def out_of_memory(self, exc: BaseException, where: str) -> str | None:  # noqa: ARG002
        return None

    def error_context(self) -> str:
        cache = self.engine.cache_key if self.engine is not None else self.cache.key
        return f"(at token {self.generated}; mlx, cache {cache})"

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def open_runtime(request: RunRequest, progress: Callable[[str], None]) -> MlxRuntime:
    """Checks (a model folder mlx-lm can load, a cache that fits its heads), then a runtime to ``load()``."""
    return MlxRuntime(request, progress)
